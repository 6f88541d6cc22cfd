"""docs/config.md is the config reference generated from the schema's `Field` descriptions, and it is current."""

from __future__ import annotations

from pathlib import Path

from vlmrl.config.fingerprints import schema_fields, section_of
from vlmrl.config.reference import COMMAND, render
from vlmrl.config.schema import Config

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_docs_config_md_is_current():
    assert REFERENCE.read_text() == render(), f"docs/config.md is stale; regenerate it: {COMMAND}"


def test_every_field_and_section_has_a_description_and_a_row():
    def undescribed(model, prefix=""):
        for name, info in model.model_fields.items():
            if not (info.description or "").strip():
                yield prefix + name
            if (inner := section_of(info.annotation)) is not None:
                yield from undescribed(inner[0], f"{prefix}{name}{'[]' if inner[1] else ''}.")

    assert not list(undescribed(Config)), "give these fields a short, user-facing description"
    text = render()
    assert not [path for path in schema_fields(Config) if f"| `{path}` |" not in text]
