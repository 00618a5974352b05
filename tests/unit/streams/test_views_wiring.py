"""Render beacons reach every part of the worker that lists its tables or topics: a `views` row
the event store refuses for good is dead-lettered under its contract topic, and `adstream probe`
counts the lag of every topic the worker consumes."""

from __future__ import annotations

from deploy.cli_ops import Role, default_group
from schemas import topics
from schemas.settings import Settings
from streams.delivery import TABLE_TOPIC
from streams.pipeline import INPUTS
from streams.sink import TABLES


def test_every_sink_table_names_the_topic_its_rows_came_from() -> None:
    assert set(TABLE_TOPIC) == set(TABLES)
    assert TABLE_TOPIC["views"] == topics.VIEWS


def test_the_probe_watches_every_topic_the_worker_consumes() -> None:
    _, watched = default_group(Role.streams, Settings())
    assert set(watched) == set(INPUTS) and topics.VIEWS in watched
