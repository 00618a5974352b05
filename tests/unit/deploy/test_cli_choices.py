"""Every CLI option with a fixed set of values is a choice (an Enum: `--help` lists the values,
Typer refuses a wrong one before anything runs), and its values are the owning room's."""

from __future__ import annotations

from typing import get_args

import pytest

from attribution.models import MODELS
from attribution.paths import CHANNEL_KEY_SQL, CHANNEL_SQL
from schemas.settings import Settings
from workloads.config import DRIFT_MODES, LOGGING_POLICIES
from workloads.obd import CAMPAIGNS, POLICIES

pytestmark = pytest.mark.timeout(60)

CHOICES: dict[tuple[str, str], tuple[str, ...]] = {
    ("up", "only"): ("kafka", "redis", "clickhouse"),
    ("simulate", "drift_mode"): DRIFT_MODES,
    ("simulate", "policy"): LOGGING_POLICIES,
    ("closed-loop", "drift_mode"): DRIFT_MODES,
    ("replay obd", "policy"): POLICIES,
    ("replay obd", "campaign"): CAMPAIGNS,
    ("demo", "drift_mode"): DRIFT_MODES,
    ("worker", "loglevel"): ("crit", "error", "warn", "info", "debug"),
    ("worker", "engine"): ("faust", "aiokafka"),
    ("trainer", "order"): ("impression", "emission"),
    ("serve", "device"): get_args(Settings.model_fields["device"].annotation),
    ("attribution", "by"): tuple(CHANNEL_SQL),
    ("attribution compare", "by"): tuple(CHANNEL_SQL),
    ("attribution", "model"): tuple(MODELS),
    ("attribution compare", "model"): tuple(MODELS),
}


def _option_line(path: str, option: str) -> str:
    from typer.testing import CliRunner

    from deploy.cli import app

    # wide enough that rich never truncates the type column (`<list[first_click|…]>`)
    r = CliRunner().invoke(app, [*path.split(), "--help"], env={"COLUMNS": "1000"}, terminal_width=1000)
    assert r.exit_code == 0, r.output
    flag = "--" + option.replace("_", "-")
    (line,) = [ln for ln in r.output.splitlines() if f"{flag} " in ln]
    return line


@pytest.mark.parametrize(("path", "option"), sorted(CHOICES))
def test_fixed_values_are_choices_of_the_rooms_values(path: str, option: str) -> None:
    # Typer shows a choice's values in the option's type: `<slot|campaign|slot_campaign>`
    line = _option_line(path, option)
    assert "|".join(CHOICES[path, option]) in line, line


def test_the_enums_are_the_rooms_tables() -> None:
    from attribution.models import ModelName
    from attribution.paths import Granularity

    assert tuple(Granularity) == tuple(CHANNEL_SQL) == tuple(CHANNEL_KEY_SQL)
    assert tuple(ModelName) == tuple(MODELS)


def test_a_wrong_choice_is_refused_before_anything_runs() -> None:
    from typer.testing import CliRunner

    from deploy.cli import app

    # no ClickHouse is asked (the option is refused by the parser), and the message names the value
    r = CliRunner().invoke(app, ["attribution", "--by", "zone", "--no-store"])
    assert r.exit_code == 2 and "'zone'" in r.output
    r = CliRunner().invoke(app, ["up", "--only", "postgres"])
    assert r.exit_code == 2 and "'postgres'" in r.output
