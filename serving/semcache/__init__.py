"""The semantic cache: answers served again to requests that ask the same thing.

- ``policy``: which requests may use the cache (per-model rules) and the exact scope an
  answer is found in (model version, system prompt, sampling parameters, conversation so
  far, tenant);
- ``embed``: the last user turn's embedding, from an embedding replica through the
  platform's own engine client;
- ``store``: the entries in PostgreSQL + pgvector (search inside one scope, insert,
  expiry and purge without index bloat);
- ``verify`` (word lists in ``lexicon``): the check after similarity that rejects
  near-misses that change the answer (negation, swapped entities or direction, changed
  numbers, dates, amounts, units or scope words);
- ``lookup``: the above in order, within a time budget; any failure is a miss.

``serving.orchestrator`` asks it before admission and replays a verified hit like a live
answer; docs/architecture.md, "The semantic cache", has the whole design.
"""
