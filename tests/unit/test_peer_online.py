"""benchmarks/peer_online.py's core on a tiny simulator stream: every learner (adstream, Vowpal
Wabbit, River) is scored on the same examples, in stream order, before it learns each one."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from schemas.settings import Settings
from tests.support.benchmarks import load_benchmark
from trainers.quality import auc

pytest.importorskip("vowpalwabbit")
pytest.importorskip("river")


def _peer_online() -> ModuleType:
    return load_benchmark("peer_online")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread, as the benchmark runs (OpenMP threads stall on a busy CPU)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny() -> dict[str, Any]:
    po = _peer_online()
    args = po.parse_args(["--impressions", "2400", "--pretrain", "800", "--trend-users", "150"])
    s = po.simulator_stream(args, Settings(), "handover", 3)
    assert s["drift"] is not None and 0 < s["drift"] < len(s["stream"])
    return s


def _flip(stream: list[Any], i: int) -> list[Any]:
    out = list(stream)
    out[i] = out[i].model_copy(update={"click": not out[i].click})
    return out


def test_every_learner_is_scored_on_the_same_examples(tiny: dict[str, Any]) -> None:
    po = _peer_online()
    stream = tiny["stream"]
    run = po.run_stream(
        "tiny",
        tiny["warm"],
        stream,
        Settings(),
        po.PeerSpec(),
        seed=3,
        drift=tiny["drift"],
        oracle=tiny["oracle"],
    )
    assert run.impression_ids == [e.impression_id for e in stream]
    assert run.labels.tolist() == [float(e.click) for e in stream]
    # adstream is what a replica serves at the defaults (LoRA + the per-user correction); the
    # LoRA's own scores sit beside it
    assert set(run.scores) == {"adstream", "adstream_lora", "vw", "river", "frozen", "oracle"}
    assert not np.allclose(run.scores["adstream"], run.scores["adstream_lora"])
    off = po.run_stream(
        "tiny", tiny["warm"], stream, Settings(state={"feedback_lr": 0.0}), po.PeerSpec(), seed=3,
        drift=tiny["drift"], oracle=tiny["oracle"],
    )  # fmt: skip
    assert "adstream_lora" not in off.scores
    np.testing.assert_allclose(off.scores["adstream"], run.scores["adstream_lora"])
    for name, s in run.scores.items():
        assert s.shape == run.labels.shape, name
        assert np.isfinite(s).all() and ((s >= 0) & (s <= 1)).all(), name
    fig = po.stream_figures(run, window=400, horizon=800, bootstrap=5)
    for name, s in run.scores.items():
        assert fig["auc"][name]["overall"] == pytest.approx(auc(s, run.labels), abs=1e-5), name
        assert {"pre", "dip", "after"} <= set(fig["auc"][name]), name
    lo, hi = run.drift + 800 - 400, run.drift + 800  # the after-drift window of online_drift
    assert fig["auc"]["vw"]["after"] == pytest.approx(
        auc(run.scores["vw"][lo:hi], run.labels[lo:hi]), abs=1e-5
    )
    assert fig["goal_met"] == (
        fig["auc"]["adstream"]["overall"] >= max(fig["auc"]["vw"]["overall"], fig["auc"]["river"]["overall"])
    )
    for learner in ("adstream", "vw", "river"):
        assert fig["timing"][learner]["learned"] >= len(stream)


def test_scores_come_before_learning_each_label(tiny: dict[str, Any]) -> None:
    """Flipping the last label changes no score (each is made before its example is learned);
    flipping the first changes later ones (the learners do learn online)."""
    po = _peer_online()
    warm, stream, spec, settings = tiny["warm"], tiny["stream"], po.PeerSpec(), Settings()
    runners = {
        "vw": lambda st: po.run_vw(warm, st, spec)["scores"],
        "river": lambda st: po.run_river(warm, st, spec)["scores"],
        "adstream": lambda st: po.run_adstream(warm, st, settings, seed=3)["scores"],
    }
    for name, run in runners.items():
        ref = np.asarray(run(stream))
        np.testing.assert_allclose(np.asarray(run(_flip(stream, len(stream) - 1))), ref, err_msg=name)
        assert not np.allclose(np.asarray(run(_flip(stream, 0)))[1:], ref[1:]), name


def test_encoding_is_the_same_for_both_peers(tiny: dict[str, Any]) -> None:
    po = _peer_online()
    ex = next(e for e in tiny["stream"] if any(v != 0 for v in e.user_vector))
    ex = ex.model_copy(update={"ad_id": "ad 1:x|y"})  # VW delimiters inside an id
    ns = po.namespaces(ex, 32, 16)
    x = po.river_features(ns, po.INTERACTIONS)
    n_quad = sum(len(ns[a]) * len(ns[b]) for a, b in po.INTERACTIONS)
    assert len(x) == sum(len(f) for f in ns.values()) + n_quad
    line = po.vw_line(ns, ex.click)
    assert line.count("|") == len(ns) and "ad=ad_1_x_y" in line

    from vowpalwabbit import Workspace

    ws = Workspace("--quiet " + " ".join(f"-q {q}" for q in po.INTERACTIONS))
    parsed = ws.parse(line)
    ws.learn(parsed)  # VW counts the quadratic terms once it has expanded them
    assert parsed.get_feature_number() == len(x) + 1  # and adds its constant feature
    ws.finish_example(parsed)
    ws.finish()


def test_each_learner_is_timed_from_its_own_input_and_river_learns_as_before(tiny: dict[str, Any]) -> None:
    """River's clock starts after its feature dicts are built (as VW's after its lines), and the
    scores are those of learning each dict as it comes; adstream's CPU window is its replay plus
    the per-user correction, each reported."""
    po = _peer_online()
    warm, stream = tiny["warm"][:300], tiny["stream"][:300]
    spec = po.PeerSpec()
    r = po.run_river(warm, stream, spec)
    assert r["encode_s"] > 0 and r["cpu_s"] > 0
    model = po._river_model(spec)  # the loop as it was, building each dict inside it
    for _ in range(spec.warm_passes):
        for ns, e in zip(po._encode(warm, spec), warm, strict=True):
            model.learn_one(po.river_features(ns, spec.interactions), e.click)
    ref = []
    for ns, e in zip(po._encode(stream, spec), stream, strict=True):
        x = po.river_features(ns, spec.interactions)
        ref.append(model.predict_proba_one(x).get(True, 0.0))
        model.learn_one(x, e.click)
    np.testing.assert_array_equal(r["scores"], np.asarray(ref))
    a = po.run_adstream(warm, stream, Settings(), 0)
    assert 0 <= a["correction_cpu_s"] <= a["cpu_s"] and 0 <= a["correction_s"] <= a["learn_s"]


def test_a_window_a_short_stream_does_not_reach_is_none_in_the_means_not_a_crash() -> None:
    """`adstream bench all --quick` (20,000 impressions) failed with a TypeError: its streams end
    before the after-drift window, whose AUC is None, and the per-scenario mean divided None."""
    po = _peer_online()
    auc = {"overall": 0.7, "pre": 0.72, "dip": 0.6, "after": None}

    def stream(seed: int, after: float | None) -> dict[str, Any]:
        aucs = {m: {**auc, "after": after} for m in po.LEARNERS}
        return {"kind": "simulator", "scenario": "handover", "seed": seed, "auc": aucs,
                "goal_met": True, "goal_met_after": False}  # fmt: skip

    means = po.summarize({"a": stream(7, None), "b": stream(8, None)})["scenario_means"]["handover"]
    assert means["adstream"] == {"overall": 0.7, "pre": 0.72, "dip": 0.6, "after": None}
    both = po.summarize({"a": stream(7, None), "b": stream(8, 0.8)})["scenario_means"]["handover"]
    assert both["vw"]["after"] == 0.8  # the mean of the seeds that reached the window
