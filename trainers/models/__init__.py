"""The model classes serving shares with training: the ranker, its features, the towers, the
title encoder and the LoRA layers. Serving may import `trainers.models` and nothing else of
`trainers` (an import-linter contract in `pyproject.toml`)."""
