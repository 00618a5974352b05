"""A brand's tone file (YAML): templates per locale for each part of a creative, and the rules
every assembled variant must keep.

```yaml
brand: Stride
rules:
  limits: {headline: 24, body: 40, cta: 8, benefit: 8}   # characters, per part or per slot
  banned_words: [最, 第一, best, guaranteed]
  max_variants: 24                                        # per product
locales:
  zh:
    currency: "¥"
    disclosure: 广告                                      # required: every variant carries it
    headline: ["{benefit}{name}｜专为{feature}设计", …]
    body: ["{promotion}，仅需{price}！", …]
    cta: [立即抢购, …]
```

Templates name slots in braces: `name`, `benefit`, `feature`, `price`, `promotion`, `cta`
(`schemas.events.CREATIVE_SLOTS`), filled from a product's attributes; any other name, a format
spec or an unbalanced brace is a problem at the template's line.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final, Literal, cast

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from creatives.problems import CreativeInputError, Problem
from schemas.events import CREATIVE_SLOTS, MAX_VARIANTS, TEXT_PATTERN, CreativeSlot

PARTS: Final[tuple[str, ...]] = ("headline", "body", "cta")
Part = Literal["headline", "body", "cta"]
LimitKey = Literal[
    "headline", "body", "cta", "disclosure", "name", "benefit", "feature", "price", "promotion"
]
Phrase = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=TEXT_PATTERN)]
Locale = Annotated[str, StringConstraints(pattern=r"^[a-z]{2}(-[A-Z]{2})?$")]
_FORMATTER: Final = string.Formatter()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Rules(_Strict):
    """What every variant must keep: length limits (characters) per part or slot, banned words
    (case-insensitive; whole words for Latin ones, anywhere for CJK), variants per product."""

    limits: dict[LimitKey, Annotated[int, Field(ge=1, le=256)]] = Field(default_factory=dict)
    banned_words: list[Annotated[str, StringConstraints(min_length=1, max_length=64)]] = Field(
        default_factory=list
    )
    max_variants: Annotated[int, Field(ge=1, le=MAX_VARIANTS)] = 24


class LocaleTone(_Strict):
    """One locale's templates, currency sign and the disclosure every variant must carry."""

    currency: Annotated[str, StringConstraints(max_length=8)] = ""
    disclosure: Phrase
    headline: Annotated[list[Phrase], Field(min_length=1, max_length=MAX_VARIANTS)]
    body: Annotated[list[Phrase], Field(min_length=1, max_length=MAX_VARIANTS)]
    cta: Annotated[list[Phrase], Field(min_length=1, max_length=MAX_VARIANTS)]


class ToneFile(_Strict):
    """The tone file as written."""

    brand: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    rules: Rules = Field(default_factory=Rules)
    locales: Annotated[dict[Locale, LocaleTone], Field(min_length=1)]


@dataclass(frozen=True)
class Template:
    """One parsed template: its text, the slots it fills in order, and where it was written."""

    part: Part
    index: int
    text: str
    slots: tuple[str, ...]
    line: int

    @property
    def emphasis(self) -> CreativeSlot | None:
        """The first slot the template fills (None without slots)."""
        return cast(CreativeSlot, self.slots[0]) if self.slots else None

    def render(self, values: dict[str, str]) -> str:
        """The template with each slot replaced by its value (every slot must be present)."""
        return "".join(
            lit + (values[name] if name is not None else "") for lit, name, _, _ in _parse(self.text)
        )


@dataclass(frozen=True)
class Tone:
    """A checked tone file: rules, and per locale its valid templates, currency and disclosure."""

    path: str
    brand: str
    rules: Rules
    locales: dict[str, LocaleTone]
    templates: dict[str, dict[str, list[Template]]]  # locale → part → templates that parsed
    lines: dict[tuple[str, ...], int]  # YAML path → 1-based line

    def line_of(self, *path: str) -> int:
        """The line of a YAML path, or of its closest ancestor that has one."""
        for n in range(len(path), -1, -1):
            if path[:n] in self.lines:
                return self.lines[path[:n]]
        return 1


def _parse(text: str) -> list[tuple[str, str | None, str | None, str | None]]:
    return list(_FORMATTER.parse(text))


def parse_template(text: str) -> tuple[tuple[str, ...], str | None]:
    """(slots in order, None) or ((), why the template is invalid).

    >>> parse_template("{benefit}{name}｜专为{feature}设计")
    (('benefit', 'name', 'feature'), None)
    >>> parse_template("Save {discount}!")[1]
    "uses unknown slot 'discount' (slots: name, benefit, feature, price, promotion, cta)"
    """
    try:
        parts = _parse(text)
    except ValueError as exc:
        return (), f"is not a valid template ({exc})"
    slots: list[str] = []
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        if name not in CREATIVE_SLOTS:
            shown = f"'{name}'" if name else "'' (empty braces)"
            return (), f"uses unknown slot {shown} (slots: {', '.join(CREATIVE_SLOTS)})"
        if spec or conversion:
            return (), f"slot '{name}' has a format spec or conversion; write the slot alone"
        slots.append(name)
    return tuple(slots), None


def banned_in(text: str, words: list[str]) -> str | None:
    """The first banned word `text` contains, if any (whole words for Latin ones).

    >>> banned_in("The BEST shoe", ["best"]), banned_in("最好的鞋", ["最"]), banned_in("bestow", ["best"])
    ('best', '最', None)
    """
    folded = text.casefold()
    for word in words:
        w = word.casefold()
        if re.fullmatch(r"[\w\s'#+-]+", w, flags=re.ASCII):
            if re.search(rf"(?<![\w]){re.escape(w)}(?![\w])", folded):
                return word
        elif w in folded:
            return word
    return None


def _scalar(node: yaml.Node) -> Any:
    return yaml.constructor.SafeConstructor().construct_object(node, deep=True)


def _to_python(node: yaml.Node, path: tuple[str, ...], lines: dict[tuple[str, ...], int]) -> Any:
    """A composed YAML node as plain data, recording each node's line under its path."""
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = _scalar(key_node)
            out[key] = _to_python(value_node, (*path, str(key)), lines)
            lines[(*path, str(key))] = key_node.start_mark.line + 1
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(item, (*path, str(i)), lines) for i, item in enumerate(node.value)]
    return _scalar(node)


def _load(path: Path) -> tuple[Any, dict[tuple[str, ...], int]]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CreativeInputError([Problem(str(path), 1, f"cannot read the tone file ({exc})")]) from exc
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        raise CreativeInputError([Problem(str(path), line, f"not valid YAML ({exc})")]) from exc
    if node is None:
        raise CreativeInputError([Problem(str(path), 1, "the tone file is empty")])
    lines: dict[tuple[str, ...], int] = {}
    return _to_python(node, (), lines), lines


def _templates(
    tone: ToneFile, where: str, lines: dict[tuple[str, ...], int]
) -> tuple[dict[str, dict[str, list[Template]]], list[Problem]]:
    """Each locale's templates that parse and say no banned word, and a problem for each other."""
    problems: list[Problem] = []
    templates: dict[str, dict[str, list[Template]]] = {}
    banned_words = tone.rules.banned_words
    for locale, lt in tone.locales.items():
        templates[locale] = {}
        for part in PARTS:
            templates[locale][part] = []
            for i, text in enumerate(getattr(lt, part)):
                line = lines.get(("locales", locale, part, str(i)), 1)
                slots, why = parse_template(text)
                banned = banned_in(text, banned_words) if why is None else None
                if why is None and banned is not None:
                    why = f"contains the banned word {banned!r}"
                if why is not None:
                    problems.append(Problem(where, line, f"{part} template {text!r} {why}"))
                    continue
                templates[locale][part].append(Template(part, i, text, slots, line))  # type: ignore[arg-type]
        banned = banned_in(lt.disclosure, banned_words)
        if banned is not None:
            line = lines.get(("locales", locale, "disclosure"), 1)
            problems.append(
                Problem(where, line, f"disclosure {lt.disclosure!r} has the banned word {banned!r}")
            )
    return templates, problems


def check_tone(path: Path) -> tuple[Tone | None, list[Problem]]:
    """A tone file and its problems: None when it cannot be used at all (unreadable, not YAML,
    not the tone file's shape); otherwise the tone with its valid templates, and one problem for
    each invalid one (assembly can still find the products' problems with the rest)."""
    where = str(path)
    try:
        data, lines = _load(path)
    except CreativeInputError as exc:
        return None, exc.problems
    try:
        tone = ToneFile.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = tuple(str(p) for p in err["loc"])
            line = next((lines[loc[:n]] for n in range(len(loc), -1, -1) if loc[:n] in lines), 1)
            problems.append(Problem(where, line, f"{'.'.join(loc) or 'tone'}: {err['msg']}"))
        return None, problems
    templates, problems = _templates(tone, where, lines)
    return Tone(where, tone.brand, tone.rules, dict(tone.locales), templates, lines), problems


def read_tone(path: Path) -> Tone:
    """Read and check a tone file; raises CreativeInputError naming every problem by line."""
    tone, problems = check_tone(path)
    if problems or tone is None:
        raise CreativeInputError(problems)
    return tone
