"""The architecture is a contract the suite checks: import-linter's layers in pyproject.toml, no import circle.

`lint-imports` reads `[tool.importlinter]` and counts imports inside functions too. The second test proves the
check can fail: a copy of the package with one import added up a layer (the common base importing the CLI)
breaks the contract.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_the_layers_contract_holds() -> None:
    done = _lint(ROOT, ROOT / "src")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "BROKEN" not in done.stdout and done.stdout.count("KEPT") >= 2


def test_an_upward_import_breaks_it(tmp_path: Path) -> None:
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(ROOT / "src" / "vlmrl", tmp_path / "src" / "vlmrl",
                    ignore=shutil.ignore_patterns("__pycache__", "*.yaml", "*.json"))
    io = tmp_path / "src" / "vlmrl" / "common" / "io.py"
    io.write_text(io.read_text() + "\n\ndef _upward():\n    from vlmrl.train import stage  # noqa: F401\n")
    done = _lint(tmp_path, tmp_path / "src")
    assert done.returncode != 0
    assert "vlmrl.common is not allowed to import vlmrl.train" in done.stdout


def test_no_import_circle() -> None:
    """No module reaches itself through imports (within a layer too, which the layers contract allows)."""
    import grimp  # import-linter's graph builder

    graph = grimp.build_graph("vlmrl", cache_dir=None)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.find_modules_directly_imported_by(module)):
            if state.get(target) == 1:
                circles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph.modules):
        if module not in state:
            visit(module, [module])
    assert not circles, circles[:3]
