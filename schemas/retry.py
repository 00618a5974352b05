"""The one retry policy of adstream: which errors may pass, which never will, and how long to wait.

Two explicit lists, both here so that one module states them:

* `is_transient(exc)`: the same call may succeed later (a broker, Redis or ClickHouse that is
  down, slow, busy, electing a leader or still loading). Only these are retried.
* `permanent(exc)`: a write failed because of *what* it writes (a record larger than the broker
  takes, a row the server refuses for its content, a value the client cannot encode). Retrying
  cannot help; the caller splits out and dead-letters the refused records.

Anything on neither list is a bug or a misconfiguration (a KeyError, a WRONGTYPE reply, an
unknown table): `retry` raises it at once so it surfaces instead of looping as "store down".

`retry(step, what, backoff=...)` runs `step` until it succeeds, waiting `Backoff.first_s`,
doubling up to `max_s`, and gives up once `give_up_s` have passed since the first failure
(`None`: never; the streams worker pauses rather than lose a batch). `Backoff.delays()` alone is
the schedule for loops that restart rather than retry (serving's supervisor: `Backoff(0.5, 30.0)`).
The client libraries are imported lazily: schemas stays importable without them.

>>> list(Backoff(0.5, 3.0).delays(5))
[0.5, 1.0, 2.0, 3.0, 3.0]
>>> is_transient(ConnectionResetError()), is_transient(KeyError("bug")), permanent(ValueError())
(True, False, True)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import struct
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from schemas.errors import AdstreamError, ConfigError

log = logging.getLogger(__name__)
T = TypeVar("T")

Classifier = Callable[[BaseException], bool]
OnRetry = Callable[[BaseException, int, float], None]  # (error, attempt, seconds until the next)
Wrap = Callable[[str, BaseException], BaseException]  # (give-up message, last error) → what to raise

# ClickHouse server codes after which the same query may succeed later
_TRANSIENT_CODES = frozenset(
    {
        159,  # TIMEOUT_EXCEEDED: the server ran out of time under load; the next try may not
        202,  # TOO_MANY_SIMULTANEOUS_QUERIES: max_concurrent_queries reached; others will finish
        209,  # SOCKET_TIMEOUT: the network, not the query
        210,  # NETWORK_ERROR: connection refused or reset
        242,  # TABLE_IS_READ_ONLY: a replica lost its keeper session; it comes back read-write
        252,  # TOO_MANY_PARTS: merges are slower than inserts (not "for single INSERT block": permanent)
        319,  # UNKNOWN_STATUS_OF_INSERT: the keeper session broke mid-insert (inserts are idempotent)
        999,  # KEEPER_EXCEPTION: the coordination service is unreachable or electing
    }
)
# ClickHouse error codes that say "this data, never": parse/type/range/constraint errors
_PERMANENT_CODES = frozenset({6, 26, 27, 38, 41, 53, 69, 70, 72, 117, 131, 321, 469})
_CODE = re.compile(r"Code: (\d+)")
_FILE_ERRORS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)
_SINGLE_BLOCK = "for single INSERT block"  # TOO_MANY_PARTS of one block: it has too many partitions


def _clickhouse_code(exc: BaseException) -> int | None:
    """The server's error code of a ClickHouse error (its `code`, or "Code: N" in its text)."""
    code = getattr(exc, "code", None)
    if isinstance(code, int):
        return code
    found = _CODE.search(str(exc))
    return int(found.group(1)) if found else None


def _is_clickhouse(exc: BaseException) -> bool:
    """Whether `exc` comes from ClickHouse: clickhouse-driver's errors, or a server message
    ("Code: N. DB::Exception: …") another client passed on (chDB in process, HTTP)."""
    if "DB::Exception" in str(exc):
        return True
    try:
        from clickhouse_driver import errors as ch_errors
    except ImportError:  # pragma: no cover - every room installs it; schemas must not need it
        return False
    return isinstance(exc, ch_errors.Error)


def is_transient(exc: BaseException) -> bool:
    """Whether the call that raised `exc` may succeed if made again later (see the module docs).

    An adstream error raised `from` a transient one (a store's StoreError wrapping a dropped
    connection) is transient too; a content error (`permanent`) never is.
    """
    if isinstance(exc, asyncio.CancelledError):
        return False  # never retried: cancellation must reach the task's owner
    if isinstance(exc, AdstreamError):
        cause = exc.__cause__
        return cause is not None and is_transient(cause)
    if permanent(exc):
        return False
    # builtin: refused/reset/broken pipe (ConnectionError), timeouts (TimeoutError, which
    # asyncio.wait_for raises), and other socket-level failures (OSError: no route, DNS). Not
    # the file-system OSErrors: a missing file or a permission does not come back by waiting.
    if isinstance(exc, _FILE_ERRORS):
        return False
    if isinstance(exc, ConnectionError | TimeoutError | OSError):
        return True
    return _redis_transient(exc) or _kafka_transient(exc) or _clickhouse_transient(exc)


def _redis_transient(exc: BaseException) -> bool:
    try:
        from redis import exceptions as redis_errors
    except ImportError:  # pragma: no cover - every room installs it; schemas must not need it
        return False
    # ConnectionError covers refused/reset and BusyLoadingError (a server loading its data set
    # answers again when done); TimeoutError: no reply in socket_timeout. Not ResponseError
    # (WRONGTYPE, a script error: the command is wrong, not the server).
    return isinstance(
        exc, redis_errors.ConnectionError | redis_errors.TimeoutError | redis_errors.BusyLoadingError
    )


def _kafka_transient(exc: BaseException) -> bool:
    try:
        from aiokafka import errors as kafka_errors
    except ImportError:  # pragma: no cover
        return False
    # the client's own connection and timeout errors, and every broker error Kafka's protocol
    # marks retriable (a leader moving, not enough replicas in sync, a coordinator loading …)
    if isinstance(
        exc,
        kafka_errors.KafkaConnectionError
        | kafka_errors.KafkaTimeoutError
        | kafka_errors.RequestTimedOutError
        | kafka_errors.NodeNotReadyError
        | kafka_errors.NoBrokersAvailable
        | kafka_errors.LeaderNotAvailableError
        | kafka_errors.NotLeaderForPartitionError,
    ):
        return True
    return isinstance(exc, kafka_errors.KafkaError) and bool(getattr(exc, "retriable", False))


def _clickhouse_transient(exc: BaseException) -> bool:
    if not _is_clickhouse(exc):
        return False
    try:
        from clickhouse_driver import errors as ch_errors
    except ImportError:  # pragma: no cover
        pass
    else:
        if isinstance(exc, ch_errors.NetworkError | ch_errors.SocketTimeoutError):
            return True  # the driver lost the connection or the server did not answer in time
    return _clickhouse_code(exc) in _TRANSIENT_CODES


def permanent(exc: BaseException) -> bool:
    """Whether a write failed because of what it writes (retrying cannot help) rather than where.
    Never one of our own errors: a ConfigError is a ValueError too, but it names a setting, not the data."""
    if isinstance(exc, AdstreamError):
        return False
    try:
        from aiokafka import errors as kafka_errors
    except ImportError:  # pragma: no cover
        pass
    else:
        if isinstance(
            exc,
            kafka_errors.MessageSizeTooLargeError
            | kafka_errors.RecordTooLargeError
            | kafka_errors.RecordListTooLargeError
            | kafka_errors.InvalidMessageError,
        ):
            return True
    if isinstance(exc, TypeError | ValueError | OverflowError | struct.error | UnicodeError):
        return True  # the client could not encode the values (raised before anything is sent)
    if not _is_clickhouse(exc):
        return False
    code = _clickhouse_code(exc)
    if code == 252:  # TOO_MANY_PARTS: transient ("merges are slower than inserts") unless this:
        return _SINGLE_BLOCK in str(exc)
    return code in _PERMANENT_CODES


# -- what each client raises for reasons of its own (vs a bug in the code that calls it) ----------
# For `except` clauses at a boundary that wraps a client's failure in our error tree
# (`raise StoreError(...) from exc`): a bug in our code is not wrapped, so it surfaces as itself.
def redis_errors() -> tuple[type[BaseException], ...]:
    """redis-py's error root and the socket errors under it."""
    from redis import exceptions as redis_exceptions

    return (redis_exceptions.RedisError, OSError)


def kafka_errors() -> tuple[type[BaseException], ...]:
    """aiokafka's error root (every broker and client error) and the socket errors under it."""
    from aiokafka import errors as kafka_exceptions

    return (kafka_exceptions.KafkaError, OSError)


def clickhouse_errors() -> tuple[type[BaseException], ...]:
    """clickhouse-driver's error root (server, network, type errors) and the socket errors under it
    (EOFError: the server closed the connection mid-packet)."""
    from clickhouse_driver import errors as ch_exceptions

    return (ch_exceptions.Error, OSError, EOFError)


@dataclass(frozen=True)
class Backoff:
    """Waits of `first_s`, doubling up to `max_s`, until `give_up_s` have passed since the first
    failure of an operation (`None`: retry for ever)."""

    first_s: float = 0.5
    max_s: float = 30.0
    give_up_s: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.max_s:
            raise ConfigError(
                f"Backoff needs 0 < first_s <= max_s (got first_s={self.first_s!r}, max_s={self.max_s!r})"
            )
        if self.give_up_s is not None and not self.give_up_s >= 0:
            raise ConfigError(f"Backoff.give_up_s must be >= 0 or None (got {self.give_up_s!r})")

    def delays(self, n: int | None = None) -> Iterator[float]:
        """The waits between attempts, in order (`n` of them; endless when None)."""
        delay = self.first_s
        for _ in itertools.count() if n is None else range(n):
            yield delay
            delay = min(2 * delay, self.max_s)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"  # some clients' reprs drop the message


def _gave_up(message: str, exc: BaseException) -> BaseException:
    return exc  # by default the caller sees the last error itself


async def _wait(seconds: float, abort: asyncio.Event | None) -> None:
    if abort is None:
        await asyncio.sleep(seconds)
        return
    try:  # a stop request ends the wait early; the next failure is then final
        await asyncio.wait_for(abort.wait(), timeout=seconds)
    except TimeoutError:
        pass


async def retry(
    step: Callable[[], Awaitable[T]],
    what: str,
    *,
    backoff: Backoff,
    transient: Classifier = is_transient,
    on_retry: OnRetry | None = None,
    on_give_up: Callable[[BaseException], None] | None = None,
    abort: asyncio.Event | None = None,
    wrap: Wrap = _gave_up,
) -> T:
    """Run `step` until it succeeds, retrying only errors `transient` accepts, and return its result.

    Any other error is raised at once, unchanged. After `backoff.give_up_s` (or once `abort` is
    set) the last transient error is final: `wrap(message, exc)` says what is raised (by default
    the error itself; `raise … from exc` is applied). Logs the first failure and every 20th;
    `on_retry(exc, attempt, delay)` hears of every retry (metrics). Cancellation is never caught.
    """
    t0 = time.monotonic()
    attempt = 0
    for delay in backoff.delays():
        attempt += 1
        try:
            return await step()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not transient(exc):
                raise
            waited = time.monotonic() - t0
            over = backoff.give_up_s is not None and waited + delay > backoff.give_up_s
            if over or (abort is not None and abort.is_set()):
                if on_give_up is not None:
                    on_give_up(exc)
                final = wrap(
                    f"{what} failed {attempt} time(s) over {waited:.1f} s "
                    f"(give_up_s={backoff.give_up_s}): {_describe(exc)}",
                    exc,
                )
                if final is exc:
                    raise
                raise final from exc
            if on_retry is not None:
                on_retry(exc, attempt, delay)
            if attempt == 1 or attempt % 20 == 0:
                log.warning(
                    "%s failed (attempt %d), retrying in %.2f s: %s", what, attempt, delay, _describe(exc)
                )
            await _wait(delay, abort)
    raise AssertionError("unreachable: Backoff.delays() is endless")  # pragma: no cover
