"""The guards: what must agree before a semantic hit, whatever the similarity score says."""
import pytest

from edge_runtime.cache.guards import Signature, language, normalize


def differ(a: str, b: str) -> list[str]:
    return Signature.of(a).differences(Signature.of(b))


@pytest.mark.parametrize("a,b,part", [
    ("Why is coffee good for you?", "Why is coffee not good for you?", "negations"),
    ("Why don't cats like water?", "Why do cats like water?", "negations"),
    ("Explain the advantages of remote work.", "Explain the disadvantages of remote work.", "reversal"),
    ("Critique this line harshly.", "Critique this line gently.", "reversal"),
    ("Convert 5 miles to km", "Convert 15 miles to km", "numbers"),
    ("List three rivers in Europe", "List four rivers in Europe", "numbers"),
    ("What is the capital of Austria?", "What is the capital of Australia?", "entities"),
    ('Write a haiku about "autumn rain"', 'Write a haiku about "spring rain"', "quoted"),
    ("Describe the sea in 3 words", "Describe the sea in 3 sentences", "constraints"),
    ("Give me the answer in JSON", "Give me the answer in YAML", "constraints"),
    ("How does a refrigerator work?", "Wie funktioniert ein Kühlschrank?", "language"),
    ("How do I reverse a list in Python?", "Come faccio a invertire una lista in Python?", "language"),
    ("Write a function to reverse a list, with unit tests.", "Write a function to reverse a list, with type hints.",
     "content"),
    ("Write a love song in the style of country music.", "Write a love song in the style of heavy metal.", "content"),
    ("How do I convert Celsius to Fahrenheit?", "How do I convert Fahrenheit to Celsius?", "order"),
    ("Is a dog bigger than a cat?", "Is a cat bigger than a dog?", "order"),
])
def test_each_kind_of_near_miss_is_caught(a, b, part):
    assert part in differ(a, b)
    assert part in differ(b, a)  # symmetric
    assert not Signature.of(a).agrees(Signature.of(b))


@pytest.mark.parametrize("a,b", [
    ("How do I boil an egg?", "What is the way to boil an egg?"),
    ("Please explain recursion in Python.", "Explain recursion in python"),
    ("Hi, could you tell me how tides work? Thanks!", "How do tides work?"),
    ("In simple terms, explain photosynthesis briefly.", "Explain photosynthesis briefly, in simple terms."),
    ("what is the capital of france", "What is the capital of France?"),
    ("Recomend a good beginer exercise routine.", "Recommend a good beginner exercise routine."),
    ("How do I convert Celsius to Fahrenheit?", "Sorry to bother you, but how do I convert Celsius to Fahrenheit?"),
])
def test_same_requests_pass(a, b):
    assert differ(a, b) == []


def test_normalize_folds_case_space_and_end_punctuation():
    assert normalize("  How are   You?? ") == normalize("how are you") == "how are you"
    assert normalize("Ｈｏｗ") == "how"  # NFKC
    assert normalize("Is 3 > 2?") != normalize("Is 3 < 2?")


def test_language_of_scripts_and_stop_words():
    assert language("Как дела?") == "cyrillic"
    assert language("What time is it?") == "en"
    assert language("Quelle heure est-il, s'il vous plaît?") != "en"
    assert language("Differentiate x^3.") == "und"


def test_signature_round_trips_through_json():
    s = Signature.of('Is "Paris" in France? Give 2 reasons, not 3.')
    assert Signature.from_json(s.to_json()) == s
