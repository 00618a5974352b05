"""Creative assembly: a product's structured attributes and a brand's tone file expand into
variants (headline × body × call to action) that keep the brand's rules, as catalog entries.

    >>> from pathlib import Path
    >>> from creatives import build_catalog
    >>> examples = Path(__file__).parent / "examples"
    >>> ads = build_catalog(examples / "products.jsonl", examples / "tone.yaml")
    >>> len(ads), len(ads[0].variants), ads[0].variants[0].headline
    (4, 8, '轻盈透气运动鞋｜专为夏季慢跑设计')
"""

from __future__ import annotations

from creatives.assemble import assemble, build_catalog
from creatives.problems import CreativeInputError, Problem
from creatives.products import Product, read_products
from creatives.tone import Template, Tone, read_tone

__all__ = [
    "CreativeInputError",
    "Problem",
    "Product",
    "Template",
    "Tone",
    "assemble",
    "build_catalog",
    "read_products",
    "read_tone",
]
