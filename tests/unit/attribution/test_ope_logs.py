"""attribution.ope_logs: the policy registry's probabilities, the DR reward model, and the CLI's
refusals that need no ClickHouse (exit 2, the value named)."""

from __future__ import annotations

import numpy as np
import pytest

from attribution.ope import EstimationError
from attribution.ope_logs import LoggedRounds, check_policy, evaluate, position_ctr, target_probs


def rounds() -> LoggedRounds:
    # ε-greedy with ε = 0.2 over 4 candidates: greedy ad 0.85, an explored one 0.05
    return LoggedRounds(
        slot=np.array(["feed", "feed", "feed", "search"]),
        position=np.array([0, 0, 1, 0]),
        pscore=np.array([0.85, 0.05, 0.85, 0.05]),
        explored=np.array([False, True, False, True]),
        reward=np.array([1.0, 1.0, 0.0, 0.0]),
    )


def test_target_probabilities_by_hand() -> None:
    r = rounds()
    assert target_probs("logging", r).tolist() == [0.85, 0.05, 0.85, 0.05]
    assert target_probs("greedy", r).tolist() == [1.0, 0.0, 1.0, 0.0]
    # F = 0.5: ε-greedy with ε' = 0.1 → greedy ad 0.9 + 0.1/4 = 0.925, an explored one 0.025
    assert target_probs("explore:0.5", r) == pytest.approx([0.925, 0.025, 0.925, 0.025])
    assert target_probs("explore:1", r).tolist() == target_probs("logging", r).tolist()
    assert target_probs("explore:0", r).tolist() == target_probs("greedy", r).tolist()


def test_estimates_by_hand() -> None:
    v = evaluate(rounds(), "greedy")
    # w = [1/0.85, 0, 1/0.85, 0]: IPS = (1/0.85) / 4; SNIPS = (1/0.85) / (2/0.85) = 0.5
    assert v.estimates["ips"].value == pytest.approx(1 / 0.85 / 4)
    assert v.estimates["snips"].value == pytest.approx(0.5)
    # q̂ per slot × position: feed|0 = 1.0, feed|1 = 0.0, search|0 = 0.0; DR terms = q̂ + w (r − q̂)
    assert position_ctr(rounds()).tolist() == [1.0, 1.0, 0.0, 0.0]
    assert v.estimates["dr"].value == pytest.approx((1.0 + 1.0 + 0.0 + 0.0) / 4)
    assert v.logged_ctr == 0.5 and v.rounds == 4
    assert v.effective_rounds == pytest.approx(2.0)
    on = evaluate(rounds(), "logging")
    assert on.estimates["ips"].value == on.estimates["snips"].value == on.logged_ctr


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("sometimes", "unknown policy 'sometimes'"),
        ("explore:2", "policy 'explore:2': '2' is not an exploration share F in [0, 1]"),
        ("explore:x", "policy 'explore:x': 'x' is not an exploration share"),
        ("explore:nan", "'nan' is not an exploration share"),
    ],
)
def test_unknown_policies_are_named(name: str, needle: str) -> None:
    with pytest.raises(EstimationError) as info:
        check_policy(name)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["evaluate", "--policy", "sometimes"], "unknown policy 'sometimes'"),
        (["evaluate", "--policy", "explore:1.5"], "'1.5' is not an exploration share"),
        (["evaluate", "--policy", "greedy", "--since", "10", "--until", "5"], "--until (5) must be after"),
        (["ab", "--slot", "sidebar"], "--slot 'sidebar' is not a slot"),
        (["ab", "--pair", "learning"], "--pair 'learning' is not ARM:BASELINE"),
        (["ab", "--since", "yesterday-ish"], "--since 'yesterday-ish' is not an ISO date/time"),
    ],
)
def test_cli_refuses_bad_input_before_any_connection(args: list[str], needle: str) -> None:
    from typer.testing import CliRunner

    from deploy.cli import app

    # a ClickHouse that cannot answer: the refusal must come first
    out = CliRunner().invoke(app, args, env={"ADSTREAM_CLICKHOUSE__URL": "clickhouse://127.0.0.1:9/x"})
    assert out.exit_code == 2, out.output
    assert needle in out.output
    assert "Traceback" not in out.output
