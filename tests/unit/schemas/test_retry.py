"""The one retry policy (`schemas.retry`): which errors are retried, for how long, and what is not."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import errors as kafka_errors
from clickhouse_driver import errors as ch_errors
from redis import exceptions as redis_errors

from schemas.errors import ConfigError, SchemaError, StoreError
from schemas.retry import Backoff, is_transient, permanent, retry

TINY = Backoff(first_s=0.001, max_s=0.004, give_up_s=None)


def _ch(code: int, text: str = "") -> ch_errors.ServerException:
    return ch_errors.ServerException(f"DB::Exception: {text}", code)


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionRefusedError(111, "refused"),
        ConnectionResetError(),
        TimeoutError(),
        OSError(113, "no route to host"),
        redis_errors.ConnectionError("refused"),
        redis_errors.TimeoutError("no reply"),
        redis_errors.BusyLoadingError("loading"),
        kafka_errors.KafkaConnectionError(),
        kafka_errors.KafkaTimeoutError(),
        kafka_errors.RequestTimedOutError(),
        kafka_errors.NodeNotReadyError(),
        kafka_errors.NotEnoughReplicasError(),  # retriable by Kafka's protocol
        ch_errors.NetworkError("reset"),
        ch_errors.SocketTimeoutError("slow"),
        _ch(159),
        _ch(202),
        _ch(209),
        _ch(210),
        _ch(242),
        _ch(252, "Too many parts (300). Merges are processing significantly slower than inserts"),
        _ch(319),
        _ch(999),
        StoreError("Redis MGET failed"),  # …raised from a transient error: see below
    ],
    ids=lambda e: type(e).__name__ + (f"-{e.code}" if isinstance(getattr(e, "code", None), int) else ""),
)
def test_transient_errors_are_listed(exc: BaseException) -> None:
    if isinstance(exc, StoreError):
        try:
            raise exc from ConnectionResetError("reset")
        except StoreError as chained:
            exc = chained
    assert is_transient(exc) and not permanent(exc)


@pytest.mark.parametrize(
    "exc",
    [
        KeyError("bug"),
        AttributeError("bug"),
        RuntimeError("bug"),
        AssertionError(),
        FileNotFoundError("no such file"),
        PermissionError(),
        redis_errors.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
        kafka_errors.TopicAuthorizationFailedError(),
        kafka_errors.MessageSizeTooLargeError(),
        _ch(60, "Table default.nope does not exist"),
        _ch(252, "Too many partitions for single INSERT block (more than 100)"),
        _ch(469, "Constraint violated"),
        StoreError("Redis MGET failed"),  # no cause: not known to pass
        SchemaError("bad record"),
        ValueError("cannot encode"),
        asyncio.CancelledError(),
    ],
    ids=lambda e: type(e).__name__ + (f"-{e.code}" if isinstance(getattr(e, "code", None), int) else ""),
)
def test_bugs_and_content_errors_are_not_transient(exc: BaseException) -> None:
    assert not is_transient(exc)


def test_content_errors_are_permanent() -> None:
    assert permanent(_ch(469, "Constraint violated"))
    assert permanent(_ch(252, "Too many partitions for single INSERT block (more than 100)"))
    assert permanent(RuntimeError("Code: 53. DB::Exception: Type mismatch"))  # chDB's error, by its text
    assert permanent(kafka_errors.RecordTooLargeError()) and permanent(UnicodeError())
    assert not permanent(_ch(202)) and not permanent(KeyError("bug")) and not permanent(ConnectionError())


def test_backoff_doubles_up_to_its_cap_and_is_validated() -> None:
    assert list(Backoff(0.5, 3.0).delays(6)) == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    with pytest.raises(ConfigError, match="first_s"):
        Backoff(first_s=3.0, max_s=1.0)
    with pytest.raises(ConfigError, match="first_s"):
        Backoff(first_s=0.0)
    with pytest.raises(ConfigError, match="give_up_s"):
        Backoff(give_up_s=-1)


async def test_a_transient_error_is_retried_until_the_step_succeeds() -> None:
    calls: list[tuple[int, float]] = []

    async def flaky() -> str:
        if len(calls) < 3:
            calls.append((len(calls), 0.0))
            raise ConnectionResetError("down")
        return "done"

    heard: list[tuple[int, float]] = []
    got = await retry(flaky, "step", backoff=TINY, on_retry=lambda exc, n, d: heard.append((n, d)))
    assert got == "done" and len(calls) == 3
    assert heard == [(1, 0.001), (2, 0.002), (3, 0.004)]


async def test_a_non_transient_error_is_raised_at_once_unchanged() -> None:
    calls = 0

    async def buggy() -> None:
        nonlocal calls
        calls += 1
        raise KeyError("user_id")

    with pytest.raises(KeyError, match="user_id"):
        await retry(buggy, "step", backoff=TINY)
    assert calls == 1


async def test_it_gives_up_after_give_up_s_with_the_callers_error() -> None:
    calls = 0
    gave_up: list[BaseException] = []

    async def down() -> None:
        nonlocal calls
        calls += 1
        raise redis_errors.ConnectionError("refused")

    t0 = time.monotonic()
    with pytest.raises(StoreError, match=r"^Redis reserve failed \d+ time\(s\) over") as info:
        await retry(
            down,
            "reserve",
            backoff=Backoff(0.01, 0.02, give_up_s=0.1),
            on_give_up=gave_up.append,
            wrap=lambda message, exc: StoreError(f"Redis {message}"),
        )
    assert time.monotonic() - t0 < 2.0  # bounded by give_up_s (plus scheduling), never for ever
    assert calls >= 3 and len(gave_up) == 1
    assert isinstance(info.value.__cause__, redis_errors.ConnectionError)
    # without `wrap`, the last error itself
    with pytest.raises(redis_errors.ConnectionError):
        await retry(down, "reserve", backoff=Backoff(0.01, 0.01, give_up_s=0.0))


async def test_abort_makes_the_next_failure_final_and_ends_the_wait() -> None:
    abort = asyncio.Event()
    calls = 0

    async def down() -> None:
        nonlocal calls
        calls += 1
        raise TimeoutError("slow")

    task = asyncio.create_task(retry(down, "step", backoff=Backoff(60.0, 60.0), abort=abort))
    await asyncio.sleep(0.05)  # in its first (60 s) wait
    t0 = time.monotonic()
    abort.set()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(task, timeout=5)
    assert time.monotonic() - t0 < 2.0 and calls == 2


async def test_cancellation_is_never_swallowed() -> None:
    started = asyncio.Event()

    async def hangs() -> None:
        started.set()
        await asyncio.sleep(60)

    task = asyncio.create_task(retry(hangs, "step", backoff=TINY))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def cancelled() -> None:  # a step that raises CancelledError itself is not retried
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await retry(cancelled, "step", backoff=TINY, transient=lambda exc: True)

    waiting = asyncio.create_task(retry(_always(ConnectionError()), "step", backoff=Backoff(60.0, 60.0)))
    await asyncio.sleep(0.05)  # cancelled in its backoff wait
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


def _always(exc: BaseException):  # type: ignore[no-untyped-def]
    async def step() -> None:
        raise exc

    return step


def test_schemas_retry_imports_no_other_room() -> None:
    import subprocess
    import sys

    rooms = "{'streams', 'trainers', 'serving', 'attribution', 'deploy'}"
    code = f"import sys, schemas.retry; print(sorted({{m.split('.')[0] for m in sys.modules}} & {rooms}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_retry_settings_are_validated_and_build_the_backoffs() -> None:
    from pydantic import ValidationError

    from schemas.settings import Settings

    s = Settings(streams={"retry_first_s": 0.1, "retry_max_s": 5.0}, online={"redis_give_up_s": 7.0})
    assert s.streams.retry_backoff == Backoff(0.1, 5.0, None)
    assert s.online.redis_backoff == Backoff(0.05, 2.0, 7.0)
    with pytest.raises(ValidationError, match=r"streams\.retry_first_s"):
        Settings(streams={"retry_first_s": 40.0})
    with pytest.raises(ValidationError, match=r"online\.redis_retry_first_s"):
        Settings(online={"redis_retry_first_s": 3.0})
    with pytest.raises(ValidationError, match="redis_give_up_s"):
        Settings(online={"redis_give_up_s": -1.0})


def test_each_clients_own_errors_are_listed_and_a_bug_is_not() -> None:
    from aiokafka import errors as kafka_exceptions
    from redis import exceptions as redis_exceptions

    from schemas.retry import clickhouse_errors, kafka_errors, redis_errors

    assert isinstance(ch_errors.ServerException("x", 60), clickhouse_errors())
    assert isinstance(EOFError(), clickhouse_errors())
    assert isinstance(redis_exceptions.ResponseError("WRONGTYPE"), redis_errors())
    assert isinstance(kafka_exceptions.CommitFailedError(), kafka_errors())
    for errors in (clickhouse_errors(), kafka_errors(), redis_errors()):
        assert not isinstance(KeyError("bug"), errors) and not isinstance(TypeError("bug"), errors)


def test_our_own_errors_are_never_content_errors() -> None:
    """ConfigError is a ValueError too (a bad setting is a bad value); a write that fails with
    one (a misconfigured store) must surface, not have its rows split out as refused content."""
    from schemas.errors import ConfigError, StoreError

    assert isinstance(ConfigError("x"), ValueError)
    assert not permanent(ConfigError("clickhouse.url: database name 'a-b' must be ASCII letters"))
    assert not permanent(StoreError("redis down"))
    assert permanent(ValueError("the driver could not encode a value"))
