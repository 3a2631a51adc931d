"""What a similarity score misses: the parts of a request that must agree before a cached answer may serve it.

`normalize(text)` is the exact tier's form of a message (Unicode NFKC, case folded, whitespace collapsed,
trailing punctuation dropped): "How are you?" and "how  are you" share it.

`Signature.of(text)` pulls out what changes the right answer while leaving an embedding almost unmoved:
- numbers (digits, and number words up to twelve, plus ordinals), as written values;
- negations (not, no, never, without, none, n't, ... in six languages), counted; and reversals between the
  two sides: a common antonym ("high" / "low", "harshly" / "gently") or a negative prefix ("advantages" /
  "disadvantages") on a word only one side has;
- quoted strings, verbatim;
- named entities: capitalized words that are not common words (greetings, question words, imperatives, stop
  words), case folded: each side's must occur (in any case) among the other side's words;
- the language (script, then a stop-word vote over English, French, German, Spanish, Italian, Portuguese, Dutch);
- explicit constraints: format and length words (words, sentences, haiku, JSON, bullet, brief, detailed, ...),
  each found (or a spelling of it) among the other side's words;
- content: every content word (not a function, politeness or filler word) of each side has a counterpart
  among the other side's words, the same word or a spelling or inflection of it (same first five letters,
  or two edits).
- order: the words on either side of "to", "than", "from", "vs", ... must be the same ("Celsius to
  Fahrenheit" / "Fahrenheit to Celsius", "a dog bigger than a cat" / "a cat bigger than a dog").
Two requests agree when every part does. What this still lets through: roles swapped without such a word
("who did Alice call" / "who called Alice"), which no bag-of-words view can tell apart. It knows nothing of embeddings, storage or models.
"""
from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

_SPACE = re.compile(r"\s+")
_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*", re.UNICODE)
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:[.,:/]\d+)*(?:st|nd|rd|th|%)?", re.UNICODE)
_QUOTED = re.compile(r"\"([^\"]+)\"|“([^”]+)”|«([^»]+)»|'([^']{2,})'(?!\w)|`([^`]+)`")
_SENTENCE_END = re.compile(r"[.!?:;]\s+|\n")

NUMBER_WORDS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve".split())}
NUMBER_WORDS.update({"first": 1, "second": 2, "third": 3, "fourth": 4, "fifth": 5, "sixth": 6, "seventh": 7,
                     "eighth": 8, "ninth": 9, "tenth": 10, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50,
                     "hundred": 100, "thousand": 1000, "million": 10**6, "billion": 10**9, "half": 0.5,
                     "dozen": 12, "once": 1, "twice": 2, "thrice": 3, "single": 1, "double": 2, "triple": 3})
NEGATIONS = frozenset("""not no never none nothing nobody nowhere neither nor without cannot cant dont doesnt didnt
isnt arent wasnt werent wont wouldnt shouldnt couldnt mustnt hasnt havent hadnt non avoid except unless
ne pas jamais sans aucun aucune rien nicht kein keine keinen keiner nie niemals ohne nunca sin ningún ninguna
nada non mai senza nessuno niente não nem nunca sem geen niet nooit zonder""".split())
CONSTRAINTS = frozenset("""word words sentence sentences line lines paragraph paragraphs page pages character
characters letter letters syllable syllables bullet bullets numbered table json yaml xml csv markdown html
code haiku limerick sonnet poem rhyme essay tweet email outline short shorter brief briefly longer detailed
concise simple simply simpler formal informal casual funny serious kid kids child children beginner beginners
expert experts eli5 minute minutes hour hours fewer maximum minimum max min exactly approximately""".split())
# pairs whose members reverse a request's meaning ("advantages" / "disadvantages" is the prefix rule below)
ANTONYMS = [tuple(p.split("/")) for p in """high/low higher/lower highest/lowest more/less most/least good/bad
better/worse best/worst hot/cold warm/cool big/small bigger/smaller biggest/smallest large/small long/short
fast/slow faster/slower early/late before/after above/below over/under increase/decrease increasing/decreasing
rise/fall up/down start/end starting/ending begin/end beginning/end first/last pros/cons gain/lose gaining/losing
add/remove adding/removing buy/sell buying/selling cheap/expensive cheapest/most easy/hard easy/difficult
easiest/hardest strong/weak harshly/gently harsh/gentle positive/negative true/false right/wrong safe/dangerous
legal/illegal healthy/unhealthy metric/imperial male/female men/women boys/girls north/south east/west
left/right inside/outside input/output import/export send/receive open/close push/pull always/never include/exclude
allowed/forbidden love/hate like/dislike agree/disagree accept/reject win/lose minimum/maximum min/max
ascending/descending rich/poor young/old new/old wet/dry light/dark light/heavy sweet/sour""".split()]
OPPOSITE: dict[str, set] = {}
for _x, _y in ANTONYMS:
    OPPOSITE.setdefault(_x, set()).add(_y)
    OPPOSITE.setdefault(_y, set()).add(_x)
NEGATIVE_PREFIXES = ("un", "in", "im", "ir", "il", "dis", "non", "non-", "anti", "mis")
# words that carry no content of their own: function words, politeness, filler (with NOT_NAMES, below)
FUNCTION_WORDS = frozenset("""a an the of to in on at for with by from as is are was were be been being it its this
that these those there here what whats how why when where which who whom whose do does did can could would should will
shall may might must i me my mine we us our you your he him she her they them their his please kindly thanks thank
thx cheers hi hello hey dear good morning afternoon evening sorry bother excuse help tell give show let know want
need like just also some any way ways much many very really quite if or and but so than then into about up out
appreciated appreciate grateful trouble wondering wonder question quick silly mind hope well sure ok okay great
anyone somebody someone possible able""".split())
STOPWORDS = {
    "en": set("the and is are what how why of to in a an for with you can does do it this that my me please".split()),
    "fr": set("le la les est et des une un pour avec vous que qui comment pourquoi je mon ma du au dans est-ce".split()),
    "de": set("der die das ist und ein eine für mit sie wie warum ich mein ist nicht zu auf den dem kann".split()),
    "es": set("el la los las es y una un para con usted que cómo por qué mi en del se puedo".split()),
    "it": set("il lo la gli le è e una un per con che perché mio mia del della delle di non sono faccio fare posso "
              "cosa quale quali questo questa molto nel nella anche".split()),
    "pt": set("o a os as é e uma um para com você que como por quê meu minha do da em não".split()),
    "nl": set("de het een is en voor met je jij hoe waarom mijn niet van op te dat wat".split()),
}
# capitalized words that are not names: greetings, question words, imperatives and stop words
NOT_NAMES = frozenset("""i i'm i've i'll i'd ok okay please kindly hi hello hey thanks thank dear yes so now then
also and but or if what how why when where which who whom whose is are was were am be can could would should will do
does did may might shall have has had there here this that these those my your our give me tell explain describe
write list show make create suggest recommend help calculate find name define convert translate summarize summarise
compare provide share generate compose draft outline teach let in on at for from to as by with about using into
after before during between quick quickly just simply briefly""".split()) | frozenset().union(*STOPWORDS.values())


def normalize(text: str) -> str:
    """The exact tier's form of a message."""
    t = _SPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()
    return t.rstrip(" .!?。！？")


def _numbers(text: str, words: list[str]) -> tuple:
    found = [m.group(0).lstrip("+").replace(",", ".") for m in _NUMBER.finditer(text)]
    found += [str(NUMBER_WORDS[w]) for w in words if w in NUMBER_WORDS]
    return tuple(sorted(found))


def _entities(text: str) -> tuple:
    """Capitalized words (case folded) that are not common words and do not start a sentence (there a
    capital says nothing), and all-capital words (acronyms) anywhere."""
    out = set()
    for sentence in _SENTENCE_END.split(text):
        for i, w in enumerate(_WORD.findall(sentence)):
            if (i > 0 and w[:1].isupper()) or (len(w) > 1 and w.isupper()):
                out.add(w.casefold().replace("’", "'"))
    return tuple(sorted(out - NOT_NAMES))


def _close(w: str, words: set) -> bool:
    """w, or a spelling or inflection of it (same first 5 letters, or at most 2 edits for words of 5+ letters)."""
    if w in words:
        return True
    if len(w) < 5:
        return False
    return any(len(x) >= 5 and (w[:5] == x[:5] or (abs(len(w) - len(x)) <= 2 and _edits(w, x) <= 2)) for x in words)


def _edits(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


RELATIONS = frozenset("than to into from vs versus before after over under".split())
ARTICLES = frozenset("a an the my your our their his her its this that".split())


def _relations(text: str) -> tuple:
    """(left, word, right) around each relation word ("celsius to fahrenheit", "bigger than cat"), articles
    skipped, when both sides are content words: what tells "X to Y" from "Y to X"."""
    out = set()
    for sentence in _SENTENCE_END.split(text):
        ws = [w for w in (x.casefold() for x in _WORD.findall(sentence)) if w not in ARTICLES]
        for i in range(1, len(ws) - 1):
            if ws[i] in RELATIONS and _content([ws[i - 1], ws[i + 1]]) == {ws[i - 1], ws[i + 1]}:
                out.add(f"{ws[i - 1]} {ws[i]} {ws[i + 1]}")
    return tuple(sorted(out))


def _each_close(words, others) -> bool:
    others = set(others)
    return all(_close(w, others) for w in words)


def _content(words) -> set:
    return {w for w in words if len(w) >= 3 and w not in FUNCTION_WORDS and w not in NOT_NAMES}


def _reversed(a: set, b: set) -> bool:
    """True when b holds the opposite of a word only a holds: an antonym, or the word with a negative prefix."""
    only_a, only_b = a - b, b - a
    if not only_a or not only_b:
        return False
    if any(OPPOSITE.get(w, set()) & only_b for w in only_a):
        return True
    return any(w.startswith(p) and w[len(p):] in other for side, other in ((only_a, only_b), (only_b, only_a))
               for w in side for p in NEGATIVE_PREFIXES)


def language(text: str) -> str:
    """A script name for non-Latin text; else the language whose stop words occur most, where English needs
    more than the others and no accented letter (ties: the first name); "und" when no stop word occurs."""
    for ch in text:
        if ch.isalpha() and ord(ch) > 0x24F:
            name = unicodedata.name(ch, "")
            return name.split(" ")[0].lower() if name else "other"
    words = [w.casefold() for w in _WORD.findall(text)]
    scores = {lang: sum(w in sw for w in words) for lang, sw in STOPWORDS.items()}
    best = max(scores.values(), default=0)
    accented = any(ch.isalpha() and ord(ch) > 0x7F for ch in text)
    if best == 0:
        return "latin-accented" if accented else "und"
    others = max(v for lang, v in scores.items() if lang != "en")
    if scores["en"] > others and not accented:
        return "en"
    if others == 0:  # English stop words and an accented letter: a loanword ("café") or another Latin language
        return "latin-accented"
    return min(lang for lang, v in scores.items() if lang != "en" and v == others)


@dataclass(frozen=True, slots=True)
class Signature:
    numbers: tuple = ()
    negations: int = 0
    quoted: tuple = ()
    entities: tuple = ()
    language: str = "en"
    constraints: tuple = ()
    words: tuple = ()  # every word, case folded: where the other side's entities are looked up
    relations: tuple = ()

    @classmethod
    def of(cls, text: str) -> "Signature":
        text = unicodedata.normalize("NFKC", text)
        words = [w.casefold().replace("’", "'") for w in _WORD.findall(text)]
        flat = [w.replace("'", "") for w in words]
        negations = sum(w in NEGATIONS for w in flat) + sum(w.endswith("n't") for w in words)
        quoted = tuple(sorted(next(g for g in m.groups() if g) for m in _QUOTED.finditer(text)))
        constraints = tuple(sorted({w for w in flat if w in CONSTRAINTS}))
        return cls(_numbers(text, flat), negations, quoted, _entities(text), language(text), constraints,
                   tuple(sorted(set(words))), _relations(text))

    def differences(self, other: "Signature", first: bool = False) -> list[str]:
        """The names of the parts that disagree (empty: the guards pass); `first`: stop at the first one."""
        out = []
        checks = [("numbers", lambda: self.numbers != other.numbers),
                  ("negations", lambda: self.negations != other.negations),
                  ("quoted", lambda: self.quoted != other.quoted), ("language", lambda: self.language != other.language),
                  ("order", lambda: set(self.relations) != set(other.relations)),
                  ("constraints", lambda: not _each_close(self.constraints, other.words)
                   or not _each_close(other.constraints, self.words)),
                  ("entities", lambda: not set(self.entities) <= set(other.words)
                   or not set(other.entities) <= set(self.words)),
                  ("content", lambda: not _each_close(_content(self.words), other.words)
                   or not _each_close(_content(other.words), self.words)),
                  ("reversal", lambda: _reversed(set(self.words), set(other.words)))]
        for name, differ in checks:
            if differ():
                out.append(name)
                if first:
                    break
        return out

    def agrees(self, other: "Signature") -> bool:
        return not self.differences(other, first=True)

    def to_json(self) -> dict:
        return {name: list(v) if isinstance(v := getattr(self, name), tuple) else v for name in self.__slots__}

    @classmethod
    def from_json(cls, d: dict) -> "Signature":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
