"""Batch jobs: the requests of an uploaded file run offline, each exactly once, at the batch price.

OpenAI's Batch API (``/v1/batches``, ``serving.batches.views``) and the seeds' ``/api/v1/batch``
create a ``Batch`` from a file of requests (``serving.batches.files``). Celery's ``batch`` queue does
the rest (``serving.tasks.batch_work`` → ``work``): it validates the file into ``BatchLine``
rows (validating → in_progress), runs the lines through the same request scripts as
interactive traffic (``InferenceCall``, ``PredictCall``: routing, canaries, the caches,
metering) at a low priority, and when no line is left to run writes the output and error
files in line order (finalizing → completed; or expired, cancelled).

Exactly once, whoever dies:

- A worker claims lines (``SELECT … FOR UPDATE SKIP LOCKED``): running, with a lease it
  renews while they run, and an attempt number. Attempt *k* of line *i* is the request
  ``uuid5(batch, i, k)`` in the ledger.
- A line's answer is written (conditionally: still running, same attempt) *before* its usage
  event; the event is written once the answer is stored, and kept on the row until then
  (``metered``), so a worker that dies between the two leaves it for the next tick to write.
  The ledger writes an event once per request id, so writing it twice changes nothing.
- A line whose worker died (its lease ran out) goes back to pending; its attempt's admission
  is given back (``ledger.release``: no event, nothing charged) and it runs again as the
  next attempt. The sweeper of lost gateways leaves batch lines' admissions to this.
- An engine that fails or vanishes mid-line gives the line back the same way, up to
  ``BATCH_MAX_ATTEMPTS``; a request the model refuses (4xx) is an answer: it fails, in the
  error file, metered as interactive traffic would be.

A batch whose organisation reaches a spend cap or token quota stops taking lines: the rest
end in the error file as ``insufficient_quota`` (nothing is overspent: each line is
admitted against the budgets like any request). Cancel stops new lines at once; lines in
flight finish. At the completion window's end the batch expires: lines done are kept, the
rest end as ``batch_expired``.
"""
