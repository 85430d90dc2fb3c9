"""The verification stage after similarity: serve a cached answer only for the same question.

Embedding similarity rates "transfer from savings to current" and "from current to savings"
0.996 alike, and "is the gym open on holidays" / "closed on holidays" nearly so: no cosine
threshold tells a paraphrase from a trap, and word lists of traps tuned on our own pairs did
not generalise (issue 22: 7-14 % of traps served on sources nobody had tuned them on). This
verifier is conservative by construction: it serves a candidate only when both prompts say
the same words in the same order once what never changes an answer is normalised away, so
an unforeseen trap (an antonym, a negation, an exchanged role, an added qualifier, another
entity or number) is a miss because it changes a word or the order, not because a list
foresaw it. What it normalises is English, not our pairs:

- casing, punctuation, typographic quotes, contractions ("what's", "can't" → "can not");
- British and American spelling (``breame``'s published list: colour/color, organise/organize,
  centre/center, travelled/traveled, cheque … stay apart where the list keeps them apart);
- number words and digits ("five" / 5, "twenty-one" / 21, "first" / "1st"), currency words
  and symbols ("$5" / "5 dollars"), unit words and symbols ("5 kilometres" / "5 km");
- inflection (plural and -ing/-ed endings, stemmed alike on both sides);
- politeness and greetings ("please", "hi", "thanks in advance");
- the frame around the question ("can you tell me …", "I'd like to know …", "explain …",
  "how do I" / "how can I" / "how to"), articles and the present-tense auxiliaries;
- one misspelt word per prompt: a word the dictionary (``pyspellchecker``'s English word
  frequencies) does not know, one edit away from a word it knows on the other side
  (massage/message are both words: not a typo);
- a clause moved across a comma ("At sea level, what is …" / "What is … at sea level?").

What is left is the wording tier a candidate matched at (``Verdict.wording``): ``same``,
``typo`` or ``reordered``. Anything else (a paraphrase with other words included) is a miss:
the cache is unsure, so it does not serve. It also needs the embedding similarity to reach
``settings.SEMANTIC_CACHE_MIN_SIMILARITY`` (a guard against the normaliser's own blind
spots). Pure Python, no I/O: typically 30-150 µs a call.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass, replace
from functools import cache, lru_cache

from breame.spelling import get_american_spelling
from django.conf import settings

from serving.semcache import lexicon

logger = logging.getLogger("serving.semcache.verify")

SAME = "same"
TYPO = "typo"
REORDERED = "reordered"
TIERS = (SAME, TYPO, REORDERED)


@dataclass(frozen=True)
class Thresholds:
    """The similarity every candidate needs before its words are compared."""

    minimum: float

    @classmethod
    def from_settings(cls) -> Thresholds:
        return cls(minimum=settings.SEMANTIC_CACHE_MIN_SIMILARITY)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str  # why it was rejected (for debug logs and metrics), or "" when accepted
    category: str = ""  # low_similarity | different | order
    wording: str = ""  # accepted: same | typo | reordered (TIERS)
    required_similarity: float = 0.0


# -- normalising ------------------------------------------------------------------------------

_QUOTES = str.maketrans(
    {"\u2019": "'", "\u2018": "'", "`": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-", "\u2014": "-", "\u00a0": " "}
)
_CONTRACTIONS = (
    (re.compile(r"\b(can)'?t\b"), r"\1 not"),
    (re.compile(r"\bcannot\b"), "can not"),
    (re.compile(r"\bwon'?t\b"), "will not"),
    (re.compile(r"\bshan'?t\b"), "shall not"),
    (re.compile(r"\bain'?t\b"), "is not"),
    (re.compile(r"n't\b"), " not"),
    (re.compile(r"\b(i|you|we|they|he|she)'d\b"), r"\1 would"),
    (re.compile(r"\b(i|you|we|they)'ll\b"), r"\1 will"),
    (re.compile(r"\b(i|you|we|they)'ve\b"), r"\1 have"),
    (re.compile(r"\bi'm\b"), "i am"),
    (re.compile(r"'re\b"), " are"),
    (re.compile(r"\b(what|who|where|when|how|why|it|that|there|here|which)'s\b"), r"\1 is"),
    (re.compile(r"'s\b"), " 's"),  # a possessive stays a word of its own
)
# Said around a question without changing it: greetings, apologies, thanks, requests for help,
# each removed where it stands as a clause of its own (between punctuation or the text's ends).
_COURTESIES = (
    r"hi|hello|hey|hiya|greetings|good (?:morning|afternoon|evening|day)|dear \w+",
    r"(?:hi|hello|hey) (?:there|team|all|everyone|folks)",
    r"excuse me|pardon me|sorry(?: to (?:bother|trouble|disturb) you)?(?:,? but)?"
    r"|apologies(?: for (?:the|this) question)?",
    r"if you (?:do not|don't) mind|if (?:it is )?possible|if you can|if you could"
    r"|when you (?:get|have) a (?:chance|moment|minute)",
    r"(?:can|could|would) (?:you|someone|anyone) (?:please )?help(?: me)?(?: out)?|(?:please )?help(?: me)?(?: out)?"
    r"|would you be so kind as to help(?: me)?|i (?:need|could use|would like) (?:some |your )?help(?: with this)?",
    r"i(?: would|'d)? (?:really |truly )?appreciate (?:your|any|some|the) (?:help|advice|input)"
    r"|i would be (?:very |really )?grateful(?: for (?:any|your) help)?"
    r"|any help (?:is|would be) (?:much |greatly )?appreciated",
    r"(?:many |great )?thanks(?: (?:so|very) much)?(?: a lot)?(?: in advance)?(?: for (?:your|the|any) (?:help|time))?"
    r"|thank you(?: (?:so|very) much)?(?: in advance)?(?: for (?:your|the|any) (?:help|time))?|thx|cheers"
    r"|(?:much|greatly) appreciated|appreciate it",
    r"just curious|(?:quick |a quick |one )?question|i have a (?:quick )?question(?: for you)?",
)
_COURTESY = re.compile(r"(?:^|(?<=[,.!?:;]))\s*(?:" + "|".join(_COURTESIES) + r")\s*(?:[,.!?:;]+|$)")
_GREETING = re.compile(
    r"^(?:hi|hello|hey|hiya|greetings|good (?:morning|afternoon|evening|day))(?: there| team| all| everyone| folks)?\b"
    r"|\b(?:sorry to (?:bother|trouble|disturb) you|if you (?:do not|don't) mind),? but\b"
)
_PERCENT = re.compile(r"\s?\b(?:per ?cent|pct)\b")
_PLEASE = re.compile(r"\b(?:please|kindly|pls|plz)\b,?")
# The frame a question is asked in: "can you tell me …", "I'd like to know …", "explain …",
# "list …", at the start of a sentence.
_FRAME = re.compile(
    r"(?:^|(?<=[.!?:;,] ))(?:(?:can|could|would|will) (?:you|someone|anyone) (?:tell|show|explain to|let) me"
    r"|(?:can|could|would|will) (?:you|someone|anyone) (?:explain|describe|clarify|list|name)"
    r"|(?:can|could|would|will) (?:you|someone|anyone) help me (?:understand|find out|figure out|work out)"
    r"|(?:tell|show|give) me|(?:explain|describe|clarify)(?: to me)?|let me know|list|name|work out|calculate"
    r"|i (?:want|would like|wish|need|am trying|am hoping|hope) to (?:know|understand|find out|learn|ask)"
    r"|i (?:am|was) (?:wondering|curious)(?: about)?|i wonder|i have been wondering(?: about)?"
    r"|(?:do|does) (?:you|anyone|someone|somebody) know|(?:do you have )?any idea)\b[\s,:-]*"
)
_HOW_TO = re.compile(
    r"\bhow (?:do|does|can|could|should|would|will|might|must|shall) (?:i|we|you|one|someone|a person|people)\b"
    r"|\bhow (?:is it possible|am i able|are we able) to\b|\bhow to\b"
    r"|\bwhat (?:is|are) the (?:way|steps|process|procedure) (?:to|for)\b|\bwhat steps (?:do|should) i take to\b"
)
_TOKEN = re.compile(
    r"(?P<num>\d+(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?P<suffix>%|[a-z°]+\b)?"
    r"|(?P<word>[^\W\d_][^\W_]*(?:'s)?[+#]*|'s|°[cf]\b)"
    r"|(?P<sym>[£$€¥₹%°=+&/])"
    r"|(?P<comma>[,;:]|\s-\s)"
    r"|(?P<end>[.?!]+(?=\s|$))"
)
# Carry no meaning of their own here: articles, the present-tense auxiliaries, and intensifiers.
_DROP = lexicon.words("a an the is are am be do does actually exactly basically really")
_PERSON = {
    "i": "i", "me": "i", "my": "i", "mine": "i", "myself": "i",
    "we": "we", "us": "we", "our": "we", "ours": "we", "ourselves": "we",
    "you": "you", "your": "you", "yours": "you", "yourself": "you", "u": "you", "ur": "you",
}  # fmt: skip
_ORDINALS = {"first": 1, "second": 2, "third": 3, "fifth": 5, "eighth": 8, "ninth": 9, "twelfth": 12} | {
    (word[:-1] + "ieth" if word.endswith("y") else word + "th"): number
    for word, number in lexicon.NUMBER_WORDS.items()
    if number >= 4 and number not in (5, 8, 9, 12) and word != "dozen"
}
_VOWEL = re.compile(r"[aeiouy]")
COMMA = ","
END = "."


@dataclass(frozen=True)
class Word:
    key: str  # what is compared
    surface: str  # lowercased, as written (spelling normalised): for the typo check


def stem(word: str) -> str:
    """Plural and -ing/-ed endings off; a word without a vowel is an abbreviation, not
    inflected (HTTPS is not the plural of HTTP)."""
    if len(word) <= 3 or not word.isalpha() or not _VOWEL.search(word):
        return word
    if word.endswith("ies") and len(word) > 4:
        word = word[:-3] + "y"
    elif word.endswith(("sses", "ches", "shes", "xes", "zes")):
        word = word[:-2]
    elif word.endswith("s") and not word.endswith(("ss", "us", "is")):
        word = word[:-1]
    if word.endswith("ing") and len(word) > 5:
        word = _undouble(word[:-3])
    elif word.endswith("ied") and len(word) > 4:
        word = word[:-3] + "y"
    elif word.endswith("ed") and len(word) > 4:
        word = _undouble(word[:-2])
    if word.endswith("e") and len(word) > 3:
        word = word[:-1]
    return word


def _undouble(stem: str) -> str:
    if len(stem) > 2 and stem[-1] == stem[-2] and stem[-1] not in "aeioulsz":
        return stem[:-1]
    return stem


@lru_cache(maxsize=65536)
def _american(word: str) -> str:
    return get_american_spelling(word) if word.isalpha() and len(word) > 3 else word


def _fmt(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:g}"


def _clean(text: str) -> str:
    text = text.translate(_QUOTES).lower().strip()
    for pattern, replacement in _CONTRACTIONS:
        text = pattern.sub(replacement, text)
    text = _GREETING.sub(" . ", _PERCENT.sub("%", _PLEASE.sub("", text)))
    for _ in range(3):  # "Hi! Sorry to bother you, but could you tell me …"
        text = " ".join(_COURTESY.sub(" . ", text).split()).strip(" ,.!?:;-")
    text = _FRAME.sub("", text)
    return _HOW_TO.sub(" howto ", text)


def _words(text: str) -> list[Word]:
    """The words compared, in order; a comma (or colon, dash) kept as a clause boundary, a
    sentence's end as another."""
    out: list[Word] = []
    pending_number: list[str] = []  # "twenty one", "three hundred"

    def flush(ordinal: str = "") -> None:
        if pending_number:
            total, current = 0.0, float(_ORDINALS.get(ordinal, 0))
            for part in pending_number:
                if part in lexicon.MULTIPLIERS:
                    current = max(current, 1.0) * lexicon.MULTIPLIERS[part]
                    if lexicon.MULTIPLIERS[part] >= 1000:
                        total, current = total + current, 0.0
                else:
                    current += lexicon.NUMBER_WORDS[part]
            value = ("#" if ordinal else "") + _fmt(total + current)
            out.append(Word(value, value))
            pending_number.clear()
        elif ordinal:
            out.append(Word(f"#{_ORDINALS[ordinal]}", ordinal))

    for match in _TOKEN.finditer(text):
        if match["comma"] or match["end"]:
            flush()
            mark = COMMA if match["comma"] else END
            if out and out[-1].key not in (COMMA, END):
                out.append(Word(mark, mark))
            elif out and mark == END:
                out[-1] = Word(END, END)
            continue
        if match["num"]:
            flush()
            value = _fmt(float(match["num"].replace(",", "")))
            suffix = match["suffix"] or ""
            if suffix in lexicon.ORDINAL_SUFFIXES:
                out.append(Word(f"#{value}", f"#{value}"))
            elif suffix in lexicon.MULTIPLIERS:
                value = _fmt(float(value) * lexicon.MULTIPLIERS[suffix])
                out.append(Word(value, value))
            else:
                out.append(Word(value, value))
                if suffix == "%":
                    out.append(Word("%", "%"))
                elif suffix:
                    unit = lexicon.UNITS.get(suffix) or lexicon.UNITS_AFTER_NUMBER.get(suffix)
                    out.append(Word(unit, unit) if unit else Word(suffix, suffix))
            continue
        if match["sym"]:
            flush()
            symbol = match["sym"]
            if symbol in lexicon.CURRENCY_SYMBOLS:
                out.append(Word(lexicon.CURRENCY_SYMBOLS[symbol], symbol))
            else:
                key = {"&": "and", "+": "plus", "=": "equals"}.get(symbol, symbol)
                out.append(Word(key, symbol))
            continue
        for part in match["word"].split("-"):
            word = part.strip("'")
            if not word:
                continue
            if word != "dozen" and (word in lexicon.NUMBER_WORDS or (word in lexicon.MULTIPLIERS and pending_number)):
                pending_number.append(word)
                continue
            if word in _ORDINALS:
                flush(ordinal=word)  # "twenty-first": 21st
                continue
            flush()
            if word in _DROP:
                continue
            elif word in _PERSON:
                out.append(Word(_PERSON[word], word))
            elif word in lexicon.CURRENCY_WORDS:
                out.append(Word(lexicon.CURRENCY_WORDS[word], word))
            elif word in lexicon.UNITS:
                out.append(Word(lexicon.UNITS[word], word))
            else:
                spelt = _american(word)
                out.append(Word(stem(spelt), spelt))
    flush()
    while out and out[-1].key in (COMMA, END):
        out.pop()
    _currency_first(out)
    return out


def _currency_first(words: list[Word]) -> None:
    """ "5 dollars" as "$5": a currency word right after a number moves in front of it."""
    currencies = set(lexicon.CURRENCY_SYMBOLS.values()) | set(lexicon.CURRENCY_WORDS.values())
    for i in range(1, len(words)):
        if words[i].key in currencies and words[i - 1].key.replace(".", "").isdigit():
            words[i - 1], words[i] = words[i], words[i - 1]


@lru_cache(maxsize=4096)
def analyse(text: str) -> tuple[Word, ...]:
    """One prompt's words as the verifier compares them (memoised: popular entries are
    candidates again and again)."""
    return tuple(_words(_clean(text)))


# -- comparing ----------------------------------------------------------------------------------


@cache
def _dictionary() -> object:
    from spellchecker import SpellChecker

    return SpellChecker(distance=1)


def known(word: str) -> bool:
    return word in _dictionary()  # type: ignore[operator]


def _osa_distance(a: str, b: str, limit: int) -> int:
    """Optimal string alignment distance (a transposition counts 1), stopping past ``limit``."""
    if abs(len(a) - len(b)) > limit:
        return limit + 1
    previous2: list[int] = []
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                current[j] = min(current[j], previous2[j - 2] + 1)
        if min(current) > limit:
            return limit + 1
        previous2, previous = previous, current
    return previous[-1]


def typo_eligible(word: Word) -> bool:
    """Could this word be misspelt (or a misspelling)? Letters only, four or more, a vowel
    among them (abbreviations such as HTTP/HTTPS never are)."""
    return word.surface.isalpha() and len(word.surface) >= 4 and _VOWEL.search(word.surface) is not None


def _typo(a: Word, b: Word) -> bool:
    """One of the two is a misspelling of the other: an unknown word one edit (two for long
    words) from a known one, the same first letter. Two real words are never a typo."""
    x, y = a.surface, b.surface
    if not (typo_eligible(a) and typo_eligible(b)) or x[0] != y[0]:
        return False
    if known(x) == known(y):
        return False
    limit = 2 if min(len(x), len(y)) >= 8 else 1
    return _osa_distance(x, y, limit) <= limit


def _joined(words: tuple[Word, ...], other: tuple[Word, ...]) -> tuple[Word, ...]:
    """ "e mail" as "email", "log in" as "login", where the other prompt writes one word."""
    singles = {w.surface for w in other}
    out: list[Word] = []
    i = 0
    while i < len(words):
        if i + 1 < len(words):
            together = words[i].surface + words[i + 1].surface
            if together in singles and together not in {w.surface for w in words}:
                out.append(Word(stem(together), together))
                i += 2
                continue
        out.append(words[i])
        i += 1
    return tuple(out)


def _rotations(words: tuple[Word, ...]) -> list[tuple[Word, ...]]:
    """The prompt with a clause moved across a comma inside its sentence: "at sea level, what is
    X" → "what is X at sea level" (each comma splits its sentence into a front and a back that
    swap)."""
    out = []
    for i, word in enumerate(words):
        if word.key == COMMA:
            start = max((j + 1 for j in range(i) if words[j].key == END), default=0)
            end = next((j for j in range(i + 1, len(words)) if words[j].key == END), len(words))
            out.append(words[:start] + words[i + 1 : end] + words[start:i] + words[end:])
    return out


_INVERTING = lexicon.words("can could should would will shall may might must did was were has have had")


def _compared(words: tuple[Word, ...]) -> tuple[str, ...]:
    """The keys compared, sentence by sentence: "tell me the capital of X" asks what "what is
    the capital of X" asks (a sentence's leading "what" goes), and "tell me whether a seller
    can leave feedback" what "can a seller leave feedback" asks (the question's inverted
    auxiliary goes, and with it "whether"/"if" and the auxiliary it moved to)."""
    out: list[str] = []
    sentence: list[str] = []
    for word in (*words, Word(END, END)):
        if word.key != END:
            if word.key != COMMA:
                sentence.append(word.key)
            continue
        if sentence[:1] == ["what"]:
            sentence = sentence[1:]
        if sentence[:1] in (["whether"], ["if"]):
            auxiliary = next((k for k in sentence if k in _INVERTING), None)
            if auxiliary is not None:
                sentence = sentence[1:]
                sentence.remove(auxiliary)
                sentence.insert(0, f"?{auxiliary}")
        elif sentence[:1] and sentence[0] in _INVERTING:
            sentence[0] = f"?{sentence[0]}"
        out += sentence
        sentence = []
    return tuple(out)


def _reject(category: str, reason: str, similarity: float) -> Verdict:
    logger.debug("semantic cache candidate rejected (%s, similarity %.3f): %s", category, similarity, reason)
    return Verdict(ok=False, reason=reason, category=category)


def _describe(q: tuple[str, ...], c: tuple[str, ...]) -> str:
    extra_q, extra_c = Counter(q) - Counter(c), Counter(c) - Counter(q)
    if not extra_q and not extra_c:
        return "the same words in another order"
    return f"asks {' '.join(sorted(extra_q)) or '-'} where the cached prompt has {' '.join(sorted(extra_c)) or '-'}"


def verify(*, query: str, cached: str, similarity: float, thresholds: Thresholds | None = None) -> Verdict:
    """May ``cached``'s answer be served for ``query`` (the two last user turns, and the
    cosine similarity of their embeddings)? Pure and fast (well under a millisecond)."""
    minimum = (Thresholds.from_settings() if thresholds is None else thresholds).minimum
    if similarity < minimum:
        return _reject("low_similarity", f"similarity {similarity:.3f} below the minimum {minimum:.3f}", similarity)
    verdict = verify_words(query=query, cached=cached, similarity=similarity)
    return replace(verdict, required_similarity=minimum) if verdict.ok else verdict


def verify_words(*, query: str, cached: str, similarity: float = 1.0) -> Verdict:
    """``verify`` without the similarity guard: do the two prompts say the same words (at
    which tier)? The lookup asks this first, and embeds the query only for a candidate whose
    words pass (``similarity`` is only for the log line)."""
    q_read, c_read = analyse(query), analyse(cached)
    q_words, c_words = _joined(q_read, c_read), _joined(c_read, q_read)
    rejoined = len(q_words) != len(q_read) or len(c_words) != len(c_read)
    wording = SAME
    if len(q_words) == len(c_words) and not rejoined:
        # One misspelt word: read it as the word it misspells (not on top of two words read as
        # one: no signature finds that pair, so the lookup could not serve it anyway).
        differing = [i for i, (a, b) in enumerate(zip(q_words, c_words, strict=True)) if a.key != b.key]
        if len(differing) == 1 and _typo(q_words[differing[0]], c_words[differing[0]]):
            q_words = tuple(c_words[i] if i == differing[0] else w for i, w in enumerate(q_words))
            wording = TYPO
    q, c = _compared(q_words), _compared(c_words)
    if q == c:
        return Verdict(ok=True, reason="", wording=wording)
    if any(_compared(moved) == c for moved in _rotations(q_words)) or any(
        _compared(moved) == q for moved in _rotations(c_words)
    ):
        return Verdict(ok=True, reason="", wording=REORDERED if wording == SAME else wording)
    category = "order" if Counter(q) == Counter(c) else "different"
    return _reject(category, _describe(q, c), similarity)
