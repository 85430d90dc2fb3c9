"""The semantic cache: answers served again to requests that ask the same thing.

- ``policy``: which requests may use the cache (per-model rules) and the exact scope an
  answer is found in (model version, system prompt, sampling parameters, conversation so
  far, tenant);
- ``embed``: the last user turn's embedding, from an embedding replica through the
  platform's own engine client;
- ``store``: the entries in PostgreSQL + pgvector (search inside one scope, insert,
  expiry and purge without index bloat);
- ``verify`` (number, currency and unit words in ``lexicon``): the check after similarity,
  conservative by construction: the same words in the same order once spelling, numerals,
  politeness, the question's frame, one typo or a moved clause are normalised away, or a
  miss;
- ``paraphrase`` (built by ``verifier_build``), ``bound``: the paraphrase tier below the word
  tiers, off by default: the prompt embedded in process, the scope's nearest entries, a
  learned verifier's score held to each entry's own threshold (its evidence, vCache's idea);
- ``lookup``: the above in order, within a time budget; any failure is a miss.

``serving.llm.call`` asks it before admission and replays a verified hit like a live
answer; docs/architecture.md, "The semantic cache", has the whole design.
"""
