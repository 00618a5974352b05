"""`adstream attribution` end to end on the real ClickHouse: a stored run, JSON, compare, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse, urlunparse

import pytest

from attribution.migrate import migrate
from attribution.sql import DriverBackend
from schemas.clients import clickhouse_client
from schemas.settings import Settings
from workloads.attribution_market import AttributionMarketConfig, period, simulate, write_raw

pytestmark = [pytest.mark.clickhouse, pytest.mark.timeout(300)]

CFG = AttributionMarketConfig(seed=9, n_users=1200)


@pytest.fixture(scope="module")
def db(stack: Settings) -> Iterator[tuple[dict[str, str], str]]:
    url = urlparse(stack.clickhouse.url)
    name = f"{url.path.lstrip('/')}_cli{uuid.uuid4().hex[:6]}"
    s = stack.model_copy(
        update={
            "clickhouse": stack.clickhouse.model_copy(
                update={"url": urlunparse(url._replace(path=f"/{name}"))}
            )
        }
    )
    migrate(s)
    client = clickhouse_client(s, name)
    write_raw(DriverBackend(client), simulate(CFG))
    env = {
        **os.environ,
        "ADSTREAM_CLICKHOUSE__URL": s.clickhouse.url,
        "ADSTREAM_ATTRIBUTION__BOOTSTRAP": "10",
        "COLUMNS": "200",
    }
    yield env, name
    client.execute(f"DROP DATABASE IF EXISTS {name}")
    client.disconnect()


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from deploy.cli import main; main()", "attribution", *args],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def test_run_prints_json_and_stores_it(db: tuple[dict[str, str], str]) -> None:
    env, name = db
    since, until = period(CFG)
    out = cli(env, "--model", "last_click", "--model", "shapley", "--by", "slot_campaign",
              "--since", str(since), "--until", str(until), "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    run = json.loads(out.stdout)
    total = run["conversions"]
    for model in ("last_click", "shapley"):
        chans = run["results"][model]["channels"]
        assert sum(c["conversions"] for c in chans) == pytest.approx(total, rel=1e-6)
        assert all(c["ci_low"] is not None for c in chans)
        assert run["budget"][model]["total_budget"] > 0
    stored = clickhouse_client(Settings(clickhouse={"url": env["ADSTREAM_CLICKHOUSE__URL"]}), name).execute(
        "SELECT count() FROM attribution_results WHERE run_id = %(r)s", {"r": run["run_id"]}
    )[0][0]
    assert stored == 2 * len(run["results"]["shapley"]["channels"])


def test_table_and_compare(db: tuple[dict[str, str], str]) -> None:
    env, _ = db
    since, until = (str(t) for t in period(CFG))
    out = cli(env, "--model", "linear", "--by", "campaign", "--since", since, "--until", until, "--no-store")
    assert out.returncode == 0, out.stderr
    assert "cmp_search" in out.stdout and "expected uplift" in out.stdout
    out = cli(
        env, "compare", "--by", "slot", "--since", since, "--until", until, "--bootstrap", "0", "--no-store"
    )
    assert out.returncode == 0, out.stderr
    assert "last_click" in out.stdout and "shapley" in out.stdout and "feed" in out.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "nope"], "'nope'"),
        (["--by", "zone"], "'zone'"),
        (["--since", "2026-13-45"], "'2026-13-45'"),
        (["--since", "2026-11-10", "--until", "2026-11-01"], "--until"),
        (["--since", "2020-01-01", "--until", "2020-01-02"], "no conversion paths"),
        (["--channel", "cmp_nope", "--since", "2026-11-01", "--until", "2026-11-15"], "'cmp_nope'"),
        (["--bound", "cmp_brand=1", "--since", "2026-11-01", "--until", "2026-11-15"], "'cmp_brand=1'"),
    ],
)
def test_bad_input_exits_2_naming_the_value(
    db: tuple[dict[str, str], str],
    args: list[str],
    needle: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # in process (the console-script entry point itself), to keep the suite fast
    from deploy.cli import main

    env, _ = db
    monkeypatch.setenv("ADSTREAM_CLICKHOUSE__URL", env["ADSTREAM_CLICKHOUSE__URL"])
    monkeypatch.setattr(sys, "argv", ["adstream", "attribution", *args, "--no-store"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = " ".join(capsys.readouterr().err.split())  # the error panel wraps lines
    assert exit_info.value.code == 2, err
    assert needle in err and "Traceback" not in err


def test_spend_import_then_roi_shows_the_outside_channel(
    db: tuple[dict[str, str], str],
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from deploy.cli import main

    env, name = db
    monkeypatch.setenv("ADSTREAM_CLICKHOUSE__URL", env["ADSTREAM_CLICKHOUSE__URL"])
    bad = tmp_path / "bad.csv"
    bad.write_text("date,advertiser_id,source,medium,campaign,spend\n2026-11-01,adv_attr,google,cpc,,x\n")
    monkeypatch.setattr(sys, "argv", ["adstream", "spend", "import", str(bad)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "line 2: spend 'x'" in err and "Traceback" not in err
    client = clickhouse_client(Settings(clickhouse={"url": env["ADSTREAM_CLICKHOUSE__URL"]}), name)
    assert client.execute("SELECT count() FROM outside_spend")[0][0] == 0  # nothing partial
    good = tmp_path / "good.csv"
    good.write_text("date,advertiser_id,source,medium,campaign,spend\n2026-11-02,adv_attr,google,cpc,,40\n")
    monkeypatch.setattr(sys, "argv", ["adstream", "spend", "import", str(good)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code in (0, None)
    assert "1 rows imported" in " ".join(capsys.readouterr().out.split())
    since, until = period(CFG)
    out = cli(env, "--model", "linear", "--by", "campaign", "--since", str(since), "--until", str(until),
              "--no-store", "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    budget = {c["channel"]: c for c in json.loads(out.stdout)["budget"]["linear"]["channels"]}
    # no touch on it in this market: a channel is a channel of the paths (no tracked touch is no
    # evidence of no effect), so the plan leaves it alone; its spend waits for its touches
    assert client.execute("SELECT sum(spend) FROM outside_spend FINAL")[0][0] == pytest.approx(40.0)
    assert "cmp_search" in budget
    client.disconnect()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--since", "2020-01-01", "--until", "2020-01-20"], "no spend and conversions"),
        (["--since", "2026-11-01", "--until", "2026-11-05"], "at least 14 days"),
        (["--since", "2026-11-01T10:00", "--until", "2026-11-01T20:00"], "no whole UTC day"),
        (["--by", "slot", "--calibrate", "--since", "2026-11-01", "--until", "2026-11-15"], "--by campaign"),
        (["--by", "zone"], "'zone'"),
        (["--split-by", "nope", "--since", "2026-11-01", "--until", "2026-11-15"], "'nope'"),
        (["--by", "slot", "--split-by", "shapley"], "needs --by campaign, not 'slot'"),
        # this market has no holdouts: nothing measured per slot, refused before any fit
        (
            ["--split-by", "holdout", "--since", "2026-11-01", "--until", "2026-11-15"],
            "no campaign of the range has a holdout measured in each of its slots",
        ),
    ],
)
def test_mmm_bad_input_exits_2_naming_it(
    db: tuple[dict[str, str], str],
    args: list[str],
    needle: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("pymc_marketing")
    err = _mmm_refused(db, args, monkeypatch, capsys)
    assert needle in err and "Traceback" not in err


def _mmm_refused(
    db: tuple[dict[str, str], str],
    args: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> str:
    """`adstream attribution mmm --quick ARGS` in process: it must exit 2; its stderr, unwrapped."""
    from deploy.cli import main

    env, _ = db
    monkeypatch.setenv("ADSTREAM_CLICKHOUSE__URL", env["ADSTREAM_CLICKHOUSE__URL"])
    monkeypatch.setattr(sys, "argv", ["adstream", "attribution", "mmm", "--quick", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = " ".join(capsys.readouterr().err.split())  # the error panel wraps lines
    assert exit_info.value.code == 2, err
    return err


def test_mmm_lift_file_bad_rows_exit_2_naming_each_line(
    db: tuple[dict[str, str], str],
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("pymc_marketing")
    bad = tmp_path / "lifts.csv"
    first = CFG.campaigns[0].campaign_id
    bad.write_text(f"channel,x,delta_x,delta_y,sigma\ntv/linear,0,1,1,1\n{first},0,1,1,-2\n")
    window = ["--since", "2026-11-01", "--until", "2026-11-15"]
    for lift_file, needles in [
        (str(bad), ["lifts.csv: 2 bad rows", "line 2: channel 'tv/linear' is not in the data",
                    "line 3: sigma -2 is not above 0"]),
        (str(tmp_path / "missing.csv"), ["--lift-file", "missing.csv", "cannot read it"]),
    ]:  # fmt: skip
        err = _mmm_refused(db, [*window, "--lift-file", lift_file], monkeypatch, capsys)
        assert all(n in err for n in needles) and "Traceback" not in err, err


@pytest.mark.timeout(900)  # a quick fit: ~25 s of CPU, more wall time on a loaded machine
def test_mmm_quick_fit_prints_curves_moves_and_writes_meridians_files(
    db: tuple[dict[str, str], str], tmp_path: Any
) -> None:
    pytest.importorskip("pymc_marketing")
    env, _ = db
    # an experiment run outside adstream on one campaign, and one whose lift came out below 0
    first, second = (c.campaign_id for c in CFG.campaigns[:2])
    lifts = tmp_path / "lifts.csv"
    lifts.write_text(f"channel,x,delta_x,delta_y,sigma\n{first},0,5,0.2,0.1\n{second},0,3,-0.1,0.2\n")
    args = [
        "mmm",
        "--quick",
        "--json",
        "--since",
        "2026-11-01",
        "--until",
        "2026-11-15",
        "--meridian",
        str(tmp_path),
        "--lift-file",
        str(lifts),
        "--split-by",
        "shapley",
    ]
    out = subprocess.run(
        [sys.executable, "-c", "from deploy.cli import main; main()", "attribution", *args],
        env=env, capture_output=True, text=True, timeout=800,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["days"] == 14 and body["fit"]["method"] == "advi"
    assert body["fit"]["lift_tests"] == [first, second]
    assert len(body["lift_file_notes"]) == 1 and body["lift_file_notes"][0].startswith(f"line 3: {second}")
    assert "counted as 0" in out.stderr
    # every own campaign, and the outside channels whose spend the module's other tests imported
    # into this database (`adstream spend import`: source/medium names): the MMM models both
    own = {c.campaign_id for c in CFG.campaigns}
    assert set(body["shares"]) == set(body["channels"]) and own <= set(body["channels"])
    assert all("/" in c for c in set(body["channels"]) - own), body["channels"]
    assert sum(body["shares"].values()) == pytest.approx(1.0, abs=1e-3)
    budget = body["budget"]
    # --split-by: the moves per slot of each campaign (its curve split by Shapley's credit per
    # slot), the outside channels whole
    assert body["split_by"] == "shapley"
    moved_units = {c["channel"].partition(":")[0] for c in budget["channels"]}
    assert moved_units == set(body["channels"])
    assert all(":" in c["channel"] for c in budget["channels"] if c["channel"].partition(":")[0] in own)
    # within ±50 % of each part's spend (both rounded to 4 decimals)
    over = [c for c in budget["channels"] if c["recommended_daily_spend"] > 1.5 * c["daily_spend"] + 2e-4]
    assert over == []
    for unit in own:
        fitted = body["curves"][unit]["spend"][5]  # the curve's 1 × mean daily spend point
        parts = sum(c["daily_spend"] for c in budget["channels"] if c["channel"].startswith(f"{unit}:"))
        assert parts == pytest.approx(fitted, rel=1e-3)
    moved = sum(c["recommended_daily_spend"] for c in budget["channels"])
    assert moved == pytest.approx(sum(c["daily_spend"] for c in budget["channels"]), rel=1e-4)
    gain = budget["gain_conversions_per_day"]
    assert gain["low"] <= gain["mean"] <= gain["high"]
    assert (tmp_path / "meridian_data.csv").read_text().count("\n") == 15
    assert body["meridian"]["coord_to_columns"]["kpi"] == "conversions"
