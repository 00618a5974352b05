"""benchmarks/rank.py's issue-33 parts: folded slot adapters, precision variants, their figures."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.support.benchmarks import load_benchmark
from trainers.models.ranker import Ranker, RankerConfig


def _rank() -> ModuleType:
    return load_benchmark("rank")


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--variants", "int8_dynamic"], "'int8_dynamic' must include fp32"),
        (["--variants", "fp32,fp8"], "'fp32,fp8' must include fp32 and name only"),
        (["--quality-config", "bogus"], "unknown config 'bogus'"),
    ],
)
def test_bad_arguments_exit_2_naming_the_value(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        _rank().parse_args(argv)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_a_variant_that_cannot_run_is_recorded_not_raised() -> None:
    torch.manual_seed(0)
    ranker = Ranker(RankerConfig(state_dim=4, ad_buckets=16, campaign_buckets=8, advertiser_buckets=8)).eval()
    bad = (torch.zeros(5, 3), torch.zeros(5, 7, dtype=torch.int64))  # 3 dense columns, not 4 + 5
    scorers, errors = _rank().precision_variants(ranker, ("fp32", "bf16"), 4, bad)
    assert scorers == {}
    assert set(errors) == {"fp32", "bf16"} and all(e.startswith("RuntimeError") for e in errors.values())
    good = (torch.zeros(5, ranker.config.dense_dim), torch.zeros(5, 7, dtype=torch.int64))
    scorers, errors = _rank().precision_variants(ranker, ("fp32", "int8_dynamic", "bf16"), 4, good)
    assert errors == {} and {n: s(*good).shape for n, s in scorers.items()} == dict.fromkeys(scorers, (5,))


def test_same_round_ratio_has_its_interval() -> None:
    r = _rank().ratio_summary([1.0, 2.0, 2.2, 2.0, 1.8], [1.0, 1.0, 1.0, 1.0, 1.0])
    assert r["median"] == 2.0 and r["rounds"] == 5
    assert r["ci95"][0] <= 2.0 <= r["ci95"][1]


def test_small_run_writes_folded_and_precision_figures(tmp_path: Path) -> None:
    """The whole benchmark at toy sizes (its folded scores are checked against the reference
    inside: it exits otherwise); torch.compile left out here (slow to compile)."""
    out = tmp_path / "rank.json"
    argv = "--requests 2 --candidates 30 --adapters 6 --large 0 --seconds 0.005 --runs 1"
    argv += " --variants fp32,int8_dynamic,bf16 --quality-config u30x100"
    _rank().main([*argv.split(), "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["max_abs_diff_vs_reference"]["slot_folded"] < 1e-5
    assert got["max_abs_diff_vs_reference"]["slot_folded_stacked"] < 1e-5  # default targets: additive
    assert got["folded_adapters_cost_ratio"] > 0 and len(got["folded_adapters_cost_ratio_ci95"]) == 2
    named = {"folded_adapters", "fold_lora_copies", "adapters_uniform_mixed"}
    named |= {"traced_batch", "traced_one_request", "traced_positions"}  # traced ranker ÷ eager
    assert set(got["adapter_cost_ratios"]) >= named
    assert got["mixed_adapters_cost_ratio"] > 0 and got["fold_lora_copies_cost_ratio"] > 0
    variants = got["precision"]["variants"]
    assert list(variants) == ["fp32", "int8_dynamic", "bf16"]
    assert variants["fp32"]["kept"] is True and variants["fp32"]["auc_served_minus_fp32"] == 0
    for v in variants.values():
        assert isinstance(v["kept"], bool)
        assert v["kept"] == (abs(v["auc_served_minus_fp32"]) <= got["precision"]["auc_tolerance"])
        assert 0 < v["auc_served"] <= 1 and v["candidates_per_s"] > 0
    assert got["precision"]["holdout"]["holdout_rows"] == 600


def test_the_folded_headline_times_what_serving_runs() -> None:
    """`folded_adapters_cost_ratio` is the rank model's own path with slot adapters (the bank
    folds them at write, `serving.ranking.FoldedSlots`, sharing every layer it does not adapt),
    not whole-model copies made by `fold_lora` (three copies of the id tables: a cache cost no
    replica pays; issue 33's review)."""
    rank = _rank()
    assert rank.RATIO_PAIRS["folded_adapters"] == ("slot_adapters", "base")
    b = rank.build(rank.parse_args("--requests 2 --candidates 30 --adapters 6 --large 0".split()))
    m = b.model
    with m.bank.reading() as buf:
        served = [m.folded.model_for(i.rows, buf) for i in b.batches["slot"]]
    assert all(isinstance(s, Ranker) for s in served) and len({id(s) for s in served}) > 1
    # the folds share the trunk's tables with the plain model; only adapted layers are their own
    plain = m.folded.plain
    for s in served:
        assert s is not None and s.emb is plain.emb and s.deep is plain.deep  # type: ignore[attr-defined]
        assert s.head.weight.data_ptr() != plain.head.weight.data_ptr()  # type: ignore[attr-defined]


def test_interleaved_rounds_run_the_cases_in_changing_orders() -> None:
    """No case is always first (or always after the same one): in a fixed order the first case
    of each round ran cache-cold and the ratios to it read low (the base is the denominator)."""
    calls: list[str] = []
    cases = {name: (lambda n=name: calls.append(n)) for name in ("base", "slot", "mixed", "large")}
    wall, cpu = _rank().interleaved(cases, seconds=0.0)
    rounds = [calls[i : i + 4] for i in range(12, len(calls), 4)]  # after 3 warm-up calls each
    assert len(rounds) >= 10 and all(sorted(r) == sorted(cases) for r in rounds)
    assert len({r[0] for r in rounds}) > 1
    assert all(len(v) == len(rounds) for v in (*wall.values(), *cpu.values()))
