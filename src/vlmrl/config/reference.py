"""The config reference, docs/config.md, generated from the schema's `Field` descriptions: one table per section
(field, type, default, description), the top-level fields first. Regenerate it after a schema edit with

    python -m vlmrl.config.reference > docs/config.md

(tests/test_config_reference.py fails, printing that command, while the file differs from `render()`).
"""

from __future__ import annotations

import types
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from vlmrl.config.fingerprints import section_of
from vlmrl.config.schema import Config

COMMAND = "python -m vlmrl.config.reference > docs/config.md"

_HEADER = f"""# Config reference

Every field of a vlmrl config, as `vlmrl config show --all` prints them, with its type, its default and what it
does. Generated from the schema (`vlmrl.config.sections`, `vlmrl.config.train_section`, `vlmrl.config.schema`)
by `{COMMAND}`: edit the descriptions there, not here (`tests/test_config_reference.py` fails
while this file is stale). Which fields decide which stage's outputs, and so which change makes a stage run
again, is `vlmrl.config.fingerprints`.
"""


def render() -> str:
    """docs/config.md's text."""
    parts = [_HEADER]
    top = [(name, info) for name, info in Config.model_fields.items() if section_of(info.annotation) is None]
    parts.append(_table("Top level", "Fields outside any section.", top, ""))
    for name, info in Config.model_fields.items():
        if (inner := section_of(info.annotation)) is not None:
            about = (info.description or "") + (f" Default: {_default(info)}." if inner[1] else "")
            parts.extend(_sections(inner[0], name + ("[]" if inner[1] else ""), about))
    return "\n".join(parts)


def _sections(model: type[BaseModel], path: str, about: str) -> list[str]:
    """The table of `model` (at `path`), then those of its sub-sections."""
    rows = [(name, info) for name, info in model.model_fields.items() if section_of(info.annotation) is None]
    out = [_table(f"`{path}`", about, rows, path + ".")]
    for name, info in model.model_fields.items():
        if (inner := section_of(info.annotation)) is not None:
            out.extend(_sections(inner[0], f"{path}.{name}{'[]' if inner[1] else ''}", info.description or ""))
    return out


def _table(title: str, about: str, rows: list[tuple[str, FieldInfo]], prefix: str) -> str:
    lines = [f"## {title}", "", about, "", "| field | type | default | description |", "|---|---|---|---|"]
    for name, info in rows:
        lines.append(f"| `{prefix}{name}` | {_cell(_type(info))} | {_cell(_default(info))} | "
                     f"{_cell(info.description or '')} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """Text for a table cell: one line, its pipes escaped (GitHub renders `\\|` as | in code spans too)."""
    return " ".join(text.split()).replace("|", "\\|")


def _type(info: FieldInfo) -> str:
    """The field's type in words, with its bounds: `int, > 0, <= 1024`; `one of: auto, always, never`."""
    bounds = []
    for item in info.metadata:
        for kind, sign, attr in ((Gt, ">", "gt"), (Ge, ">=", "ge"), (Lt, "<", "lt"), (Le, "<=", "le"),
                                 (MinLen, "length >=", "min_length"), (MaxLen, "length <=", "max_length")):
            if isinstance(item, kind):
                value = getattr(item, attr)
                bounds.append(f"{sign} {value:_}" if isinstance(value, int) and value >= 10_000 else f"{sign} {value}")
    return ", ".join([_annotation(info.annotation), *bounds])


def _annotation(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        inner = " or ".join(_annotation(a) for a in kept)
        return f"{inner} or null" if len(kept) < len(args) else inner
    if origin is list:
        return f"list of ({_annotation(args[0])})" if get_origin(args[0]) is Literal else f"list of {_annotation(args[0])}"
    if origin is tuple:
        return "[" + ", ".join(_annotation(a) for a in args) + "]"
    if origin is dict:
        return f"mapping of {_annotation(args[0])} to {_annotation(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "entries as below"
    return {str: "text", int: "integer", float: "number", bool: "true or false"}.get(annotation, "any value")


def _default(info: FieldInfo) -> str:
    value = info.default_factory() if info.default_factory is not None else info.default  # type: ignore[call-arg]
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, list):
        value = [v.model_dump(mode="json", exclude_none=True, exclude={"timeout_s", "columns"})
                 if isinstance(v, BaseModel) else v for v in value]
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return f"`{text.removesuffix('...').strip()}`"


if __name__ == "__main__":
    print(render(), end="")
