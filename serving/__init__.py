"""adstream serving: the Ray Serve ad server (recall → rank + LoRA → rerank) with deadlines,
adapter hot swap and canary.

Run it: `adstream serve [--catalog FILE] [--port N]` (prints the URL; `deploy/cli_serving.py`),
or `serve run serving.app:app_builder [key=value …]` (an application builder: settings from
`ADSTREAM_*` and its arguments, every user cold: no state codec; `deploy.serve_app:build` adds
streams' codec).

Modules, each a pure core or a thin shell:

- `app`       — the one ingress deployment (FastAPI through `@serve.ingress`): HTTP API, admission
                (503 + Retry-After), micro-batched ranking, the deadline ladder, metrics routes.
- `batching`  — the replica's micro-batcher: requests that arrive together run as one batch.
- `qos`       — QoS classes Guaranteed / Burstable / BestEffort: the priority gate in front of the
                pipeline (per-class queue limits and timeouts; the lowest class is shed first).
- `http`      — the request edge (media type, bounded body, duplicate keys, `AdRequest`) and the
                refusal answers, shared with the benchmarks' framework floor (`benchmarks.lib.floor`).
- `request`   — the request path, top-down over a batch: plan, user read, recall, rank, rerank,
                record (timing as a wrapper).
- `loops`     — start-up loading and background loops (catalog, deltas, clicks, counters, canary).
- `pipeline`  — per-request recall and rerank over the catalog (no Ray).
- `catalog`   — ads as numpy columns (vectors, bids, budgets, spend, ranker id buckets).
- `index`     — the recall index protocol and the exact numpy implementation.
- `ranking`   — the base ranker with banked LoRA layers; features as `trainers.models.features`.
- `adapters`  — the adapter bank: stacked, double-buffered LoRA tensors (and the ΔW of narrow
                layers), guarded writes, swap, rollback, promote.
- `banked`    — the layers that add each sample's adapter (`BankedLinear`: merged weights /
                per-sample embedding_bag / ΔW rows; `BankedEmbedding`) and the batch plan.
- `hotswap`   — applying `AdapterDelta`s in seq order (`schemas.delta.apply_delta`), re-sync.
- `rerank`    — eCPM, pacing, long-tail boost, diversity, GSP prices (pure).
- `deadline`  — the request budget and the ladder adapter → base → recall score → popular (pure).
- `canary`    — stable user buckets, online AUC per arm, the promote/rollback rule (pure).
- `io`        — Redis (user state via a codec, frequency caps, spend, snapshots) and Kafka shells.
- `metrics`   — `adstream_serving_*` Prometheus metrics (no ids as labels).

Serving may import `schemas` and `trainers.models` only (an import-linter contract); the user
record streams writes is a contract too (`schemas.user_record`), read by `io.UserRecordCodec`.
"""
