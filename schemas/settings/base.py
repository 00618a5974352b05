"""The base of every settings group: frozen, no unknown keys, a ConfigError naming the dotted setting."""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class Group(BaseModel):
    """A frozen group of settings; built directly (`OnlineSettings(lr=0.01)`, as rooms and tests
    do), a bad value is a ConfigError naming the group, the field and the value."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            from schemas.errors import ConfigError

            where = _group_path(type(self))
            bad = "; ".join(
                f"{'.'.join([where, *(str(p) for p in e['loc'])])}: {e['msg']} (got {e.get('input')!r})"
                for e in exc.errors()
            )
            raise ConfigError(bad) from None


@cache
def _group_path(group: type[BaseModel]) -> str:
    """The dotted name of a settings group (`CanarySettings` -> `canary`, `state.weights`)."""

    def walk(model: type[BaseModel], prefix: str) -> str | None:
        for name, info in model.model_fields.items():
            sub = info.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                if sub is group:
                    return prefix + name
                found = walk(sub, f"{prefix}{name}.")
                if found:
                    return found
        return None

    from schemas.settings import Settings

    return walk(Settings, "") or group.__name__
