"""How the command line presents itself: `-h` beside `--help`, choices listed in help, flags shown as flags,
help as wide as the terminal (wide when piped) with no value cut, and `--version`. Kept apart from cli.py, which
holds the commands.

Left out: shell completion (off in the app).
"""

from __future__ import annotations

from enum import StrEnum

import typer
from rich.table import Table
from rich.text import Text
from typer.core import TyperOption

from vlmrl.cli.show import WideConsole
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


class _FoldingTable(Table):
    """typer's help tables build their columns from the first row, each cutting a long value with `…`: here the
    names and types stay whole (no_wrap) and the help column folds a long word onto the next line."""

    def add_row(self, *renderables, **kwargs) -> None:
        implicit = not self.columns
        super().add_row(*renderables, **kwargs)
        if implicit:
            for column in self.columns[:-1]:
                column.no_wrap = True
            self.columns[-1].overflow = "fold"
        if renderables:  # the help cell: rich Columns of Text pieces, each of which would cut on its own
            for piece in getattr(renderables[-1], "renderables", [renderables[-1]]):
                if isinstance(piece, Text):
                    piece.overflow = "fold"


# typer's rich help (typer.rich_utils) makes its console and tables from these two names when it prints: its
# console is then as wide as the terminal, or WIDE when stdout is piped (rich alone would cut at 80 columns).
# A typer without that module prints plain click help: nothing to patch.
try:
    from typer import rich_utils as _rich_help
except ImportError:  # pragma: no cover - typer without rich
    _rich_help = None
if _rich_help is not None and hasattr(_rich_help, "Console") and hasattr(_rich_help, "Table"):
    _rich_help.Console = WideConsole
    _rich_help.Table = _FoldingTable


def version_line() -> str:
    from vlmrl.common.provenance import git_commit, vlmrl_version

    commit = git_commit()
    return f"vlmrl {vlmrl_version()}" + (f" (git {commit})" if commit else "")


def print_version(value: bool) -> None:
    """An eager `--version` callback."""
    if value:
        typer.echo(version_line())
        raise typer.Exit()
