"""Signed events: the one rule by which replicas vouch for impressions and clients echo clicks.

An impression is produced by the replica that served it; anyone else with write access to
`ad.impressions` could send a twin of a served impression (same `event_id`, another price or
campaign). So replicas sign each impression (`Impression.sig`: HMAC-SHA256, hex, over
`impression_bytes`, a compact canonical encoding of every other field), and each served ad
carries a click token (`ServedAd.click_token`: HMAC of impression id, user and ad, 16 bytes
base64url) that the client echoes in its `Click` / `Dwell`: a click is then possible only for an
impression actually served to that user. The streams worker checks both (`check_event`) and
dead-letters what fails. Conversions name no impression (attribution joins them by the user's
journey), so they carry neither.

The key (`event_key`) is `settings.event_signing_key`, or else the key file
`<state_dir>/event-signing.key` that the first process of a local stack creates; it is resolved
like the adapter deltas' key (`resolve_key`, shared with `schemas.delta.resolve_signing_key`).
The operator's own tools that make events on purpose (the simulator's history, `adstream
produce`, benchmarks, tests) sign through `seal` with the same key.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar, overload

from pydantic import SecretStr

from schemas.errors import ConfigError
from schemas.events import Click, Dwell, Impression, Message, View

if TYPE_CHECKING:
    from schemas.settings import Settings

MIN_KEY_BYTES: Final = 32
EVENT_KEY_FILE: Final = "event-signing.key"
TOKEN_BYTES: Final = 16  # 22 base64url characters

M = TypeVar("M", bound=Message)


def resolve_key(configured: SecretStr, path: Path, setting: str, *, create: bool = True) -> bytes | None:
    """An HMAC key: the `configured` setting when set (≥ 32 bytes), else the key file `path`,
    created (random, mode 0600) when missing and `create`: every process of one stack (workers,
    trainers, replicas, tests) shares the state dir and so the key. None only when there is no
    key and `create` is False. `setting` names the setting in errors."""
    value = configured.get_secret_value().encode()
    if value:
        if len(value) < MIN_KEY_BYTES:
            raise ConfigError(f"{setting} must be at least {MIN_KEY_BYTES} bytes (got {len(value)})")
        return value
    if not path.exists():
        if not create:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32) + "\n")
        try:
            os.link(tmp, path)  # atomic: two processes starting at once end up with one key
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    key = path.read_text().strip().encode()
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(
            f"{setting}: key file {path} holds {len(key)} bytes, at least {MIN_KEY_BYTES} needed"
        )
    return key


@overload
def event_key(settings: Settings) -> bytes: ...
@overload
def event_key(settings: Settings, *, create: bool) -> bytes | None: ...
def event_key(settings: Settings, *, create: bool = True) -> bytes | None:
    """The HMAC key of impressions and click tokens (`settings.event_signing_key` or the key file;
    None only with `create=False` and no key yet)."""
    return resolve_key(
        settings.event_signing_key, settings.state_dir / EVENT_KEY_FILE, "event_signing_key", create=create
    )


@functools.lru_cache(maxsize=8)
def _keyed(key: bytes) -> hmac.HMAC:
    # the key's inner and outer pads, computed once: each message copies them (~20 % cheaper)
    return hmac.new(key, digestmod=hashlib.sha256)


def _mac(key: bytes, msg: bytes) -> hmac.HMAC:
    mac = _keyed(key).copy()
    mac.update(msg)
    return mac


def _text(value: str | None) -> str:
    # length-prefixed, so no field's content can shift into its neighbour; None differs from ""
    return "-" if value is None else f"{len(value)}:{value}"


def impression_bytes(imp: Impression, ts: float | None = None) -> bytes:
    """The canonical bytes an impression's signature covers: every field but `sig`, in a fixed
    order, each text field length-prefixed; `ts` as epoch seconds (`repr` of the float: the same
    instant in any offset), floats by `repr` (what JSON round-trips exactly). Built by hand, not
    by a pydantic JSON dump: as fast, and the same bytes under any pydantic version (replicas and
    workers may run different ones). `ts` is `imp.ts.timestamp()` when the caller has it.

    Each text field is written as `_text` writes it, inline: this runs for every impression
    the worker reads.
    """
    return _canonical(imp.__dict__, ts)  # frozen model: its fields without attribute lookups


def _canonical(d: Mapping[str, Any], ts: float | None) -> bytes:
    """`impression_bytes` of an impression's fields (`d`: its `__dict__`, or the fields it is
    about to be built from: `impression_sig_of`)."""
    e, u, r, a, c, v = (
        d["event_id"], d["user_id"], d["request_id"], d["ad_id"], d["campaign_id"], d["advertiser_id"]
    )  # fmt: skip
    pctr, mv, av = d["pctr"], d["model_version"], d["adapter_version"]
    if ts is None:
        ts = d["ts"].timestamp()
    return (
        "adstream-impression-v1"
        f"|{'-' if e is None else f'{len(e)}:{e}'}|{'-' if u is None else f'{len(u)}:{u}'}"
        f"|{'-' if r is None else f'{len(r)}:{r}'}|{'-' if a is None else f'{len(a)}:{a}'}"
        f"|{'-' if c is None else f'{len(c)}:{c}'}|{'-' if v is None else f'{len(v)}:{v}'}|{d['slot']}"
        f"|{ts!r}|{d['position']}|{float(d['price'])!r}"
        f"|{'-' if pctr is None else repr(float(pctr))}"
        f"|{'-' if mv is None else f'{len(mv)}:{mv}'}|{'-' if av is None else f'{len(av)}:{av}'}"
        # the variant fields only when set: impressions without them keep their v1 bytes
        + _variant_suffix(d.get("variant_id"), d.get("variant_propensity"))
        + _policy_suffix(d.get("ab_arm"), d.get("propensity"), d.get("explored"))
        + _billing_suffix(d.get("bid_type"), d.get("render"))
        + _query_suffix(d.get("query_match"))
    ).encode()


def _variant_suffix(variant_id: str | None, propensity: float | None) -> str:
    """The served variant and its selection probability in an impression's canonical bytes."""
    if variant_id is None and propensity is None:
        return ""
    vid = "-" if variant_id is None else f"{len(variant_id)}:{variant_id}"
    return f"|variant|{vid}|{'-' if propensity is None else repr(float(propensity))}"


def _policy_suffix(arm: str | None, propensity: float | None, explored: bool | None) -> str:
    """The A/B arm, the logging propensity and the exploration flag in an impression's canonical
    bytes (only when one is set: impressions without them keep their earlier bytes)."""
    if arm is None and propensity is None and explored is None:
        return ""
    p = "-" if propensity is None else repr(float(propensity))
    e = "-" if explored is None else ("1" if explored else "0")
    return f"|policy|{'-' if arm is None else arm}|{p}|{e}"


def _billing_suffix(bid_type: str | None, render: str | None) -> str:
    """How the impression is billed and rendered, in its canonical bytes (only when one is set:
    impressions without them keep their earlier bytes)."""
    if bid_type is None and render is None:
        return ""
    return f"|billing|{'-' if bid_type is None else bid_type}|{'-' if render is None else render}"


def _query_suffix(match: float | None) -> str:
    """The request query's match with the ad in an impression's canonical bytes (only when set:
    impressions without a query keep their earlier bytes)."""
    return "" if match is None else f"|query|{float(match)!r}"


def impression_sig(imp: Impression, key: bytes, ts: float | None = None) -> str:
    """HMAC-SHA256 (hex) of `impression_bytes(imp)` (`ts`: `imp.ts.timestamp()` if known)."""
    return _mac(key, impression_bytes(imp, ts)).hexdigest()


def impression_sig_of(fields: Mapping[str, Any], key: bytes, ts: float | None = None) -> str:
    """`impression_sig` of the impression `Impression(**fields)` will be, before it is built (the
    ad server signs what it serves, then builds each impression once, `sig` included): every
    field of the canonical bytes must be in `fields`, valid as `Impression` keeps it (str, int,
    float, None; `ts` an aware datetime)."""
    return _mac(key, _canonical(fields, ts)).hexdigest()


def sign_impression(imp: Impression, key: bytes) -> Impression:
    """The same impression with its `sig`."""
    return imp.model_copy(update={"sig": impression_sig(imp, key)})


def click_token(key: bytes, impression_id: str, user_id: str, ad_id: str) -> str:
    """The token a served ad carries and its view, click or dwell echoes: 16 bytes of
    HMAC-SHA256(impression id, user, ad), base64url without padding."""
    msg = f"adstream-click-v1|{_text(impression_id)}|{_text(user_id)}|{_text(ad_id)}".encode()
    digest = _mac(key, msg).digest()[:TOKEN_BYTES]
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def seal(event: M, key: bytes) -> M:
    """What a trusted producer sends: an Impression signed, a View, Click or Dwell with its
    click token; any other event unchanged."""
    if isinstance(event, Impression):
        update = {"sig": impression_sig(event, key)}
    elif isinstance(event, Click | Dwell | View):
        update = {"click_token": click_token(key, event.impression_id, event.user_id, event.ad_id)}
    else:
        return event
    return event.model_copy(update=update)


def check_event(
    event: Message, key: bytes, *, impressions: bool = True, clicks: bool = True, ts: float | None = None
) -> tuple[str, str] | None:
    """None when `event` passes; else (reason, error): an impression without a valid `sig`
    (with `impressions`), a view, click or dwell without a valid `click_token` (with `clicks`).
    `ts` is `event.ts.timestamp()` when the caller has it already."""
    if isinstance(event, Impression):
        if not impressions:
            return None
        if event.sig is None:
            return "unsigned", f"unsigned impression {event.event_id!r}: field 'sig' is missing"
        if not hmac.compare_digest(event.sig, impression_sig(event, key, ts)):
            return (
                "bad_signature",
                f"bad impression signature on {event.event_id!r}: field 'sig' does not verify",
            )
        return None
    if isinstance(event, Click | Dwell | View):
        if not clicks:
            return None
        if event.click_token is None:
            return "no_click_token", (
                f"{event.kind} {event.event_id!r} without a click token: field 'click_token' is missing"
            )
        want = click_token(key, event.impression_id, event.user_id, event.ad_id)
        if not hmac.compare_digest(event.click_token, want):
            return "bad_click_token", (
                f"{event.kind} {event.event_id!r}: field 'click_token' does not match impression "
                f"{event.impression_id!r} served to this user and ad"
            )
    return None
