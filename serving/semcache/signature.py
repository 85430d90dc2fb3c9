"""Signatures: how a lookup finds the entries that may ask a query's question, without embedding it.

The verifier (``verify``) serves a candidate only when both prompts say the same words in the
same order once what never changes an answer is normalised (at the ``same`` and ``reordered``
tiers), or do so after one misspelt word is read as the word it misspells (``typo``), or after
two words are read as one ("e mail" / "email"). So every entry the verifier could accept
shares a *signature* with the query: a hash of the scope and the sorted bag of the
normalised words (``verify.analyse``'s keys, without punctuation and without "what",
"whether" and "if", which the question frames move or drop). An entry stores its
signatures in an indexed array (``CacheEntry.signatures``, GIN) and a lookup is one indexed
query for any overlap: a miss costs hashing a few word bags and one round trip, not an
embedding and a vector search.

The kinds of signature, each hashed with its own tag (so that they only meet their match):

- ``=``: the bag itself, and the bag with each adjacent pair of words joined into one
  (both sides: either may write "log in" where the other writes "login");
- ``-<letter>``, the typo tier with the query misspelt: an entry stores its bag minus each
  word that could be misspelt (``typo_eligible``), the query only minus each word the
  dictionary does not know;
- ``~<letter>``, the typo tier with the stored prompt misspelt: the other way round;
- ``=`` again for the bag minus each unknown word, on both sides: a misspelt frame word
  ("wehther") is one the other side's bag leaves out.

The first letter of the missing word goes into the tag (a typo keeps its first letter).
Prompts longer than ``VARIANT_MAX_WORDS`` get the ``=`` bag only.

A signature only *finds* candidates; each is still verified word by word (and by
similarity) before anything is served. Pure Python, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from serving.semcache import verify

# Keys the question frames move or drop ("tell me the X" / "what is the X"; "tell me whether
# X can" / "can X"): left out of the bag, as the verifier's comparison leaves them out.
FRAME_WORDS = frozenset({"what", "whether", "if"})
# Longer prompts are found by their exact bag only (no typo or joined-word variants).
VARIANT_MAX_WORDS = 64


def _hash(scope: str, tag: str, bag: Iterable[str]) -> int:
    material = "\x1f".join([scope, tag, *sorted(bag)]).encode()
    return int.from_bytes(hashlib.blake2b(material, digest_size=8).digest(), "big", signed=True)


def _words(text: str) -> list[verify.Word]:
    return [w for w in verify.analyse(text) if w.key not in (verify.COMMA, verify.END) and w.key not in FRAME_WORDS]


def _joined(words: list[verify.Word]) -> list[list[str]]:
    """The bag with each adjacent pair of words written as one ("e mail" → "email")."""
    keys = [w.key for w in words]
    out = []
    for i in range(len(words) - 1):
        together = words[i].surface + words[i + 1].surface
        if together.isalpha():
            out.append([*keys[:i], verify.stem(together), *keys[i + 2 :]])
    return out


def _minus(words: list[verify.Word], *, unknown_only: bool) -> list[tuple[str, list[str]]]:
    """(the word's first letter, the bag without it) for each word that could be misspelt."""
    keys = [w.key for w in words]
    out = []
    for i, word in enumerate(words):
        if verify.typo_eligible(word) and (not unknown_only or not verify.known(word.surface)):
            out.append((word.surface[0], keys[:i] + keys[i + 1 :]))
    return out


def _signatures(scope: str, text: str, *, stored: bool) -> list[int]:
    words = _words(text)
    out = [_hash(scope, "=", [w.key for w in words])]
    if len(words) <= VARIANT_MAX_WORDS:
        out += [_hash(scope, "=", bag) for bag in _joined(words)]
        # An entry's bag minus any word meets a query's minus an unknown word (the query is
        # misspelt), and the other way round under the other tag (the entry is misspelt).
        mine, theirs = ("-", "~") if stored else ("~", "-")
        out += [_hash(scope, mine + letter, bag) for letter, bag in _minus(words, unknown_only=False)]
        unknown = _minus(words, unknown_only=True)
        out += [_hash(scope, theirs + letter, bag) for letter, bag in unknown]
        # A misspelt frame word ("wehther") is a word the other side's bag leaves out.
        out += [_hash(scope, "=", bag) for _, bag in unknown]
    return sorted(set(out))


def bag_of(scope: str, text: str) -> int:
    """The signature of the prompt's own word bag (entries sharing it are tried first)."""
    return _hash(scope, "=", [w.key for w in _words(text)])


def of_entry(scope: str, prompt: str) -> list[int]:
    """The signatures an entry is stored with."""
    return _signatures(scope, prompt, stored=True)


def of_query(scope: str, query: str) -> list[int]:
    """The signatures a lookup asks for (an entry sharing any of them is a candidate)."""
    return _signatures(scope, query, stored=False)
