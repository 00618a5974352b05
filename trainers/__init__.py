"""adstream trainers room: the ranker and recall models, LoRA adapters, offline and online training.

Models
- `trainers.models.features`: the ranker's batch feature spec (`RankerBatch`, pure `featurize`).
- `trainers.models.ranker`: the DCN-v2 CTR ranker (`Ranker`, `RankerConfig`), safetensors checkpoints
  (`save_checkpoint`, `load_checkpoint` → `(model, version)`).
- `trainers.models.two_tower` + `trainers.models.text`: the two-tower recall model with MiniLM title vectors,
  its checkpoint and the ad index (`ad_index.safetensors` + `ad_index.json`).

Adapters and ΔW (what serving hot-swaps)
- `trainers.models.lora`: `AdapterBank` (PEFT LoRA on the ranker's Linear layers, mixed-adapter
  batches), `LoraSettings` (adapter ids: `schemas.ids.adapter_id_for`, the ids streams writes into
  TrainingExamples).
- `schemas.delta`: the `AdapterDelta` payload (safetensors; `<m>.dirs`/`.lora_A`/`.lora_B`),
  `encode_delta`, `decode_delta`, guarded `apply_delta` (`SeqGapError`, `StaleDeltaError`;
  epochs: `new_epoch`, `StaleEpochError`, `EpochChangeError`).
- `trainers.snapshots`: the Redis key layout of adapter snapshots and seq reservations.

Training
- `trainers.offline` / `trainers.train_all` / `trainers.baseline`: `adstream train`.
- `trainers.online`: `OnlineTrainer` (progressive validation, sparse ΔW, guards);
  `trainers.reorder`: delayed-feedback hold; `trainers.service`: the Kafka/Redis shell of
  `adstream trainer`; `trainers.replay`: `adstream trainer --replay`.
- `trainers.quality`: AUC / log loss (whole and rolling); `trainers.telemetry`: Prometheus.
"""
