"""Assembly: each product's attributes fill its locale's templates, headline × body × call to
action, into variants that keep the tone's rules; a catalog entry (`AdCreative`) per product.

Everything is checked before anything is returned: a product that misses an attribute a
template needs, a slot value or a part over its length limit, a banned word, too many variants
— each is a `Problem` naming the products line (and the template's line in the tone file).
"""

from __future__ import annotations

import hashlib
import itertools
from datetime import UTC, datetime
from pathlib import Path

from creatives.problems import CreativeInputError, Problem
from creatives.products import Product, format_price, read_products
from creatives.tone import PARTS, Template, Tone, banned_in, check_tone
from schemas.events import AdCreative, CreativeVariant


def slot_values(product: Product, tone: Tone) -> dict[str, str]:
    """The product's attributes as the text that fills a slot (prices formatted)."""
    locale = tone.locales[product.row.locale]
    out = {}
    for name, value in product.row.attributes.items():
        out[name] = format_price(float(value), locale.currency) if name == "price" else str(value)
    return out


def _slot_problems(product: Product, tone: Tone, values: dict[str, str], where: str) -> list[Problem]:
    """Attributes a template needs but the product lacks, slot values over their limit, a price
    that is not a number."""
    problems = []
    limits = tone.rules.limits
    needed: dict[str, Template] = {}
    for part in PARTS:
        for t in tone.templates[product.row.locale][part]:
            for slot in t.slots:
                needed.setdefault(slot, t)
    for slot, t in needed.items():
        if slot not in values:
            problems.append(
                Problem(where, product.line, f"attribute {slot!r} is missing; the {t.part} template "
                        f"{t.text!r} at {tone.path}:{t.line} needs it")
            )  # fmt: skip
        elif slot in limits and len(values[slot]) > limits[slot]:
            problems.append(
                Problem(where, product.line, f"attribute {slot!r} = {values[slot]!r} is {len(values[slot])} "
                        f"characters; the tone's limit is {limits[slot]} ({tone.path})")
            )  # fmt: skip
    price = product.row.attributes.get("price")
    if price is not None and not isinstance(price, float | int):
        problems.append(Problem(where, product.line, f"attribute 'price' = {price!r} must be a number"))
    return problems


def _part_problem(tone: Tone, t: Template, text: str, banned: list[str]) -> str | None:
    """Why a rendered part breaks a rule, or None."""
    limit = tone.rules.limits.get(t.part)
    if limit is not None and len(text) > limit:
        at = f"template at {tone.path}:{t.line}"
        return f"{t.part} {text!r} is {len(text)} characters, over the limit {limit} ({at})"
    word = banned_in(text, banned)
    if word is not None:
        return f"{t.part} {text!r} contains the banned word {word!r} (template at {tone.path}:{t.line})"
    return None


def variants_of(product: Product, tone: Tone, where: str) -> tuple[list[CreativeVariant], list[Problem]]:
    """Every variant of one product (headline × body × cta, in template order), or its problems."""
    locale = product.row.locale
    if locale not in tone.locales:
        known = ", ".join(sorted(tone.locales))
        return [], [
            Problem(where, product.line, f"locale {locale!r} is not in the tone file {tone.path} ({known})")
        ]
    values = slot_values(product, tone)
    problems = _slot_problems(product, tone, values, where)
    if problems:
        return [], problems
    lt, rules = tone.locales[locale], tone.rules
    rendered: dict[str, list[tuple[Template, str]]] = {}
    for part in PARTS:
        rendered[part] = []
        for t in tone.templates[locale][part]:
            text = t.render(values)
            why = _part_problem(tone, t, text, rules.banned_words)
            if why is not None:
                problems.append(Problem(where, product.line, why))
            rendered[part].append((t, text))
    if "disclosure" in rules.limits and len(lt.disclosure) > rules.limits["disclosure"]:
        line = tone.line_of("locales", locale, "disclosure")
        problems.append(Problem(tone.path, line, f"disclosure {lt.disclosure!r} is over its limit"))
    count = len(rendered["headline"]) * len(rendered["body"]) * len(rendered["cta"])
    if count > rules.max_variants:
        problems.append(
            Problem(where, product.line, f"{count} variants (headline × body × cta) exceed the tone's "
                    f"max_variants {rules.max_variants} ({tone.path}:{tone.line_of('rules')})")
        )  # fmt: skip
    if problems:
        return [], problems
    out = []
    for (h, headline), (b, body), (c, cta) in itertools.product(
        rendered["headline"], rendered["body"], rendered["cta"]
    ):
        out.append(
            CreativeVariant(
                variant_id=f"{locale}-h{h.index}b{b.index}c{c.index}", locale=locale, headline=headline,
                body=body, cta=cta, disclosure=lt.disclosure, emphasis=h.emphasis,
            )
        )  # fmt: skip
    return out, []


def creative_of(product: Product, variants: list[CreativeVariant], ts: datetime) -> AdCreative:
    """The catalog entry of a product: its first variant's headline as the title; the event id
    is a digest of the content, so rebuilding the same catalog gives the same events."""
    row = product.row
    fields = {
        "ad_id": row.ad_id, "campaign_id": row.campaign_id, "advertiser_id": row.advertiser_id,
        "category": row.category, "title": variants[0].headline, "bid": row.bid,
        "daily_budget": row.daily_budget, "active": row.active, "variants": tuple(variants),
    }  # fmt: skip
    digest = hashlib.sha256(repr(sorted((k, repr(v)) for k, v in fields.items())).encode()).hexdigest()
    return AdCreative(event_id=f"crv-{digest[:32]}", ts=ts, **fields)  # type: ignore[arg-type]


def assemble(
    products: list[Product], tone: Tone, where: str, ts: datetime
) -> tuple[list[AdCreative], list[Problem]]:
    """The catalog entries of all products, and every problem found (entries only if none)."""
    ads: list[AdCreative] = []
    problems: list[Problem] = []
    for product in products:
        variants, found = variants_of(product, tone, where)
        problems.extend(found)
        if variants:  # none without problems only when the tone's own problems left a part empty
            ads.append(creative_of(product, variants, ts))
    return (ads if not problems else []), problems


def build_catalog(products_path: Path, tone_path: Path, ts: datetime | None = None) -> list[AdCreative]:
    """Read, check and assemble: every product's catalog entry, or CreativeInputError naming every
    problem of both files by line (then nothing is returned, so nothing partial is written)."""
    tone, problems = check_tone(tone_path)
    products, product_problems = read_products(products_path)
    problems = problems + product_problems
    if tone is None:
        raise CreativeInputError(problems)
    ads, found = assemble(products, tone, str(products_path), ts or datetime.now(UTC))
    problems += found
    if problems:
        raise CreativeInputError(problems)
    return ads
