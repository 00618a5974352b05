"""The catalog file a replica loads at start (`serving.catalog_file`) (issue 14: L8)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from schemas.codec import encode
from schemas.errors import SchemaError
from schemas.events import AdCreative, Click
from serving.loops import read_catalog_file

TS = datetime(2026, 1, 1, tzinfo=UTC)


def ad(i: int) -> AdCreative:
    return AdCreative(
        event_id=f"e{i}", ts=TS, ad_id=f"a{i}", campaign_id=f"c{i}", advertiser_id=f"v{i}",
        category="k", title=f"t{i}", bid=1.0, daily_budget=100.0, active=True,
    )  # fmt: skip


def test_every_ad_is_loaded_however_its_json_is_spelled(tmp_path: Path) -> None:
    """The loader kept only lines with the literal `"kind":"ad"` (spaces aside): an ad written
    with a tab, with its `kind` omitted (the contract's default) or escaped was left out of the
    catalog without a word."""
    plain = encode(ad(0)).decode()
    tabbed = json.dumps(json.loads(encode(ad(1))), separators=(",", ":\t"))
    no_kind = json.dumps({k: v for k, v in json.loads(encode(ad(2))).items() if k != "kind"})
    escaped = encode(ad(3)).decode().replace('"kind":"ad"', '"kind":"\\u0061d"')
    other = encode(Click(event_id="x", ts=TS, user_id="u", impression_id="i", ad_id="a0", campaign_id="c0"))
    path = tmp_path / "catalog.jsonl"
    path.write_text("\n".join([plain, tabbed, "", no_kind, other.decode(), escaped]) + "\n")
    assert [a.ad_id for a in read_catalog_file(path)] == ["a0", "a1", "a2", "a3"]


@pytest.mark.parametrize("line", ['{"kind": "ad", "ad_id": "a9"}', "not json at all", "[1, 2]"])
def test_a_line_that_is_not_an_ad_or_an_event_names_its_line(tmp_path: Path, line: str) -> None:
    """A broken line was skipped (no literal `"kind":"ad"`) or refused without saying where: the
    replica must not start on a silently shortened catalog, and the error says which line."""
    path = tmp_path / "catalog.jsonl"
    path.write_text(encode(ad(0)).decode() + "\n" + line + "\n")
    with pytest.raises(SchemaError, match=r"catalog\.jsonl:2"):
        read_catalog_file(path)


def test_campaign_lines_are_read_beside_the_ads(tmp_path: Path) -> None:
    from schemas.events import Campaign, Targeting
    from serving.loops import read_catalog_entries

    camp = Campaign(event_id="k", ts=TS, campaign_id="c0", advertiser_id="v0", daily_budget=5.0,
                    targeting=Targeting(geo=("DE",)))  # fmt: skip
    path = tmp_path / "catalog.jsonl"
    path.write_text(encode(camp).decode() + "\n" + encode(ad(0)).decode() + "\n")
    ads, campaigns = read_catalog_entries(path)
    assert [a.ad_id for a in ads] == ["a0"] and campaigns == [camp]
    path.write_text(encode(ad(0)).decode() + '\n{"kind": "campaign", "campaign_id": "c0"}\n')
    with pytest.raises(SchemaError, match=r"catalog\.jsonl:2"):
        read_catalog_entries(path)
