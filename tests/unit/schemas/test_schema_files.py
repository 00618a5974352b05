"""The checked-in JSON Schema files are exactly what the models generate, and settings load from env."""

from __future__ import annotations

import pytest

from schemas import jsonschema
from schemas.settings import Settings, env_name, leaf_fields, nested


def test_checked_in_json_schemas_match_the_models() -> None:
    for name, text in jsonschema.expected_files().items():
        path = jsonschema.SCHEMA_DIR / name
        assert path.exists(), f"{name} missing: run `python -m schemas.jsonschema`"
        assert path.read_text() == text, f"{name} is stale: run `python -m schemas.jsonschema`"


def test_settings_read_the_adstream_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADSTREAM_KAFKA__BOOTSTRAP", "kafka.example:9093")
    monkeypatch.setenv("ADSTREAM_SERVING__ADMIN_TOKEN", "s3cret")
    monkeypatch.setenv("ADSTREAM_DEVICE", "cpu")
    s = Settings(_env_file=None)  # type: ignore[call-arg]
    assert s.kafka.bootstrap == "kafka.example:9093"
    assert s.serving.admin_token.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(s)


def test_settings_reject_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADSTREAM_DEVICE", "tpu")
    with pytest.raises(ValueError, match="device"):
        Settings(_env_file=None)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    "field, value",
    [
        ("canary.auc_gain", -0.01),  # would promote a worse candidate
        ("canary.cooldown_s", -1.0),
        ("serving.rank_chunk", 0),
        ("serving.merge_min", 0),
        ("serving.merge_max", -1),
        ("online.embedding_lr", 0.0),
    ],
)
def test_settings_reject_out_of_range_knobs(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        Settings(_env_file=None, **nested({field: value}))  # type: ignore[call-arg]


def test_env_example_lists_every_setting() -> None:
    text = (jsonschema.SCHEMA_DIR.parent.parent / ".env.example").read_text()
    for name in leaf_fields():
        assert f"{env_name(name)}=" in text, name
