"""Streams room: the worker that validates events, keeps user state and joins labels.

Run it with `adstream worker` (the Faust app, reading whole fetches through Faust's consumer;
`--engine aiokafka` for a bare aiokafka consumer group, same pipeline). Pure cores, usable
without Kafka/Redis:

* `streams.state` — `decay`, `apply_event(state, event, ad, params) -> UserState` (one state
  step, `fold_event`), lazy reads (`intent_scores`, `vector_at`), `same_state`;
* `streams.fold` — `fold_batch`: a batch of events folded per user, the vectors stepped as arrays
  (what `Processor.on_batch`, the worker's path, runs; the same bits as `apply_event` per event);
* `schemas.user_record` — the compact Redis record (`encode_state`/`decode_state`), `user_key`,
  `read_user_state(redis, prefix, user_id)` / `aread_user_state` and `served_view` for serving;
* `streams.join` — the impression→click/dwell label join, `adapter_id`, `example_id`;
* `streams.in_memory` — `training_examples(events, settings)` and `replay(...)`: the worker's
  state and join over a time-ordered event list (trainer replay, drift benchmark, tests).

Records are decoded a fetch at a time by the contract's `schemas.decode.BatchDecoder`.
Shells: `streams.pipeline` (validation → merge → state/join → batched ClickHouse/Kafka/Redis
commit), `streams.app` (Faust; why Redis and not Faust tables is documented there) with
`streams.engine_faust` (batches from Faust's fetch loop), `streams.engine_aiokafka` (aiokafka),
`streams.runtime`, `streams.store`, `streams.sink`, `streams.metrics`.
"""
