"""QoS classes: the admission gate's decisions (who runs, who waits, who is shed) and the 503 +
Retry-After a shed request gets, checked by filling slots and queues by hand (no timing)."""

from __future__ import annotations

import asyncio
import json

import pytest

from schemas.api import AdRequest
from schemas.settings import Settings
from serving.qos import CLASSES, Admission, ClassPolicy, class_of, policies


def gate(
    slots: int = 1, limit: int = 2, timeout_ms: float = 10_000.0, capacity: int | None = None
) -> Admission:
    retry = {"guaranteed": 1, "burstable": 1, "besteffort": 2}
    return Admission(
        slots, {c: ClassPolicy(50.0, limit, timeout_ms, retry[c]) for c in CLASSES}, capacity=capacity
    )


def test_a_request_names_its_class_or_gets_its_slots_default() -> None:
    s = Settings()
    assert (
        AdRequest.model_validate_json('{"user_id": "u", "slot": "feed", "qos": "guaranteed"}').qos
        == "guaranteed"
    )
    assert AdRequest.model_validate_json('{"user_id": "u", "slot": "feed"}').qos is None
    with pytest.raises(ValueError):
        AdRequest.model_validate_json('{"user_id": "u", "slot": "feed", "qos": "gold"}')
    pick = [
        class_of(None, slot, s.qos.slot_class, s.qos.default_class) for slot in ("search", "feed", "splash")
    ]
    assert pick == ["guaranteed", "burstable", "besteffort"]
    assert class_of("besteffort", "search", s.qos.slot_class, "burstable") == "besteffort"
    assert class_of(None, "other", {}, "burstable") == "burstable"


def test_policies_fill_classes_a_setting_leaves_out_from_its_defaults() -> None:
    s = Settings(
        qos={"queue_limit": {"besteffort": 1}, "deadline_ms": {"guaranteed": 80}}, serving={"deadline_ms": 40}
    )
    p = policies(s)
    assert (
        p["besteffort"].queue_limit == 1
        and p["guaranteed"].queue_limit == Settings().qos.queue_limit["guaranteed"]
    )
    assert p["guaranteed"].deadline_ms == 80 and p["burstable"].deadline_ms == 40


def test_free_slots_run_at_once_and_a_full_queue_sheds() -> None:
    async def scenario() -> None:
        g = gate(slots=2, limit=1)
        assert g.try_enter("besteffort") == "run" and g.try_enter("besteffort") == "run"
        waiter = g.try_enter("besteffort")
        assert not isinstance(waiter, str) and g.waiting("besteffort") == 1
        assert g.try_enter("besteffort") == "queue_full"  # its class's queue holds one
        assert g.try_enter("guaranteed") != "queue_full"  # another class has its own queue
        assert g.shed["besteffort"]["queue_full"] == 1 and g.shed["guaranteed"]["queue_full"] == 0

    asyncio.run(scenario())


def test_a_freed_slot_goes_to_the_highest_class_waiting() -> None:
    async def scenario() -> list[str]:
        g = gate(slots=1, limit=4)
        assert g.try_enter("burstable") == "run"
        order: list[str] = []

        async def one(cls: str, tag: str) -> None:
            if await g.enter(cls) == "run":  # type: ignore[arg-type]
                order.append(tag)
                g.release()

        arrivals = [("besteffort", "be1"), ("burstable", "b1"), ("guaranteed", "g1")]
        arrivals += [("besteffort", "be2"), ("guaranteed", "g2")]
        tasks = [asyncio.create_task(one(c, t)) for c, t in arrivals]
        await asyncio.sleep(0)  # every one is queued now
        assert g.waiting() == 5
        g.release()  # the running Burstable finishes
        await asyncio.gather(*tasks)
        assert g.running == 0
        return order

    assert asyncio.run(scenario()) == ["g1", "g2", "b1", "be1", "be2"]


def test_a_higher_class_takes_the_queue_position_of_the_lowest_waiting() -> None:
    async def scenario() -> tuple[str, str]:
        g = gate(slots=1, limit=4, capacity=2)  # two queue positions for the whole replica
        assert g.try_enter("burstable") == "run"
        be = asyncio.create_task(g.enter("besteffort"))
        b = asyncio.create_task(g.enter("burstable"))
        await asyncio.sleep(0)
        assert g.waiting() == 2
        guaranteed = asyncio.create_task(g.enter("guaranteed"))  # no position left: BestEffort gives way
        await asyncio.sleep(0)
        evicted = await be
        assert g.try_enter("besteffort") == "queue_full"  # a lower class cannot push out a higher one
        g.release()
        first = await guaranteed
        g.release()
        assert await b == "run"
        g.release()
        return evicted, first

    assert asyncio.run(scenario()) == ("evicted", "run")


def test_a_request_that_waits_past_its_class_timeout_is_shed() -> None:
    async def scenario() -> str:
        g = gate(slots=1, limit=4, timeout_ms=1.0)
        assert g.try_enter("guaranteed") == "run"  # the slot stays taken: the waiter must give up
        outcome = await g.enter("besteffort")
        assert g.waiting() == 0 and g.shed["besteffort"]["timeout"] == 1
        return outcome

    assert asyncio.run(scenario()) == "timeout"


def test_a_client_that_leaves_while_waiting_frees_its_place() -> None:
    async def scenario() -> None:
        g = gate(slots=1, limit=4)
        assert g.try_enter("guaranteed") == "run"
        task = asyncio.create_task(g.enter("burstable"))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert g.waiting() == 0
        g.release()
        assert g.running == 0

    asyncio.run(scenario())


def test_a_shed_request_gets_503_with_its_classes_retry_after() -> None:
    """The answer the ad server sends (`serving.http.overloaded`) for what a filled gate refuses."""
    from serving.http import overloaded

    async def scenario() -> list[tuple[int, str | None, str]]:
        g = gate(slots=1, limit=0)
        assert g.try_enter("guaranteed") == "run"
        out = []
        for cls in ("besteffort", "burstable"):
            outcome = g.try_enter(cls)
            assert outcome == "queue_full"
            resp = overloaded(cls, outcome, g.retry_after(cls))
            out.append((resp.status_code, resp.headers.get("retry-after"), json.loads(resp.body)["detail"]))
        return out

    (be_status, be_retry, be_why), (b_status, b_retry, _) = asyncio.run(scenario())
    assert (be_status, be_retry) == (503, "2") and (b_status, b_retry) == (503, "1")
    assert "besteffort" in be_why and "queue full" in be_why
