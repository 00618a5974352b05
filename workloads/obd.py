"""Replay of the Open Bandit Dataset (small version) as contract events, in time order.

The Open Bandit Dataset is a log of the fashion e-commerce site ZOZOTOWN's recommendation
widget under two logging policies (uniform random and Bernoulli Thompson sampling), for three
campaigns (all, men, women); each row is one impression of one item at position 1–3 with its
click. The small version (10,000 rows per policy × campaign) ships inside the PyPI package
`obp==0.4.1`; we read those CSV files directly and never download anything.

    Yuta Saito, Shunsuke Aihara, Megumi Matsutani, Yusuke Narita. "Open Bandit Dataset and
    Pipeline: Towards Realistic and Reproducible Off-Policy Evaluation." NeurIPS 2021 Datasets
    and Benchmarks Track. https://arxiv.org/abs/2008.07146

Mapping: one `AdCreative` per item (category and advertiser from its hashed item features,
emitted at the first row's time), one `Impression` per row (slot `feed`, position 0–2,
`model_version` = the logging policy) and one `Click` per clicked row, at the row's timestamp.
The dataset has no user id: `user_id` is a stable hash of the row's four user features (a
cohort, not a person). Timestamps keep their original offsets, divided by `speedup`.
"""

from __future__ import annotations

import csv
import hashlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from pathlib import Path

from schemas.errors import ConfigError
from schemas.events import AdCreative, Click, Impression, Message


class ObdPolicy(StrEnum):
    """The logging policy of an Open Bandit Dataset log."""

    random = "random"
    bts = "bts"


class ObdCampaign(StrEnum):
    """The campaign of an Open Bandit Dataset log."""

    all = "all"
    men = "men"
    women = "women"


POLICIES: tuple[str, ...] = tuple(p.value for p in ObdPolicy)
CAMPAIGNS: tuple[str, ...] = tuple(c.value for c in ObdCampaign)


def obd_dir() -> Path:
    """The folder of the small Open Bandit Dataset inside the installed `obp` package."""
    spec = importlib.util.find_spec("obp")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the package obp==0.4.1 is not installed; it carries the Open Bandit Dataset")
    path = Path(next(iter(spec.submodule_search_locations))) / "dataset" / "obd"
    if not path.is_dir():
        raise ConfigError(f"no Open Bandit Dataset under {path} (is this obp==0.4.1?)")
    return path


def obd_files(policy: str, campaign: str) -> tuple[Path, Path]:
    """(log CSV, item-context CSV) of one logging policy and campaign."""
    if policy not in POLICIES:
        raise ConfigError(f"policy={policy!r}: must be one of {', '.join(POLICIES)}")
    if campaign not in CAMPAIGNS:
        raise ConfigError(f"campaign={campaign!r}: must be one of {', '.join(CAMPAIGNS)}")
    folder = obd_dir() / policy / campaign
    return folder / f"{campaign}.csv", folder / "item_context.csv"


@dataclass(frozen=True)
class ObdRow:
    """One logged impression of the dataset."""

    row: int
    ts: datetime
    item_id: int
    position: int  # 1-based, as in the file
    click: bool
    propensity: float
    user_features: tuple[str, ...]


def read_rows(path: Path) -> list[ObdRow]:
    """Every row of a log CSV, sorted by time (stable, so ties keep file order)."""
    rows = []
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        ufields = [f for f in reader.fieldnames or [] if f.startswith("user_feature_")]
        for rec in reader:
            rows.append(
                ObdRow(
                    row=int(rec[""]),
                    ts=datetime.fromisoformat(rec["timestamp"]),
                    item_id=int(rec["item_id"]),
                    position=int(rec["position"]),
                    click=rec["click"] == "1",
                    propensity=float(rec["propensity_score"]),
                    user_features=tuple(rec[f] for f in ufields),
                )
            )
    rows.sort(key=lambda r: r.ts)
    return rows


def read_items(path: Path) -> dict[int, dict[str, str]]:
    """Item id → its context features."""
    with path.open(newline="") as fh:
        return {int(rec["item_id"]): rec for rec in csv.DictReader(fh)}


def cohort_id(features: tuple[str, ...]) -> str:
    """A stable pseudo user id from the row's user features."""
    return "obd-u" + hashlib.blake2b("|".join(features).encode(), digest_size=8).hexdigest()


def replay_obd(
    policy: str = "random", campaign: str = "all", speedup: float = 1.0, start: datetime | None = None
) -> Iterator[Message]:
    """The dataset's catalog, impressions and clicks as contract events, in time order.

    Offsets from the first row are divided by `speedup`; `start` (aware) moves the first row
    to that instant, otherwise the original 2019 timestamps are kept.
    """
    if not speedup > 0:
        raise ConfigError(f"speedup={speedup!r}: must be > 0")
    if start is not None and start.tzinfo is None:
        raise ConfigError(f"start={start!r}: must be timezone-aware")
    log_csv, items_csv = obd_files(policy, campaign)
    rows = read_rows(log_csv)
    items = read_items(items_csv)
    if not rows:
        return
    t0 = rows[0].ts
    origin = start or t0

    def at(ts: datetime) -> datetime:
        return origin + (ts - t0) / speedup

    tag = f"obd-{policy}-{campaign}"
    campaign_id = f"obd-{campaign}"
    for item_id in sorted(items):
        feat = items[item_id]
        yield AdCreative(
            event_id=f"{tag}-item{item_id}",
            ts=origin,
            ad_id=f"obd-item{item_id}",
            campaign_id=campaign_id,
            advertiser_id="obd-" + feat.get("item_feature_2", "zozotown")[:12],
            category="obd-" + feat.get("item_feature_1", "fashion")[:12],
            title=f"ZOZOTOWN fashion item {item_id}",
            bid=1.0,
            daily_budget=1000.0,
            active=True,
        )
    for r in rows:
        imp = Impression(
            event_id=f"{tag}-{r.row}",
            ts=at(r.ts),
            user_id=cohort_id(r.user_features),
            request_id=f"{tag}-r{r.row}",
            ad_id=f"obd-item{r.item_id}",
            campaign_id=campaign_id,
            advertiser_id="obd-" + items.get(r.item_id, {}).get("item_feature_2", "zozotown")[:12],
            slot="feed",
            position=r.position - 1,
            price=0.0,
            model_version=f"obd-{policy}",
        )
        yield imp
        if r.click:
            yield Click(
                event_id=f"{tag}-{r.row}-click",
                ts=imp.ts,
                user_id=imp.user_id,
                impression_id=imp.event_id,
                ad_id=imp.ad_id,
                campaign_id=campaign_id,
            )
