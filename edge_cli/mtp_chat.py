"""The chat-like prompt set for the MTP heads' data (`train-mtp --prompt-set chat`): open writing, roleplay,
reasoning puzzles, math word problems, coding tasks, extraction from short made-up passages, and questions on
science and the humanities. Written for this repo (none is an MT-Bench question: MT-Bench is the evaluation
set); the templates' numbers and names are drawn with a seeded RNG, so the list is the same on every machine.

At equal size (about 175,000 answer tokens) heads trained on the model's answers to these prompts verify 1.518
tokens per verification on MT-Bench against 1.448 for the small set's (bench-results/logs/chat-data-small).
`chat_prompts(per_kind=100)` is the list that probe answered (658 prompts).

`written_prompts` is the other chat set (`train-mtp --prompt-set written`): 12,240 prompts written one by one
(edge_runtime/data/mtp_written_prompts.json, six rounds of six kinds of 340), none a template's."""
import json
import os
import random

from edge_runtime import DATA_DIR

WRITING_FORMS = ["a blog post", "a short speech", "a persuasive email", "a product description", "a cover letter",
                 "a short story opening", "a thank-you note", "a newsletter introduction", "a restaurant review",
                 "a motivational message", "an apology letter", "a social media post", "a travel diary entry",
                 "a two-paragraph essay", "a limerick", "a press release"]
WRITING_SUBJECTS = ["a weekend hiking trip in the mountains", "a new reusable water bottle", "a local farmers' market",
                    "volunteering at an animal shelter", "learning to play the guitar as an adult", "a small coffee shop opening",
                    "a city that banned cars from its centre", "the first day at a new job", "a community garden project",
                    "a bicycle repair workshop", "a family recipe for lentil soup", "a solar-powered backpack",
                    "a school science fair", "moving to a new country", "an online course on photography",
                    "a late train that changed someone's day", "a quiet library in winter", "a marathon for charity"]
WRITING_TWISTS = ["", " Keep it under 150 words.", " Use a friendly, upbeat tone.", " Make it formal.",
                  " Include a catchy title.", " End with a question to the reader."]
ROLES = ["a pirate captain", "a medieval blacksmith", "a detective from the 1920s", "a friendly robot", "a tour guide in Rome",
         "a grumpy cat", "a famous chef", "an astronaut on the Moon", "a wise old librarian", "a sports coach before a final",
         "a time traveller from the year 3000", "a nervous first-time pilot", "a fairy-tale dragon", "a museum curator",
         "a personal fitness trainer", "a customer service agent for an airline"]
ROLE_ASKS = ["Introduce yourself and describe your typical day.", "What advice would you give to a beginner?",
             "Tell me about the biggest challenge you have faced.", "How do you feel about modern technology?",
             "Describe your favourite place in a few sentences.", "Convince me to join you on your next adventure.",
             "What would you say to someone who is having a bad day?", "Explain your job to a child."]
NAMES = ["Alice", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kira", "Liam", "Maya", "Noah"]
ITEMS = [("apples", 0.5), ("notebooks", 2.25), ("pencils", 0.8), ("tickets", 12.0), ("sandwiches", 4.5), ("plants", 7.0)]
LANGS = ["Python", "JavaScript", "C++", "Java", "Go", "Rust"]
CODE_TASKS = ["checks whether a string is a palindrome", "returns the n-th Fibonacci number", "counts the vowels in a string",
              "merges two sorted lists into one sorted list", "removes duplicates from a list while keeping the order",
              "finds the second largest number in a list", "reverses the words in a sentence",
              "checks whether a number is prime", "computes the factorial of n iteratively", "flattens a nested list",
              "returns the most frequent element of a list", "converts Celsius to Fahrenheit for a list of values",
              "validates that brackets in a string are balanced", "implements binary search on a sorted array",
              "computes the greatest common divisor of two integers", "reads a CSV file and sums one column",
              "counts word frequencies in a text", "rotates a matrix by 90 degrees", "checks if two strings are anagrams",
              "finds the longest common prefix of a list of strings"]
CODE_ASKS = ["Write a {lang} function that {task}.", "Write a {lang} function that {task}, and explain how it works.",
             "Here is my task: a function that {task}. Write it in {lang} with a short docstring and one example.",
             "What is an efficient way in {lang} to write a function that {task}? Give the code."]
PRODUCTS = ["laptop", "blender", "running shoes", "headphones", "electric kettle", "office chair", "tent", "camera"]
CITIES = ["Lisbon", "Osaka", "Toronto", "Nairobi", "Oslo", "Lima", "Hanoi", "Dublin", "Krakow", "Perth"]
STEM = ["How does a refrigerator keep food cold?", "Why is the sky blue during the day and red at sunset?",
        "What is the difference between a virus and a bacterium?", "How do noise-cancelling headphones work?",
        "Explain what entropy means in thermodynamics.", "What happens inside a star when it runs out of fuel?",
        "How does GPS determine your location?", "Why do we have seasons on Earth?", "What is a p-value in statistics?",
        "How does an electric motor turn electricity into motion?", "What is the role of enzymes in digestion?",
        "Explain how a neural network learns from data.", "What is the difference between speed and velocity?",
        "How do antibiotics work, and why can bacteria become resistant?", "What is Ohm's law? Give an example.",
        "How are rainbows formed?", "What is the greenhouse effect?", "How do batteries store energy?",
        "Explain the difference between mitosis and meiosis.", "What is a derivative in calculus, intuitively?"]
HUMANITIES = ["What were the main causes of the Industrial Revolution?", "Compare the philosophies of Plato and Aristotle.",
              "Why did the Roman Republic become an empire?", "What makes a novel a classic?",
              "How has social media changed the way people communicate?", "Discuss the role of music in human cultures.",
              "What are the main ideas of utilitarianism?", "Why do people study history?",
              "Explain the significance of the printing press for Europe.", "What is the difference between a democracy "
              "and a republic?", "How did the Silk Road influence trade and culture?", "What is the purpose of art?",
              "Discuss the pros and cons of globalization.", "What can we learn from ancient Greek tragedies?",
              "Why do languages change over time?", "How did the invention of writing change societies?"]
HUM_TWISTS = ["", " Answer in three paragraphs.", " Give two examples.", " Explain it for a high-school student."]


def _puzzle(rng):
    a, b, c = rng.sample(NAMES, 3)
    kind = rng.randrange(5)
    if kind == 0:
        return f"{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain your reasoning."
    if kind == 1:
        n = rng.randrange(3, 9)
        return (f"{a} has {n} more marbles than {b}. Together they have {2 * rng.randrange(10, 30) + n} marbles. "
                f"How many marbles does each of them have? Think step by step.")
    if kind == 2:
        d = rng.choice(["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"])
        k = rng.randrange(2, 20)
        return f"If today is {d}, what day of the week will it be in {k} days? Explain how you worked it out."
    if kind == 3:
        return (f"{a}, {b} and {c} each have a different pet: a cat, a dog and a parrot. {a} does not have the dog. "
                f"{b} has the parrot. Who has which pet?")
    n = rng.randrange(4, 12)
    return f"In a race of {n} runners, {a} overtakes the runner in second place. What position is {a} in now? Why?"


def _math(rng):
    name = rng.choice(NAMES)
    item, price = rng.choice(ITEMS)
    kind = rng.randrange(5)
    if kind == 0:
        n = rng.randrange(3, 25)
        return f"{name} buys {n} {item} at ${price:.2f} each. How much does {name} pay in total? Show your work."
    if kind == 1:
        p, r = rng.randrange(500, 5000, 100), rng.choice([2, 3, 4, 5, 6])
        return f"What is the simple interest on ${p} at {r}% per year for {rng.randrange(2, 8)} years?"
    if kind == 2:
        a, b = rng.randrange(2, 15), rng.randrange(2, 15)
        return f"Solve for x: {a}x + {b} = {a * rng.randrange(1, 10) + b}. Explain each step."
    if kind == 3:
        w, h = rng.randrange(3, 20), rng.randrange(3, 20)
        return f"A rectangle is {w} cm wide and {h} cm tall. What are its area and its perimeter?"
    s, t = rng.randrange(40, 120, 5), rng.choice([1.5, 2, 2.5, 3, 4])
    return f"A car travels at {s} km/h for {t} hours. How far does it go? Then how long would {s * 2} km take?"


def _extraction(rng):
    kind = rng.randrange(3)
    if kind == 0:
        p, c = rng.choice(PRODUCTS), rng.choice(CITIES)
        stars, price = rng.randrange(1, 6), rng.randrange(20, 900)
        text = (f"I bought this {p} last month in {c} for ${price}. Delivery took {rng.randrange(2, 12)} days. "
                f"Overall I would give it {stars} out of 5 stars: it works, but "
                f"{rng.choice(['the battery life is short', 'it is louder than expected', 'the manual is confusing', 'it arrived scratched'])}.")
        return f"Extract the product, city, price and star rating from this review as JSON:\n\n{text}"
    if kind == 1:
        names = rng.sample(NAMES, 3)
        text = " ".join(f"{n} joined the company in {rng.randrange(2005, 2024)} and works in "
                        f"{rng.choice(['sales', 'engineering', 'marketing', 'finance', 'support'])}." for n in names)
        return f"List each person's name, joining year and department from the text below as a table.\n\n{text}"
    c = rng.sample(CITIES, 3)
    text = " ".join(f"In {x}, the average July temperature is {rng.randrange(12, 34)} degrees Celsius and it rains on "
                    f"{rng.randrange(1, 20)} days." for x in c)
    return f"Which city is the warmest in July according to this text? Give each city's figures first.\n\n{text}"


def chat_prompts(seed: int = 0, per_kind: int = 2000) -> list[str]:
    """`per_kind` draws of each of the eight kinds, in turn, duplicates dropped (the kinds with few templates
    run out first), shuffled with `seed`: 6,615 prompts at the default."""
    rng = random.Random(seed)
    out = []
    for _ in range(per_kind):
        out.append(f"Write {rng.choice(WRITING_FORMS)} about {rng.choice(WRITING_SUBJECTS)}.{rng.choice(WRITING_TWISTS)}")
        out.append(f"Pretend you are {rng.choice(ROLES)}. {rng.choice(ROLE_ASKS)}")
        out.append(_puzzle(rng))
        out.append(_math(rng))
        out.append(rng.choice(CODE_ASKS).format(lang=rng.choice(LANGS), task=rng.choice(CODE_TASKS)))
        out.append(_extraction(rng))
        out.append(rng.choice(STEM) + rng.choice(HUM_TWISTS))
        out.append(rng.choice(HUMANITIES) + rng.choice(HUM_TWISTS))
    out = list(dict.fromkeys(out))  # no prompt twice
    rng.shuffle(out)
    return out


def written_rounds() -> list[dict[str, list[str]]]:
    """The written prompts as stored: rounds, each written at one time, each six kinds (writing, roleplay,
    reasoning_math, coding, extraction, knowledge)."""
    with open(os.path.join(DATA_DIR, "mtp_written_prompts.json"), encoding="utf-8") as f:
        return json.load(f)["rounds"]


def written_kinds() -> dict[str, list[str]]:
    """The written prompts by kind, each kind's rounds one after the other."""
    out: dict[str, list[str]] = {}
    for written in written_rounds():
        for kind, prompts in written.items():
            out.setdefault(kind, []).extend(prompts)
    return out


def written_prompts(seed: int = 0) -> list[str]:
    """Every written prompt: each round's kinds mixed in an order shuffled with `seed` (so `--prompts N` takes
    some of each), the rounds one after the other, so a round added later leaves the earlier prompts' order,
    and `--prompts N` over them, as it was."""
    rng, out = random.Random(seed), []
    for written in written_rounds():
        batch = [p for kind in sorted(written.items()) for p in kind[1]]
        rng.shuffle(batch)
        out += batch
    return out
