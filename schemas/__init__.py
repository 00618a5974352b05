"""The contract of adstream: event, API and ΔW models, topic names, settings and errors."""

from schemas.api import AdapterInfo, AdRequest, AdResponse, ServedAd, StageMs
from schemas.errors import (
    AdapterError,
    AdstreamError,
    ConfigError,
    ModelError,
    SchemaError,
    StackError,
    StoreError,
)
from schemas.events import (
    SLOTS,
    AdapterDelta,
    AdCreative,
    Click,
    Conversion,
    DeadLetter,
    Dwell,
    Impression,
    Message,
    Slot,
    Touch,
    TrainingExample,
    UserEvent,
)
from schemas.settings import Settings, get_settings

__all__ = [
    "SLOTS",
    "AdCreative",
    "AdRequest",
    "AdResponse",
    "AdapterDelta",
    "AdapterError",
    "AdapterInfo",
    "AdstreamError",
    "Click",
    "ConfigError",
    "Conversion",
    "DeadLetter",
    "Dwell",
    "Impression",
    "Message",
    "ModelError",
    "SchemaError",
    "ServedAd",
    "Settings",
    "Slot",
    "StackError",
    "StageMs",
    "StoreError",
    "Touch",
    "TrainingExample",
    "UserEvent",
    "get_settings",
]
