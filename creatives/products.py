"""Products as JSON lines: one product per line, its catalog fields and structured attributes.

    {"ad_id": "shoe-101", "campaign_id": "summer-run", "advertiser_id": "stride",
     "category": "shoes", "bid": 1.2, "daily_budget": 500, "locale": "zh",
     "attributes": {"name": "运动鞋", "benefit": "轻盈透气", "feature": "夏季慢跑",
                    "price": 299, "promotion": "今日下单立减80"}}

Attributes other than the template slots (`sku`, `color` …) are allowed and ignored; `price`
is a number, formatted with the locale's currency sign.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from creatives.problems import Problem
from creatives.tone import Locale, Phrase
from schemas.events import MAX_MONEY, Ident

AttributeName = Annotated[str, StringConstraints(min_length=1, max_length=64)]


class ProductRow(BaseModel):
    """One line of a products file."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    ad_id: Ident
    campaign_id: Ident
    advertiser_id: Ident
    category: Ident
    bid: Annotated[float, Field(gt=0, le=MAX_MONEY, allow_inf_nan=False)]
    daily_budget: Annotated[float, Field(gt=0, le=MAX_MONEY, allow_inf_nan=False)]
    active: bool = True
    locale: Locale
    attributes: dict[AttributeName, Phrase | Annotated[float, Field(ge=0, le=MAX_MONEY, allow_inf_nan=False)]]


@dataclass(frozen=True)
class Product:
    """A valid product row and its 1-based line."""

    row: ProductRow
    line: int


def format_price(value: float, currency: str) -> str:
    """A price as shown: the currency sign, no decimals when whole.

    >>> format_price(299.0, "¥"), format_price(29.9, "$")
    ('¥299', '$29.90')
    """
    text = f"{value:,.2f}"
    return currency + (text[:-3] if text.endswith(".00") else text)


def read_products(path: Path) -> tuple[list[Product], list[Problem]]:
    """Every valid product of a JSON-lines file, and a problem for each invalid line (blank lines
    are skipped; a repeated `ad_id` is a problem at its second line)."""
    where = str(path)
    try:
        raw_lines = path.read_bytes().splitlines()
    except OSError as exc:
        return [], [Problem(where, 1, f"cannot read the products file ({exc})")]
    products: list[Product] = []
    problems: list[Problem] = []
    first_line: dict[str, int] = {}
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        try:
            data = json.loads(raw)
            row = ProductRow.model_validate(data) if isinstance(data, dict) else None
        except (ValueError, UnicodeDecodeError) as exc:
            message = _describe(exc) if isinstance(exc, ValidationError) else f"not valid JSON ({exc})"
            problems.append(Problem(where, number, message))
            continue
        if row is None:
            problems.append(Problem(where, number, "a product line must be a JSON object"))
        elif row.ad_id in first_line:
            problems.append(
                Problem(where, number, f"ad_id {row.ad_id!r} repeats line {first_line[row.ad_id]}")
            )
        else:
            first_line[row.ad_id] = number
            products.append(Product(row, number))
    if not products and not problems:
        problems.append(Problem(where, 1, "the products file has no product"))
    return products, problems


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "product"
        parts.append(f"field '{loc}': {err['msg']} (got {err.get('input')!r:.60})")
    return "; ".join(parts)
