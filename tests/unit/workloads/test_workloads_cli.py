"""`adstream simulate` and `adstream replay obd` to files."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from deploy.cli import app
from schemas.codec import decode_any

runner = CliRunner()


def test_simulate_writes_identical_files_for_the_same_seed(tmp_path: Path) -> None:
    args = [
        "simulate",
        "--users",
        "100",
        "--ads",
        "30",
        "--events",
        "3000",
        "--seed",
        "5",
        "--drift-at",
        "0.5",
    ]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    r1 = runner.invoke(app, [*args, "--out", str(a)])
    r2 = runner.invoke(app, [*args, "--out", str(b)])
    assert r1.exit_code == 0, r1.output
    assert r2.exit_code == 0, r2.output
    assert a.read_bytes() == b.read_bytes()
    lines = a.read_bytes().splitlines()
    kinds = [decode_any(line).kind for line in lines]  # type: ignore[attr-defined]
    assert kinds.count("impression") == 3000
    assert "oracle AUC" in r1.output and "true credit search" in r1.output


def test_simulate_needs_exactly_one_destination(tmp_path: Path) -> None:
    r = runner.invoke(app, ["simulate", "--events", "10"])
    assert r.exit_code != 0
    assert "--out" in r.output
    r = runner.invoke(app, ["simulate", "--events", "10", "--drift-share", "2", "--out", str(tmp_path / "x")])
    assert r.exit_code != 0
    assert "drift_share" in r.output


def test_replay_obd_to_file_keeps_every_click(tmp_path: Path) -> None:
    out = tmp_path / "obd.jsonl"
    r = runner.invoke(app, ["replay", "obd", "--policy", "bts", "--campaign", "men", "--speedup", "60",
                            "--out", str(out)])  # fmt: skip
    assert r.exit_code == 0, r.output
    kinds = [decode_any(line).kind for line in out.read_bytes().splitlines()]  # type: ignore[attr-defined]
    assert kinds.count("click") == 69
    assert kinds.count("impression") == 10_000
    assert "69 / 69" in r.output


def test_simulate_is_byte_identical_across_processes(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    digests = []
    for hash_seed in ("1", "2"):
        out = tmp_path / f"p{hash_seed}.jsonl"
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        code = (
            "from pathlib import Path; from workloads import Market, MarketConfig; "
            "from workloads.sinks import write_jsonl; "
            "m = Market(MarketConfig(seed=9, n_users=300, n_ads=50)); "
            f"write_jsonl(m.open_loop(3000), Path({str(out)!r}))"
        )
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
        digests.append(out.read_bytes())
    assert digests[0] == digests[1] and len(digests[0]) > 0


def test_simulate_with_cpm_campaigns_writes_how_each_campaign_pays(tmp_path: Path) -> None:
    """`--cpm-share` (as `adstream demo --cpm-share`): the stream starts with the market's Campaign
    entries (on `ad.campaigns` with --kafka; a catalog file holds them too), so whoever serves its
    catalog bills CPM creatives' per-mille bids per thousand shown; the impressions say how each
    pays. Without it, the stream is byte for byte the market's of before."""
    from serving.loops import read_catalog_entries
    from workloads import Market, MarketConfig

    base = ["simulate", "--users", "100", "--ads", "30", "--events", "600", "--seed", "5"]
    plain, cpm = tmp_path / "plain.jsonl", tmp_path / "cpm.jsonl"
    assert runner.invoke(app, [*base, "--out", str(plain)]).exit_code == 0
    r = runner.invoke(app, [*base, "--cpm-share", "0.5", "--out", str(cpm)])
    assert r.exit_code == 0, r.output
    events = [decode_any(line) for line in cpm.read_bytes().splitlines()]
    campaigns = [e for e in events if e.kind == "campaign"]  # type: ignore[attr-defined]
    market = Market(MarketConfig(seed=5, n_users=100, n_ads=30, cpm_share=0.5))
    assert campaigns == market.campaigns(include_new=True)
    assert events[: len(campaigns)] == campaigns  # before any ad or event that needs them
    paying = {c.campaign_id: c.bid_type for c in campaigns}  # type: ignore[attr-defined]
    assert set(paying.values()) == {"cpm", "cpc"}
    imps = [e for e in events if e.kind == "impression"]  # type: ignore[attr-defined]
    assert len(imps) == 600 and all(i.bid_type == paying[i.campaign_id] for i in imps)  # type: ignore[attr-defined]
    ads, entries = read_catalog_entries(cpm)
    assert entries == campaigns and ads
    assert "campaign" in r.output
    plain_events = [decode_any(line) for line in plain.read_bytes().splitlines()]
    assert all(e.kind != "campaign" for e in plain_events)  # type: ignore[attr-defined]
    assert all(e.bid_type is None for e in plain_events if e.kind == "impression")  # type: ignore[attr-defined]
    r = runner.invoke(app, [*base, "--cpm-share", "1.5", "--out", str(tmp_path / "x")])
    assert r.exit_code != 0 and "cpm_share" in r.output
