"""The verification stage after similarity: reject near-misses that would change the answer.

Embedding similarity rates "transfer from savings to current" and "from current to savings"
0.996 alike, so a cosine threshold cannot tell a paraphrase from a trap. ``verify`` reads
both prompts (the new request's last user turn and the cached entry's) and rejects, with a
category and a reason, when they differ in something that changes the answer:

- ``negation``: not / no / never / n't / without, or an antonym by prefix (safe/unsafe,
  legal/illegal, refundable/non-refundable, enable/disable);
- ``swap``: the same things in other roles (from X to Y / from Y to X, X to Y conversions,
  A vs B, A than B, subject and object exchanged);
- ``date``: days, months, years, times of day, relative days (today, next week), holidays;
- ``amount``: sums of money or their currencies;
- ``unit``: units of measure (km / miles, °C / °F, kg / lb, GB / MB, per hour / per day);
- ``number``: any other number (counts, versions, percentages, ordinals);
- ``scope``: opposite scope or comparison words (over/under, before/after, first/last,
  min/max, buy/sell, import/export, increase/decrease, in/out, on/off…), or a comparison
  in front of a number on one side only ("under £50" / "£50");
- ``different``: a content word replaced by another (a city, product, language, person,
  ingredient…), which no list can enumerate: a one-for-one replacement, or any replaced
  name, is rejected; other rewording needs more similarity the more it rewords.

What is left must reach a minimum similarity, ``settings.SEMANTIC_CACHE_MIN_SIMILARITY``
when the content words are the same (near-repeats: casing, punctuation, typos, filler such
as "please" or "could you tell me"), more when one side adds words or the wording differs.
The thresholds and rules are calibrated on bench/data/semantic_cache_pairs.jsonl
(bench/semantic_cache_eval.py; docs/performance.md has the figures). Pure Python, no I/O:
typically 50-250 µs a call.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise

from django.conf import settings

from serving.semcache import lexicon

logger = logging.getLogger("serving.semcache.verify")


@dataclass(frozen=True)
class Thresholds:
    """The similarity a candidate needs, by how much its wording differs from the query.

    Calibrated together on the calibration half of bench/data/semantic_cache_pairs.jsonl
    (bench/semantic_cache_eval.py --calibrate; docs/performance.md has the figures).
    """

    minimum: float  # the same content words: settings.SEMANTIC_CACHE_MIN_SIMILARITY
    added: float = 0.15  # above the minimum, when one prompt has content words the other lacks
    reworded: float = 0.04  # above the minimum, when both have content words the other lacks
    replaced: float = 0.88  # absolute, for one content word (or a compound) replaced by another

    @classmethod
    def from_settings(cls) -> Thresholds:
        return cls(minimum=settings.SEMANTIC_CACHE_MIN_SIMILARITY)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str  # why it was rejected (for debug logs and metrics), or "" when accepted
    category: str = ""  # negation | swap | date | amount | unit | number | scope | different | low_similarity
    # How the content words differ when no rule rejected the pair: same | added | reworded |
    # replaced (one word for another); the similarity it needed for that (Thresholds).
    wording: str = ""
    required_similarity: float = 0.0


# -- analysis ------------------------------------------------------------------------------

_CONTRACTIONS = (
    (re.compile(r"\b(can)'?t\b", re.I), r"\1 not"),
    (re.compile(r"\bcannot\b", re.I), "can not"),
    (re.compile(r"\bwon'?t\b", re.I), "will not"),
    (re.compile(r"\bshan'?t\b", re.I), "shall not"),
    (re.compile(r"\bain'?t\b", re.I), "is not"),
    (re.compile(r"\b(do|does|did|is|are|was|were|has|have|had|should|would|could|must|need)n'?t\b", re.I), r"\1 not"),
    (re.compile(r"n't\b", re.I), " not"),
    (re.compile(r"'(?:s|re|ve|ll|d|m)\b", re.I), ""),
)
# Typographic quotes and dashes as their ASCII forms.
_QUOTES = str.maketrans(
    {"\u2019": "'", "\u2018": "'", "`": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-", "\u2014": "-", "\u00a0": " "}
)
_TOKEN = re.compile(
    r"(?P<clock>\b\d{1,2}:\d{2})(?:\s?(?P<ampm>[ap])\.?m\b\.?)?"
    r"|(?P<num>\d+(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?P<suffix>°\s?[cfk]\b|%|[a-z]+\b)?"
    r"|(?P<word>[^\W\d_][^\W_]*[+#]*|°[cf]\b)"
    r"|(?P<sym>[£$€¥₹/%°^=+])",
    re.IGNORECASE,
)
_SENTENCE_END = re.compile(r"[.?!:;\"\n(]")


@dataclass
class _Atom:
    key: str  # the canonical form compared across prompts
    kind: str  # word | num | cur | unit | date | neg | one | sym
    surface: str  # lowercased, as written
    name: bool = False  # capitalised inside a sentence, or a known place, language or programming language
    acronym: bool = False  # written in capitals: not stemmed (HTTPS is not the plural of HTTP)
    content: bool = False


@dataclass(frozen=True)
class _Analysis:
    atoms: tuple[_Atom, ...]
    surface: frozenset[str]
    negations: tuple[str, ...]
    numbers: Counter[str]
    soft_ones: int
    amounts: Counter[str]
    currencies: frozenset[str]
    units: frozenset[str]
    dates: Counter[str]
    comparatives: Counter[str]
    limiters: frozenset[str]
    content: frozenset[str]
    names: frozenset[str]
    spellings: dict[str, frozenset[str]]  # content key → the words written for it
    modifiers: frozenset[tuple[str, str]]  # (content key, the content key right after it)


def _stem(word: str) -> str:
    if len(word) <= 3 or not word.isalpha():
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
    elif word.endswith("ly") and len(word) > 5:
        word = word[:-2]
    if word.endswith("e") and len(word) > 3:
        word = word[:-1]
    return word


def _undouble(stem: str) -> str:
    if len(stem) > 2 and stem[-1] == stem[-2] and stem[-1] not in "aeioulsz":
        return stem[:-1]
    return stem


_CANONICAL = {_stem(w): _stem(canonical) for canonical, group in lexicon.SYNONYMS.items() for w in group}


@lru_cache(maxsize=32768)
def _canonical(word: str) -> str:
    stem = _stem(word)
    return _CANONICAL.get(stem, stem)


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _fmt(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:g}"


def _tokens(text: str) -> list[_Atom]:
    """Lowercased atoms with numbers, units, currencies and times recognised; names marked."""
    text = text.translate(_QUOTES)
    for pattern, replacement in _CONTRACTIONS:
        text = pattern.sub(replacement, text)
    atoms: list[_Atom] = []
    previous_end = 0
    for match in _TOKEN.finditer(text):
        starts_sentence = not atoms or bool(_SENTENCE_END.search(text, previous_end, match.start()))
        previous_end = match.end()
        if match["clock"]:
            hours, minutes = (int(x) for x in match["clock"].split(":"))
            if match["ampm"] and match["ampm"].lower() == "p" and hours < 12:
                hours += 12
            atoms.append(_Atom(f"t:{hours:02d}:{minutes:02d}", "date", match[0].lower()))
        elif match["num"]:
            suffix = (match["suffix"] or "").lower().replace(" ", "")
            value = _number(match["num"])
            if suffix in ("am", "pm") and value <= 12:
                hours = int(value) % 12 + (12 if suffix == "pm" else 0)
                atoms.append(_Atom(f"t:{hours:02d}:00", "date", match[0].lower()))
                continue
            if suffix in lexicon.MULTIPLIERS:
                value *= lexicon.MULTIPLIERS[suffix]
                suffix = ""
            if (
                suffix
                and suffix not in lexicon.ORDINAL_SUFFIXES
                and suffix != "%"
                and suffix not in lexicon.UNITS
                and suffix not in lexicon.UNITS_AFTER_NUMBER
            ):
                atoms.append(_Atom(match[0].lower(), "word", match[0].lower(), content=True))  # "2fa", "5x"
                continue
            atoms.append(_Atom(_fmt(value) + ("%" if suffix == "%" else ""), "num", match["num"]))
            atoms[-1].surface = "ordinal" if suffix in lexicon.ORDINAL_SUFFIXES else match["num"].lower()
            if suffix and suffix not in lexicon.ORDINAL_SUFFIXES and suffix != "%":
                unit = lexicon.UNITS.get(suffix) or lexicon.UNITS_AFTER_NUMBER[suffix]
                atoms.append(_Atom(unit, "unit", suffix))
        elif match["sym"]:
            symbol = match["sym"]
            kind = "cur" if symbol in lexicon.CURRENCY_SYMBOLS else "sym"
            atoms.append(_Atom(lexicon.CURRENCY_SYMBOLS.get(symbol, symbol), kind, symbol))
        else:
            raw = match["word"]
            for i, part in enumerate(raw.split("-")):
                if not part:
                    continue
                word = part.lower()
                name = (
                    (part[0].isupper() and not (starts_sentence and i == 0) and word != "i")
                    or (len(part) > 1 and part.isupper() and word not in lexicon.STOPWORDS)
                    or word in lexicon.PLACES
                )
                acronym = len(part) > 1 and part.isupper()
                atoms.append(_Atom(word, "word", word, name=name, acronym=acronym))
    return atoms


def _classify(atoms: list[_Atom]) -> None:
    """Turn words into numbers, currencies, units, dates and negations, in place."""
    n = len(atoms)
    for i, atom in enumerate(atoms):
        if atom.kind != "word":
            continue
        word = atom.surface
        before = atoms[i - 1] if i else None
        after = atoms[i + 1] if i + 1 < n else None
        after2 = atoms[i + 2] if i + 2 < n else None
        if word in lexicon.NEGATIONS:
            atom.kind, atom.key = "neg", word
        elif word == "one":
            atom.kind = "one"
        elif word in lexicon.NUMBER_WORDS or word in lexicon.ORDINAL_WORDS:
            atom.kind, atom.key = "num", _fmt(lexicon.NUMBER_WORDS.get(word) or lexicon.ORDINAL_WORDS[word])
        elif word in lexicon.MULTIPLIERS and word not in ("k", "m") and before is not None and before.kind == "num":
            before.key = (
                _fmt(_number(before.key) * lexicon.MULTIPLIERS[word])
                if before.key.replace(".", "").isdigit()
                else before.key
            )
            atom.kind = "sym"
        elif word in lexicon.CURRENCY_WORDS and not (
            word.startswith("pound") and after is not None and after.surface == "of"
        ):
            atom.kind, atom.key = "cur", lexicon.CURRENCY_WORDS[word]
        elif word in lexicon.UNITS or (word.startswith("pound") and after is not None and after.surface == "of"):
            atom.kind, atom.key = "unit", lexicon.UNITS.get(word, "lb")
            if (
                word == "km"
                and after is not None
                and after.surface == "/"
                and after2 is not None
                and after2.surface == "h"
            ):
                atom.key = "km/h"
                after.kind = after2.kind = "sym"
        elif word in lexicon.UNITS_AFTER_NUMBER and before is not None and before.kind in ("num", "one"):
            atom.kind, atom.key = "unit", lexicon.UNITS_AFTER_NUMBER[word]
        elif word in lexicon.MONTHS and (
            word != "may"
            or atom.name
            or _near_number(atoms, i)
            or (before is not None and before.surface in ("in", "of", "since", "until", "by", "early", "late", "mid"))
        ):
            atom.kind, atom.key = "date", f"month:{lexicon.MONTHS[word]}"
        elif word in lexicon.WEEKDAYS or word.rstrip("s") in lexicon.WEEKDAYS:
            atom.kind, atom.key = "date", word.rstrip("s")
        elif word in lexicon.DAY_WORDS or word in lexicon.TIMES_OF_DAY or word in lexicon.HOLIDAYS:
            atom.kind, atom.key = (
                "date",
                {"noon": "t:12:00", "midday": "t:12:00", "midnight": "t:00:00"}.get(word, word.rstrip("s")),
            )
        elif word in lexicon.SEASONS or (
            word == "fall" and before is not None and before.surface in ("in", "this", "next", "last", "the")
        ):
            atom.kind, atom.key = "date", "autumn" if word == "fall" else word
        elif word in ("new", "boxing") and after is not None and after.surface in ("year", "day"):
            atom.kind, atom.key = "date", f"{word} {after.surface}"
            after.kind = "sym"
        elif (
            word in lexicon.RELATIVE
            and after is not None
            and (after.surface in lexicon.PERIODS or after.surface.rstrip("s") in lexicon.WEEKDAYS)
        ):
            atom.kind, atom.key = "date", f"{word} {after.surface.rstrip('s')}"
        elif len(word) == 2 and word[0] in "qh" and word[1] in "1234":  # Q3, H1
            atom.kind, atom.key = "date", word
        if atom.kind == "word" and word not in lexicon.STOPWORDS:
            atom.content = True
            atom.key = word if atom.acronym else _canonical(word)
    # Years, and days of the month beside a month name.
    for i, atom in enumerate(atoms):
        if atom.kind != "num":
            continue
        neighbours = [a for a in atoms[max(0, i - 2) : i + 3] if a is not atom]
        if any(a.kind == "cur" for a in neighbours[1:3]) or (i + 1 < n and atoms[i + 1].kind == "unit"):
            continue
        value = _number(atom.key.rstrip("%")) if atom.key.rstrip("%").replace(".", "").isdigit() else -1
        if "%" not in atom.key and 1900 <= value <= 2099 and value == int(value) and "," not in atom.surface:
            atom.kind, atom.key = "date", f"year:{int(value)}"
        elif (
            1 <= value <= 31
            and value == int(value)
            and (_near_month(atoms, i) or (atom.surface == "ordinal" and i + 2 < n and atoms[i + 1].surface == "of"))
        ):
            atom.kind, atom.key = "date", f"day:{int(value)}"


def _near_number(atoms: list[_Atom], i: int) -> bool:
    return any(a.kind == "num" for a in atoms[max(0, i - 1) : i + 2])


def _near_month(atoms: list[_Atom], i: int) -> bool:
    window = atoms[max(0, i - 3) : i + 4]
    return any((a.surface in lexicon.MONTHS and a.surface != "may") or a.key.startswith("month:") for a in window)


@lru_cache(maxsize=256)
def _analyse(text: str) -> _Analysis:
    """What the checks compare, for one prompt; memoised: a lookup verifies one query against
    several candidates, and popular entries are candidates again and again."""
    atoms = _tokens(text)
    _classify(atoms)
    numbers: Counter[str] = Counter()
    amounts: Counter[str] = Counter()
    comparatives: Counter[str] = Counter()
    for i, atom in enumerate(atoms):
        if atom.kind != "num":
            continue
        near = atoms[max(0, i - 1) : i + 3]
        currency = next((a.key for a in near if a.kind == "cur"), None)
        if currency is not None:
            amounts[f"{currency} {atom.key}"] += 1
        else:
            numbers[atom.key] += 1
        # "under £50", "over 18", "more than 3", "at least 2"
        for back in (1, 2, 3):
            if i - back < 0:
                break
            word = atoms[i - back].surface
            if word in lexicon.COMPARATIVES:
                comparatives[lexicon.COMPARATIVES[word]] += 1
                break
            if atoms[i - back].kind not in ("cur", "sym") and word not in ("than", "the", "at", "to", "a", "an"):
                break
    spellings: dict[str, set[str]] = {}
    for atom in atoms:
        if atom.content:
            spellings.setdefault(atom.key, set()).add(atom.surface)
    return _Analysis(
        atoms=tuple(atoms),
        surface=frozenset(a.surface for a in atoms if a.kind in ("word", "neg")),
        negations=tuple(a.surface for a in atoms if a.kind == "neg"),
        numbers=numbers,
        soft_ones=sum(a.kind == "one" for a in atoms),
        amounts=amounts,
        currencies=frozenset(a.key for a in atoms if a.kind == "cur"),
        units=frozenset(a.key for a in atoms if a.kind == "unit"),
        dates=Counter(a.key for a in atoms if a.kind == "date"),
        comparatives=comparatives,
        limiters=frozenset(a.surface for a in atoms if a.surface in lexicon.LIMITERS),
        content=frozenset(a.key for a in atoms if a.content),
        names=frozenset(a.key for a in atoms if a.content and a.name),
        spellings={key: frozenset(forms) for key, forms in spellings.items()},
        modifiers=frozenset((a.key, b.key) for a, b in pairwise(atoms) if a.content and b.content),
    )


# -- checks --------------------------------------------------------------------------------


def _negation(q: _Analysis, c: _Analysis) -> str:
    if len(q.negations) != len(c.negations):
        more, fewer = (q, c) if len(q.negations) > len(c.negations) else (c, q)
        extra = Counter(more.negations) - Counter(fewer.negations)
        return f"negated on one side only ({', '.join(sorted(extra)) or 'negation'})"
    for one, other in ((q, c), (c, q)):
        for word in one.surface - other.surface:
            for prefix, minimum in lexicon.NEGATING_PREFIXES:
                rest = word[len(prefix) :]
                if (
                    word.startswith(prefix)
                    and len(rest) >= minimum
                    and rest in other.surface
                    and rest not in one.surface
                ):
                    return f"{word!r} against {rest!r}"
            if word.endswith("less") and word[:-4] + "ful" in other.surface:
                return f"{word!r} against {word[:-4] + 'ful'!r}"
    return ""


def _is_thing(atom: _Atom) -> bool:
    return (
        atom.content
        or atom.kind in ("num", "cur", "unit", "date")
        or (atom.surface in lexicon.SCOPE_WORDS and atom.surface not in lexicon.STOPWORDS)
    )


def _roles(analysis: _Analysis) -> dict[str, set[str]]:
    """Each thing's role markers: a marker governs the run of things after it ("from Windows
    10 to Windows 11": from → windows, 10; to → windows, 11)."""
    roles: dict[str, set[str]] = {}
    markers: set[str] = set()
    after_thing = False
    for atom in analysis.atoms:
        if atom.surface in lexicon.MARKERS and not _is_thing(atom):
            markers = {lexicon.MARKERS[atom.surface]} if after_thing else markers | {lexicon.MARKERS[atom.surface]}
            after_thing = False
        elif _is_thing(atom):
            if markers:
                roles.setdefault(atom.key, set()).update(markers)
            after_thing = True
        elif atom.surface not in lexicon.DETERMINERS and atom.kind != "sym":
            markers, after_thing = set(), False
    return roles


def _sequence(analysis: _Analysis) -> list[tuple[str, str]]:
    """(key, what stands before it, determiners skipped) for each thing and personal pronoun."""
    out = []
    previous = "^"
    for atom in analysis.atoms:
        if atom.surface in lexicon.DETERMINERS or atom.kind == "sym":
            continue
        key = lexicon.PRONOUNS.get(atom.surface) or (atom.key if _is_thing(atom) else None)
        if key is not None:
            out.append((key, previous))
        previous = key or atom.surface
    return out


def _numbered(sequence: list[tuple[str, str]]) -> list[tuple[tuple[str, int], str]]:
    """Occurrences told apart (the second "me" is ("me", 1)); what stands before is not, so a
    repeated word ("baking soda and baking powder") is no context for an exchange."""
    seen: Counter[str] = Counter()
    out = []
    for key, before in sequence:
        out.append(((key, seen[key]), before))
        seen[key] += 1
    return out


def _swap(q: _Analysis, c: _Analysis) -> str:
    q_roles, c_roles = _roles(q), _roles(c)
    by_marker: dict[str, tuple[set[str], set[str]]] = {}
    for key in q_roles.keys() & c_roles.keys():
        for marker in q_roles[key] ^ c_roles[key]:
            q_side, c_side = by_marker.setdefault(marker, (set(), set()))
            (q_side if marker in q_roles[key] else c_side).add(key)
    for marker, (q_side, c_side) in sorted(by_marker.items()):
        if q_side and c_side:
            here, there = ", ".join(sorted(q_side)), ", ".join(sorted(c_side))
            return f"{marker!r} governs {here} here but {there} in the cached prompt"
    q_seq, c_seq = _numbered(_sequence(q)), _numbered(_sequence(c))
    q_at = {k: (i, before) for i, (k, before) in enumerate(q_seq)}
    c_at = {k: (i, before) for i, (k, before) in enumerate(c_seq) if k in q_at}
    # In the cached prompt, y stands where x stood (after the same word) and x where y stood:
    # "do sharks eat dolphins" / "do dolphins eat sharks", "cat dog food" / "dog cat food",
    # "my landlord owes me" / "I owe my landlord". Indexed by what stands before, not pairwise.
    c_after: dict[str, list[tuple[str, int]]] = {}
    for k, (_, before) in c_at.items():
        c_after.setdefault(before, []).append(k)
    for x, (x_pos, x_before) in q_at.items():
        if x not in c_at:
            continue
        x_pos_c, x_before_c = c_at[x]
        for y in c_after.get(x_before, ()):
            y_pos, y_before = q_at[y]
            if y == x or y_pos < x_pos or c_at[y][0] > x_pos_c:
                continue  # not after x here, or not before x in the cached prompt
            adjacent = y_before == x[0] and x_before_c == y[0]
            if adjacent or (x_before != y_before and x_before_c == y_before):
                return f"{x[0]!r} and {y[0]!r} exchange places"
    return ""


def _difference(q: Counter[str], c: Counter[str]) -> str:
    extra_q, extra_c = q - c, c - q
    parts = []
    if extra_c:
        parts.append(f"cached {', '.join(sorted(extra_c))}")
    if extra_q:
        parts.append(f"asked {', '.join(sorted(extra_q))}")
    return "; ".join(parts)


def _numbers(q: _Analysis, c: _Analysis) -> str:
    extra_q, extra_c = q.numbers - c.numbers, c.numbers - q.numbers
    # "one" is a number only where the other prompt says 1 ("1 cup" / "one cup").
    if extra_q.get("1", 0) and set(extra_q) == {"1"} and not extra_c and extra_q["1"] <= c.soft_ones:
        return ""
    if extra_c.get("1", 0) and set(extra_c) == {"1"} and not extra_q and extra_c["1"] <= q.soft_ones:
        return ""
    if extra_q or extra_c:
        return _difference(q.numbers, c.numbers)
    return ""


def _scope(q: _Analysis, c: _Analysis) -> str:
    for group in lexicon.SCOPE_GROUPS:
        q_poles = {i for i, pole in enumerate(group) if pole & q.surface}
        c_poles = {i for i, pole in enumerate(group) if pole & c.surface}
        if q_poles and c_poles and not (q_poles & c_poles):
            q_word = sorted(w for p in q_poles for w in group[p] & q.surface)[0]
            c_word = sorted(w for p in c_poles for w in group[p] & c.surface)[0]
            return f"{q_word!r} against {c_word!r}"
    for one, other in ((q, c), (c, q)):
        for word in one.surface - other.surface:
            for prefix, opposite in lexicon.SCOPE_PREFIXES:
                if (
                    word.startswith(prefix)
                    and len(word) - len(prefix) >= 3
                    and opposite + word[len(prefix) :] in other.surface
                ):
                    return f"{word!r} against {opposite + word[len(prefix) :]!r}"
    if q.comparatives != c.comparatives:
        return f"comparison before a number: {_difference(q.comparatives, c.comparatives)}"
    if q.limiters != c.limiters:
        return f"limited on one side only ({', '.join(sorted(q.limiters ^ c.limiters))})"
    return ""


def _question(q: _Analysis, c: _Analysis) -> str:
    """Who, when, where and why ask for different answers about the same things."""
    q_asks, c_asks = lexicon.QUESTION_WORDS & q.surface, lexicon.QUESTION_WORDS & c.surface
    if q_asks and c_asks and not (q_asks & c_asks):
        return f"asks {'/'.join(sorted(q_asks))} where the cached prompt asks {'/'.join(sorted(c_asks))}"
    return ""


def _osa_distance(a: str, b: str, limit: int) -> int:
    """Optimal string alignment distance (a transposition counts 1), stopping past ``limit``."""
    if abs(len(a) - len(b)) > limit:
        return limit + 1
    previous2: list[int] = []
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cost = ca != cb
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + cost)
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                current[j] = min(current[j], previous2[j - 2] + 1)
        if min(current) > limit:
            return limit + 1
        previous2, previous = previous, current
    return previous[-1]


def _typo(a: str, b: str) -> bool:
    if a[0] != b[0] or not a.isalpha() or not b.isalpha() or (a in lexicon.PLACES and b in lexicon.PLACES):
        return False
    shortest = min(len(a), len(b))
    if shortest >= 8:
        return _osa_distance(a, b, 2) <= 2
    return shortest >= 4 and _osa_distance(a, b, 1) <= 1


def _misspelt(q: _Analysis, q_key: str, c: _Analysis, c_key: str) -> bool:
    """The same word misspelt (by its stem or as written: "diabetis" / "diabetes")."""
    q_forms = {q_key} | q.spellings.get(q_key, frozenset())
    c_forms = {c_key} | c.spellings.get(c_key, frozenset())
    return any(_typo(a, b) for a in q_forms for b in c_forms)


def _narrowed(one: _Analysis, added: set[str], other: _Analysis) -> list[str]:
    """Added words that narrow the question: in front of a shared content word (a silk shirt
    is not any shirt) or in a phrase of their own ("to factory settings", "in a microwave")."""
    roles = _roles(one)
    in_front = [f"{first} {second}" for first, second in one.modifiers if first in added and second in other.content]
    phrases = [f"{'/'.join(sorted(roles[word]))} {word}" for word in added if word in roles]
    return sorted(in_front + phrases)


def _unmatched(q: _Analysis, c: _Analysis) -> tuple[set[str], set[str]]:
    """Content words of each prompt that the other lacks, after synonyms, typos and joined words."""
    q_only, c_only = set(q.content - c.content), set(c.content - q.content)
    for word in sorted(q_only):
        match = next((other for other in sorted(c_only) if _misspelt(q, word, c, other)), None)
        if match is not None:
            q_only.discard(word)
            c_only.discard(match)
    for one_only, other_only, other in ((q_only, c_only, c), (c_only, q_only, q)):
        surfaces = [a.surface for a in other.atoms if a.kind in ("word", "neg", "one")]
        for first, second in pairwise(surfaces):
            joined = _canonical(first + second)
            if joined in one_only:
                one_only.discard(joined)
                other_only.discard(_canonical(first))
                other_only.discard(_canonical(second))
    return q_only, c_only


def _reject(category: str, reason: str, similarity: float) -> Verdict:
    logger.debug("semantic cache candidate rejected (%s, similarity %.3f): %s", category, similarity, reason)
    return Verdict(ok=False, reason=reason, category=category)


def verify(*, query: str, cached: str, similarity: float, thresholds: Thresholds | None = None) -> Verdict:
    """May ``cached``'s answer be served for ``query`` (the two last user turns, and the
    cosine similarity of their embeddings)? Pure and fast (well under a millisecond).

    ``thresholds`` defaults to ``Thresholds.from_settings()`` (the harness calibrates others).
    """
    limits = Thresholds.from_settings() if thresholds is None else thresholds
    minimum = limits.minimum
    if similarity < minimum:
        return _reject("low_similarity", f"similarity {similarity:.3f} below the minimum {minimum:.3f}", similarity)
    if query == cached:
        return Verdict(ok=True, reason="", wording="same", required_similarity=minimum)
    q, c = _analyse(query), _analyse(cached)
    if reason := _negation(q, c):
        return _reject("negation", reason, similarity)
    if reason := _swap(q, c):
        return _reject("swap", reason, similarity)
    if q.dates != c.dates:
        return _reject("date", f"dates or times differ: {_difference(q.dates, c.dates)}", similarity)
    if q.currencies != c.currencies or q.amounts != c.amounts:
        return _reject("amount", f"amounts differ: {_difference(q.amounts, c.amounts) or 'currency'}", similarity)
    if q.units != c.units:
        return _reject("unit", f"units differ: {_difference(Counter(q.units), Counter(c.units))}", similarity)
    if reason := _numbers(q, c):
        return _reject("number", f"numbers differ: {reason}", similarity)
    if reason := _scope(q, c):
        return _reject("scope", reason, similarity)
    if reason := _question(q, c):
        return _reject("question", reason, similarity)
    q_only, c_only = _unmatched(q, c)
    differs = (
        f"asks about {', '.join(sorted(q_only)) or '-'} where the cached prompt has {', '.join(sorted(c_only)) or '-'}"
    )
    if (q_only & lexicon.PERIOD_KEYS) and (c_only & lexicon.PERIOD_KEYS):
        return _reject("unit", f"{differs} (periods of time)", similarity)
    names = (q_only & q.names) | (c_only & c.names) if q_only and c_only else set()
    if names:
        return _reject("different", f"{differs} (names: {', '.join(sorted(names))})", similarity)
    if not (q_only and c_only) and (narrowed := _narrowed(q, q_only, c) + _narrowed(c, c_only, q)):
        return _reject("different", f"{differs} (narrowed: {', '.join(narrowed)})", similarity)
    if q_only and c_only and not (q.content & c.content):
        return _reject("different", f"{differs} (no content word in common)", similarity)
    wording, required = _required(q_only, c_only, limits, _compound(q, q_only) or _compound(c, c_only))
    if similarity < required:
        category = "different" if wording == "replaced" else "low_similarity"
        reason = f"{differs}: similarity {similarity:.3f} below {required:.3f} for {wording} wording"
        logger.debug("semantic cache candidate rejected (%s, similarity %.3f): %s", category, similarity, reason)
        return Verdict(ok=False, reason=reason, category=category, wording=wording, required_similarity=required)
    return Verdict(ok=True, reason="", wording=wording, required_similarity=required)


def _compound(analysis: _Analysis, only: set[str]) -> bool:
    """Two unmatched words side by side: one thing ("driving licence"), not two."""
    return len(only) == 2 and any(a in only and b in only for a, b in analysis.modifiers)


def _required(q_only: set[str], c_only: set[str], limits: Thresholds, compound: bool) -> tuple[str, float]:
    if q_only and c_only:
        if len(q_only) + len(c_only) == 2 or (compound and len(q_only) + len(c_only) == 3):
            return "replaced", limits.replaced
        return "reworded", limits.minimum + limits.reworded
    if q_only or c_only:
        return "added", limits.minimum + limits.added
    return "same", limits.minimum
