"""QoS classes of `/v1/ads`: Guaranteed, Burstable, BestEffort (pure; no Ray, no I/O).

A request names its class (`AdRequest.qos`) or gets its slot's default (`qos.slot_class`,
else `qos.default_class`). In front of the pipeline sits one `Admission` gate per replica:
`slots` requests run at once; the others wait in one FIFO queue per class, and a freed slot goes
to the highest class that is waiting. A request is shed (503 + `Retry-After`) when

- its class's queue is full (`qos.queue_limit`), or
- it waited longer than its class's queue timeout (`qos.queue_timeout_ms`) for a slot, or
- a request of a higher class arrived while every queue position of the replica was taken
  (`Admission.capacity`): the newest waiting request of the lowest class below it gives way.

So under overload BestEffort is shed first, then Burstable, and Guaranteed waits only behind the
requests already running plus the Guaranteed ones ahead of it: its latency stays near its cost.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias, get_args

from schemas.api import QosClass
from schemas.settings import QosSettings, Settings

CLASSES: Final[tuple[QosClass, ...]] = get_args(QosClass)  # top first
Outcome: TypeAlias = Literal["run", "queue_full", "timeout", "evicted"]


@dataclass(frozen=True)
class ClassPolicy:
    """What one class is allowed: its default deadline, waiting requests, wait, Retry-After."""

    deadline_ms: float
    queue_limit: int
    queue_timeout_ms: float
    retry_after_s: int


def policies(settings: Settings) -> dict[QosClass, ClassPolicy]:
    """Each class's policy from the `serve_qos_*` settings; a class a setting leaves out gets that
    setting's default (the deadline: `deadline_ms`).

    >>> policies(Settings())["besteffort"]
    ClassPolicy(deadline_ms=50.0, queue_limit=8, queue_timeout_ms=10.0, retry_after_s=2)
    """
    fields = QosSettings.model_fields

    def value(name: str, cls: QosClass) -> Any:
        given: dict[str, Any] = getattr(settings.qos, name)
        if cls in given:
            return given[cls]
        factory = fields[name].default_factory
        return factory()[cls] if factory is not None else None  # type: ignore[call-arg]

    return {
        c: ClassPolicy(
            deadline_ms=float(settings.qos.deadline_ms.get(c, settings.serving.deadline_ms)),
            queue_limit=int(value("queue_limit", c)),
            queue_timeout_ms=float(value("queue_timeout_ms", c)),
            retry_after_s=int(value("retry_after_s", c)),
        )
        for c in CLASSES
    }


def class_of(
    requested: QosClass | None, slot: str, slot_class: Mapping[str, str], default: QosClass
) -> QosClass:
    """The class a request runs in: the one it names, else its slot's, else the default.

    >>> class_of(None, "search", {"search": "guaranteed"}, "burstable")
    'guaranteed'
    >>> class_of("besteffort", "search", {"search": "guaranteed"}, "burstable")
    'besteffort'
    >>> class_of(None, "feed", {}, "burstable")
    'burstable'
    """
    if requested is not None:
        return requested
    for c in CLASSES:
        if slot_class.get(slot) == c:
            return c
    return default


class _Waiter:
    __slots__ = ("cls", "future")

    def __init__(self, cls: QosClass, future: asyncio.Future[Outcome]) -> None:
        self.cls = cls
        self.future = future


class Admission:
    """The priority gate of a replica (one event loop: no locks needed).

    `enter(cls)` answers at once when it can (`"run"`, or `"queue_full"` / an eviction when there
    is no room); otherwise the caller awaits `wait(...)`. Every `"run"` must be paired with one
    `release()`.

    >>> async def demo() -> tuple[object, ...]:
    ...     gate = Admission(1, {c: ClassPolicy(50, 1, 10, 1) for c in CLASSES})
    ...     first = gate.try_enter("burstable")  # takes the one slot
    ...     waiter = gate.try_enter("besteffort")  # waits: its queue holds one
    ...     full = gate.try_enter("besteffort")  # a second BestEffort finds that queue full
    ...     gate.release()  # the slot passes to the waiting BestEffort
    ...     return first, full, await gate.wait(waiter), gate.running
    >>> asyncio.run(demo())
    ('run', 'queue_full', 'run', 1)
    """

    def __init__(
        self, slots: int, policies: Mapping[QosClass, ClassPolicy], capacity: int | None = None
    ) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self.slots = slots
        self.policies = dict(policies)
        # queue positions of the whole replica; a higher class may take a lower one's position
        self.capacity = capacity if capacity is not None else sum(p.queue_limit for p in policies.values())
        self.running = 0
        self._queues: dict[QosClass, deque[_Waiter]] = {c: deque() for c in CLASSES}
        self.shed: dict[QosClass, dict[str, int]] = {
            c: {"queue_full": 0, "timeout": 0, "evicted": 0} for c in CLASSES
        }
        self.admitted: dict[QosClass, int] = dict.fromkeys(CLASSES, 0)

    def waiting(self, cls: QosClass | None = None) -> int:
        """Requests waiting (of one class, or of all)."""
        if cls is not None:
            return len(self._queues[cls])
        return sum(len(q) for q in self._queues.values())

    def _higher_waiting(self, cls: QosClass) -> bool:
        """Whether a request of `cls` or a higher class is waiting (a newcomer queues behind it)."""
        for c in CLASSES:
            if self._queues[c]:
                return True
            if c == cls:
                return False
        return False

    def try_enter(self, cls: QosClass) -> Outcome | _Waiter:
        """Run now (`"run"`), refuse now (`"queue_full"`), or a waiter to `wait` on."""
        if self.running < self.slots and not self._higher_waiting(cls):
            self.running += 1
            self.admitted[cls] += 1
            return "run"
        if len(self._queues[cls]) >= self.policies[cls].queue_limit:
            self.shed[cls]["queue_full"] += 1
            return "queue_full"
        if self.waiting() >= self.capacity and not self._evict_below(cls):
            self.shed[cls]["queue_full"] += 1
            return "queue_full"
        waiter = _Waiter(cls, asyncio.get_running_loop().create_future())
        self._queues[cls].append(waiter)
        return waiter

    def _evict_below(self, cls: QosClass) -> bool:
        """Shed the newest waiting request of the lowest class below `cls`; False if there is none."""
        for c in reversed(CLASSES):
            if c == cls:
                return False
            if self._queues[c]:
                victim = self._queues[c].pop()
                self.shed[c]["evicted"] += 1
                if not victim.future.done():
                    victim.future.set_result("evicted")
                return True
        return False

    async def wait(self, waiter: _Waiter) -> Outcome:
        """Wait for a slot (at most the class's queue timeout); `"run"` means it holds one."""
        timeout = self.policies[waiter.cls].queue_timeout_ms / 1000
        try:
            outcome = await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except TimeoutError:
            if waiter.future.done():  # handed a slot just as the wait ran out: take it
                outcome = waiter.future.result()
            else:
                self._drop(waiter)
                self.shed[waiter.cls]["timeout"] += 1
                return "timeout"
        except asyncio.CancelledError:  # the client left while waiting
            if waiter.future.done() and waiter.future.result() == "run":
                self.release()
            else:
                self._drop(waiter)
            raise
        return outcome

    async def enter(self, cls: QosClass) -> Outcome:
        """`try_enter` and, when it has to, `wait`: the whole admission of one request."""
        first = self.try_enter(cls)
        if isinstance(first, str):
            return first
        return await self.wait(first)

    def _drop(self, waiter: _Waiter) -> None:
        try:
            self._queues[waiter.cls].remove(waiter)
        except ValueError:
            pass
        waiter.future.cancel()

    def release(self) -> None:
        """A running request finished: its slot goes to the oldest waiter of the highest class."""
        for c in CLASSES:
            q = self._queues[c]
            while q:
                waiter = q.popleft()
                if not waiter.future.done():
                    waiter.future.set_result("run")
                    self.admitted[c] += 1
                    return  # the slot passes on: `running` stays
        self.running -= 1

    def retry_after(self, cls: QosClass) -> str:
        """The `Retry-After` header value (seconds) for a shed request of `cls`."""
        return str(self.policies[cls].retry_after_s)
