"""deploy.cluster's pure parts: the shard config, the cluster section, the Ray node command lines."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from deploy.cluster import HEAD_PORTS, WORKER_PORTS, Shard, ray_node_argv, remote_servers_xml, shard_config
from schemas.errors import StackError

SHARDS = (Shard(18810, 18820, 18840, Path("/tmp/a&b/s0")), Shard(18811, 18821, 18841, Path("/tmp/s1")))


def test_shard_config_is_xml_with_its_ports_dirs_and_both_shards() -> None:
    xml = shard_config(SHARDS[0], Path("/tmp/a&b/s0/users.xml"), remote_servers_xml("c1", SHARDS))
    root = ET.fromstring(xml)
    assert root.findtext("tcp_port") == "18810" and root.findtext("http_port") == "18820"
    assert root.findtext("path") == "/tmp/a&b/s0/data/"  # escaped in the file, the path when parsed
    ports = [p.text for p in root.findall("remote_servers/c1/shard/replica/port")]
    assert ports == ["18810", "18811"]


def test_a_cluster_name_that_is_not_an_identifier_is_refused() -> None:
    with pytest.raises(StackError, match="cluster name"):
        remote_servers_xml("c1><x", SHARDS)


def test_two_nodes_share_no_port() -> None:
    head = set(HEAD_PORTS.args())
    assert not {a.split("=")[1] for a in head} & {a.split("=")[1] for a in WORKER_PORTS.args()}
    assert not set(range(HEAD_PORTS.min_worker, HEAD_PORTS.max_worker + 1)) & set(
        range(WORKER_PORTS.min_worker, WORKER_PORTS.max_worker + 1)
    )


def test_ray_node_argv_head_or_join() -> None:
    head = ray_node_argv("ray", HEAD_PORTS, Path("/tmp/r"), head_port=18830)
    assert "--head" in head and "--port=18830" in head and "--block" in head
    join = ray_node_argv("ray", WORKER_PORTS, Path("/tmp/r"), address="127.0.0.1:18830")
    assert "--head" not in join and "--address=127.0.0.1:18830" in join
    with pytest.raises(StackError, match="exactly one"):
        ray_node_argv("ray", HEAD_PORTS, Path("/tmp/r"))
