"""Settings are nested per concern: an old flat name is refused with its new name, never ignored."""

from __future__ import annotations

import pytest

from schemas.errors import ConfigError
from schemas.settings import Settings


def test_a_flat_keyword_is_refused_naming_its_nested_name() -> None:
    with pytest.raises(ConfigError, match=r"kafka_bootstrap.*kafka\.bootstrap"):
        Settings(kafka_bootstrap="127.0.0.1:1")  # type: ignore[call-arg]


def test_a_flat_key_in_a_dumped_dict_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"serve_impressions_pending.*serving\.impressions_pending"):
        Settings(**{**Settings().model_dump(), "serve_impressions_pending": 50})


def test_an_unknown_keyword_is_refused_too() -> None:
    with pytest.raises(ConfigError, match="no_such_setting"):
        Settings(no_such_setting=1)  # type: ignore[call-arg]


def test_nested_keywords_work() -> None:
    s = Settings(kafka={"bootstrap": "127.0.0.1:1"}, serving={"impressions_pending": 50})
    assert s.kafka.bootstrap == "127.0.0.1:1" and s.serving.impressions_pending == 50
