"""The config files `adstream up` writes for the services it starts (written, never started here)."""

from __future__ import annotations

import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from deploy.endpoints import Endpoint
from deploy.services import launch_clickhouse

# `launch_clickhouse` looks for the binary (it writes the config, starts nothing)
HAS_CLICKHOUSE = shutil.which("clickhouse-server") is not None or any(
    (Path(d) / "clickhouse-server").exists() for d in ("/usr/sbin", "/usr/bin", "/usr/local/bin")
)


@pytest.mark.skipif(not HAS_CLICKHOUSE, reason="clickhouse-server not installed")
def test_clickhouse_config_is_xml_whatever_the_state_dir_is_called(tmp_path: Path) -> None:
    """Reliability L9: the config template was filled with `str.format`, so a state dir named
    with `&` or `<` gave a file ClickHouse cannot parse (or markup of the path's choosing)."""
    state = tmp_path / "ads & <more>" / "state"
    launch = launch_clickhouse(Endpoint("127.0.0.1", 19000), 18123, state)
    config = Path(launch.argv[-1].removeprefix("--config-file="))
    root = ET.parse(config).getroot()
    data = (state / "clickhouse" / "data").resolve()
    assert root.findtext("path") == f"{data}/"
    assert root.findtext("tmp_path") == f"{data}/tmp/"
    assert root.findtext("users_config") == str((state / "clickhouse" / "users.xml").resolve())
    assert root.findtext("logger/log") == f"{(state / 'logs').resolve()}/clickhouse-server.log"
    assert root.findtext("tcp_port") == "19000" and root.findtext("http_port") == "18123"
