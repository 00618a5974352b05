"""The `redis_client` fixture cleans up what its own test wrote, not the whole session's prefix.

A session-scoped server (a Serve replica, a trainer) keeps its snapshots and pins under the
session's Redis prefix; a test that merely used `redis_client` used to delete them all on
teardown, so `test_replica_starts_from_redis_snapshots_and_resyncs_on_a_gap` failed in one
order of the suite. The three tests below run in file order.
"""

from __future__ import annotations

import redis

from schemas.settings import Settings

KEEP = "fixture-scope:session-owned"
TEMP = "fixture-scope:test-owned"


def test_a_session_owner_writes_a_key(stack: Settings) -> None:
    client = redis.Redis.from_url(stack.redis.url)
    client.set(stack.redis_prefix + KEEP, b"1", ex=600)
    client.close()


def test_a_test_writes_through_the_fixture(stack: Settings, redis_client: redis.Redis) -> None:
    redis_client.set(stack.redis_prefix + TEMP, b"1")
    assert redis_client.exists(stack.redis_prefix + KEEP)


def test_only_the_tests_own_keys_were_deleted(stack: Settings) -> None:
    client = redis.Redis.from_url(stack.redis.url)
    try:
        assert not client.exists(stack.redis_prefix + TEMP)  # the fixture's test cleaned up after itself
        assert client.exists(stack.redis_prefix + KEEP)  # the session owner's key survived
    finally:
        client.delete(stack.redis_prefix + KEEP)
        client.close()
