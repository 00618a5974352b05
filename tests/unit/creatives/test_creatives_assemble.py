"""Creative assembly: products × tone → variants that keep the rules; every bad input named by
file and line, and nothing written when anything is wrong (CLI exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from creatives import CreativeInputError, build_catalog
from schemas.codec import decode, encode
from schemas.events import AdCreative

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "creatives" / "examples"

TONE = """\
brand: Stride
rules:
  limits: {headline: 24, body: 30, cta: 6, benefit: 6}
  banned_words: [最, best]
  max_variants: 8
locales:
  zh:
    currency: "¥"
    disclosure: 广告
    headline:
      - "{benefit}{name}"
      - "{promotion}｜{name}"
    body:
      - "仅需{price}，{feature}"
    cta: [立即抢购, 查看详情]
  en:
    currency: "$"
    disclosure: Sponsored
    headline: ["{benefit} {name}"]
    body: ["Only {price}"]
    cta: [Buy]
"""
SHOE = {
    "ad_id": "shoe-1", "campaign_id": "c1", "advertiser_id": "stride", "category": "shoes",
    "bid": 1.2, "daily_budget": 500, "locale": "zh",
    "attributes": {"name": "运动鞋", "benefit": "轻盈透气", "feature": "夏季慢跑", "price": 299,
                   "promotion": "立减80"},
}  # fmt: skip
SOCK = {
    "ad_id": "sock-1", "campaign_id": "c2", "advertiser_id": "stride", "category": "shoes",
    "bid": 0.4, "daily_budget": 100, "locale": "en",
    "attributes": {"name": "Run Socks", "benefit": "Dry", "price": 12.5},
}  # fmt: skip


def write(tmp_path: Path, tone: str, rows: list[object]) -> tuple[Path, Path]:
    tone_path, products = tmp_path / "tone.yaml", tmp_path / "products.jsonl"
    tone_path.write_text(tone, encoding="utf-8")
    products.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows),
        encoding="utf-8",
    )
    return products, tone_path


def problems(products: Path, tone: Path) -> list[str]:
    with pytest.raises(CreativeInputError) as info:
        build_catalog(products, tone)
    return [str(p) for p in info.value.problems]


def test_chinese_and_english_products_expand_into_every_combination(tmp_path: Path) -> None:
    products, tone = write(tmp_path, TONE, [SHOE, SOCK])
    shoe, sock = build_catalog(products, tone)
    assert [v.variant_id for v in shoe.variants] == [
        "zh-h0b0c0", "zh-h0b0c1", "zh-h1b0c0", "zh-h1b0c1",
    ]  # fmt: skip
    first = shoe.variants[0]
    assert (first.headline, first.body, first.cta, first.disclosure) == (
        "轻盈透气运动鞋",
        "仅需¥299，夏季慢跑",
        "立即抢购",
        "广告",
    )
    assert first.emphasis == "benefit" and shoe.variants[2].emphasis == "promotion"
    assert shoe.title == first.headline and shoe.bid == 1.2 and shoe.active
    assert [v.headline for v in sock.variants] == ["Dry Run Socks"] and sock.variants[0].body == "Only $12.50"
    # each is a valid contract object that round-trips the wire
    assert decode(AdCreative, encode(shoe)) == shoe


def test_a_rebuild_gives_the_same_events(tmp_path: Path) -> None:
    products, tone = write(tmp_path, TONE, [SHOE])
    a, b = build_catalog(products, tone), build_catalog(products, tone)
    assert a[0].event_id == b[0].event_id and a[0].variants == b[0].variants


def test_the_examples_build(tmp_path: Path) -> None:
    ads = build_catalog(EXAMPLES / "products.jsonl", EXAMPLES / "tone.yaml")
    assert len(ads) == 4 and all(len(ad.variants) == 8 for ad in ads)
    assert {v.locale for ad in ads for v in ad.variants} == {"zh", "en"}


def test_an_unknown_slot_is_named_by_its_tone_line(tmp_path: Path) -> None:
    products, tone = write(tmp_path, TONE.replace('"{promotion}｜{name}"', '"{discount}｜{name}"'), [SHOE])
    (found,) = problems(products, tone)
    assert found.startswith(f"{tone}:12: headline template") and "unknown slot 'discount'" in found


@pytest.mark.parametrize(
    ("template", "why"),
    [("{name!r}", "format spec or conversion"), ("{name", "not a valid template"), ("{}", "empty braces")],
)
def test_a_malformed_template_is_named_by_its_line(tmp_path: Path, template: str, why: str) -> None:
    products, tone = write(tmp_path, TONE.replace('"{promotion}｜{name}"', f'"{template}"'), [SHOE])
    (found,) = problems(products, tone)
    assert found.startswith(f"{tone}:12:") and why in found


def test_a_missing_attribute_names_the_product_line_and_the_template(tmp_path: Path) -> None:
    no_promotion = {**SHOE, "ad_id": "shoe-2", "attributes": {k: v for k, v in SHOE["attributes"].items()  # type: ignore[attr-defined]
                                                             if k != "promotion"}}  # fmt: skip
    products, tone = write(tmp_path, TONE, [SHOE, "", no_promotion])
    (found,) = problems(products, tone)
    assert found.startswith(f"{products}:3: attribute 'promotion' is missing")
    assert f"{tone}:12" in found


def test_a_slot_value_over_its_limit(tmp_path: Path) -> None:
    long = {**SHOE, "attributes": {**SHOE["attributes"], "benefit": "超级轻盈透气款"}}  # type: ignore[dict-item]
    products, tone = write(tmp_path, TONE, [long])
    (found,) = problems(products, tone)
    assert found.startswith(f"{products}:1: attribute 'benefit'") and "limit is 6" in found


def test_a_headline_over_its_limit_names_product_and_template(tmp_path: Path) -> None:
    tone_text = TONE.replace("headline: 24", "headline: 6")
    products, tone = write(tmp_path, tone_text, [SHOE])
    found = problems(products, tone)
    assert found == [
        f"{products}:1: headline '轻盈透气运动鞋' is 7 characters, over the limit 6 (template at {tone}:11)",
        f"{products}:1: headline '立减80｜运动鞋' is 8 characters, over the limit 6 (template at {tone}:12)",
    ]


def test_a_banned_word_from_a_product_or_a_template(tmp_path: Path) -> None:
    banned_attr = {**SHOE, "attributes": {**SHOE["attributes"], "feature": "最舒适"}}  # type: ignore[dict-item]
    products, tone = write(tmp_path, TONE, [banned_attr])
    (found,) = problems(products, tone)
    assert found.startswith(f"{products}:1: body '仅需¥299，最舒适' contains the banned word '最'")
    products, tone = write(tmp_path, TONE.replace("[Buy]", "[Best buy]"), [SOCK])
    (found,) = problems(products, tone)
    assert found == f"{tone}:21: cta template 'Best buy' contains the banned word 'best'"


def test_the_disclosure_is_required(tmp_path: Path) -> None:
    products, tone = write(tmp_path, TONE.replace("    disclosure: 广告\n", ""), [SHOE])
    (found,) = problems(products, tone)
    assert found.startswith(f"{tone}:7: locales.zh.disclosure: Field required")


def test_too_many_variants_bad_rows_and_repeats_are_all_named(tmp_path: Path) -> None:
    tone_text = TONE.replace("max_variants: 8", "max_variants: 3")
    bad_row = {**SOCK, "ad_id": "sock-2", "bid": -1}
    products, tone = write(tmp_path, tone_text, [SHOE, "{not json", bad_row, SOCK, SOCK])
    found = problems(products, tone)
    assert [f.split(": ", 1)[0] for f in found] == [f"{products}:{n}" for n in (1, 2, 3, 5)]
    assert "4 variants" in found[0] and "not valid JSON" in found[1]
    assert "field 'bid'" in found[2] and "repeats line 4" in found[3]


def test_an_unknown_locale_and_an_unknown_tone_field(tmp_path: Path) -> None:
    products, tone = write(tmp_path, TONE, [{**SOCK, "locale": "fr"}])
    (found,) = problems(products, tone)
    assert found.startswith(f"{products}:1: locale 'fr' is not in the tone file")
    products, tone = write(tmp_path, TONE.replace("  max_variants: 8\n", "  max_variant: 8\n"), [SOCK])
    (found,) = problems(products, tone)
    assert found.startswith(f"{tone}:5: rules.max_variant: Extra inputs are not permitted")


def _cli(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "ADSTREAM_STATE_DIR": str(tmp_path / "state"),
           "ADSTREAM_KAFKA__BOOTSTRAP": "127.0.0.1:1", "ADSTREAM_KAFKA__CONNECT_TIMEOUT_S": "2"}  # fmt: skip
    cmd = [sys.executable, "-c", "from deploy.cli import main; main()", "creatives", "build", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_cli_bad_input_exits_2_naming_file_and_line_and_writes_nothing(tmp_path: Path) -> None:
    no_promotion = {**SHOE, "attributes": {k: v for k, v in SHOE["attributes"].items() if k != "promotion"}}  # type: ignore[attr-defined]
    products, tone = write(tmp_path, TONE, [SOCK, no_promotion])
    out = tmp_path / "catalog.jsonl"
    # no broker answers: had anything been produced before the check, the error would be Kafka's
    done = _cli([str(products), "--tone", str(tone), "--out", str(out)], tmp_path)
    assert done.returncode == 2, done.stderr
    assert f"error: {products}:2: attribute 'promotion' is missing" in done.stderr
    assert "Traceback" not in done.stderr and "Kafka" not in done.stderr + done.stdout
    assert not out.exists()


def test_cli_dry_run_writes_the_catalog_file_only(tmp_path: Path) -> None:
    products, tone = write(tmp_path, TONE, [SHOE, SOCK])
    out = tmp_path / "catalog.jsonl"
    done = _cli([str(products), "--tone", str(tone), "--dry-run", "--out", str(out)], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "2 ads, 5 variants, nothing produced" in done.stdout
    ads = [decode(AdCreative, line) for line in out.read_bytes().splitlines()]
    assert [len(ad.variants) for ad in ads] == [4, 1]  # type: ignore[attr-defined]
