"""The demo's (and the live-loop benchmark's) learning arm is served by the live adapters.

Found with the live loop's shadow slates (issue 32): at the canary's default share (5 %) every
learning-arm impression of a loop was served by the canary's stable arm with no adapter version
(ClickHouse `impressions.adapter_version` NULL for all 632 of them): the canary decides only after
500 learning-arm impressions per arm, which a loop's candidate never reaches, so nothing was ever
promoted and the learning arm was the correction-only arm under another name."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.demo import Demo, DemoSpec
from schemas.settings import Settings
from serving.arms import ab_arm_for
from serving.canary import arm_for

USERS = [f"u{i}" for i in range(400)]


def _learning_users_on_the_candidate(env: dict[str, str]) -> float:
    share = float(env.get("ADSTREAM_CANARY__SHARE", Settings(_env_file=None).canary.share))  # type: ignore[call-arg]
    s = Settings(_env_file=None, canary={"share": share})  # type: ignore[call-arg]
    learning = [u for u in USERS if ab_arm_for(u, s.ab) == "learning"]
    return sum(arm_for(u, s.canary.share) == "candidate" for u in learning) / len(learning)


def test_every_learning_arm_user_of_the_demo_is_on_the_live_adapters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ADSTREAM_CANARY__SHARE", raising=False)
    demo = Demo(DemoSpec(), Settings(_env_file=None, state_dir=tmp_path), lambda _: None)  # type: ignore[call-arg]
    assert _learning_users_on_the_candidate(demo.env) == 1.0
    assert demo.env["ADSTREAM_AB__SHADOW_SLATES"] == "true"  # the adapters' paired figure


def test_the_callers_canary_share_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADSTREAM_CANARY__SHARE", "0.05")
    demo = Demo(DemoSpec(), Settings(_env_file=None, state_dir=tmp_path), lambda _: None)  # type: ignore[call-arg]
    assert demo.env["ADSTREAM_CANARY__SHARE"] == "0.05"
    assert _learning_users_on_the_candidate(demo.env) < 0.2
