"""How the command line presents itself: `-h` beside `--help`, choices listed in help, flags shown as flags,
and `--version`. Kept apart from cli.py, which holds the commands.

Left out: shell completion (off in the app).
"""

from __future__ import annotations

from enum import StrEnum

import typer
from typer.core import TyperOption

from vlmrl.common.distributed import STRATEGIES
from vlmrl.models import TINY_ARCHS

HELP = {"help_option_names": ["-h", "--help"]}
# StrEnums: typer lists their values as the choices in --help, and each member still is the plain string.
Strategy = StrEnum("Strategy", {s: s for s in STRATEGIES})
Arch = StrEnum("Arch", {a: a for a in TINY_ARCHS})
Stage = StrEnum("Stage", {s: s for s in ("baseline", "after")})

# Older typer releases (pyproject allows >=0.12) have no such method and print no `<bool>`: nothing to patch.
_type_of = getattr(TyperOption, "display_type_rich", None)


def _flag_type(self: TyperOption, ctx) -> str | None:
    """typer 0.2x prints `<bool>` beside every flag (`--force <bool>` reads as if it took a value): show none."""
    return None if self.is_flag else _type_of(self, ctx)


if _type_of is not None:
    TyperOption.display_type_rich = _flag_type


def version_line() -> str:
    from vlmrl.common.provenance import git_commit, vlmrl_version

    commit = git_commit()
    return f"vlmrl {vlmrl_version()}" + (f" (git {commit})" if commit else "")


def print_version(value: bool) -> None:
    """An eager `--version` callback."""
    if value:
        typer.echo(version_line())
        raise typer.Exit()
