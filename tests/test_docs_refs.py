"""The README and docs/ name real things: modules, files, commands, flags, config fields.

A user reads README.md and docs/*.md before the code, so every reference there that can be checked mechanically
is checked here:
- each `vlmrl.<module>[.<name>]` dotted name (and `from vlmrl.x import y`, and a code span such as
  `pipeline.settings_fingerprint` that starts with a vlmrl module) resolves to a module file under src/ and a
  definition in it;
- each `src/vlmrl/...`, `benchmarks/...`, `docs/...`, `tests/...`, `examples/...` path exists (`{a,b}` and `*`
  expanded), and each relative markdown link resolves;
- each `section.field` is a field of `Config`, and each `VLMRL_*` variable is read by some code;
- every `--flag` of a `vlmrl <command>` shown in code (fenced blocks and inline spans) is in that command's --help;
- the README's Layout block names existing files and every module and package of src/vlmrl/, and
  benchmarks/README.md names every script in benchmarks/.

Left out: prose claims (what a function does, default values, measured figures), which need a reader, and
option values (`--strategy fsdp`). Modules are resolved by reading their source with `ast`, not by importing
them: no torch import, no model load, about two seconds for the file.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
# Paths the docs name that a command writes, not the repository: path -> the file that writes it.
GENERATED = {"examples/shapes_quiz/data/": "examples/shapes_quiz/make_data.py"}

DOTTED = re.compile(r"(?<![\w./-])vlmrl(?:\.\w+)+\*?")
PATH = re.compile(r"(?<![\w/.-])((?:src/vlmrl|benchmarks|docs|tests|examples)/[\w./*{},-]*)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
FIELD = re.compile(r"(?<![\w./-])(run|model|lora|data|eval|train|health|export)\.([a-z_][a-z0-9_]*)(?![\w/])")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
INLINE = re.compile(r"`((?:[^`\n]|\n(?!\n))+)`")  # a span may wrap onto the next line
COMMAND = re.compile(r"(?:^|[\s/(])vlmrl((?:\s+--[\w-]+)*)\s+([a-z][a-z-]*(?:\|[a-z][a-z-]*)*)(?=\s|$)")
# `train.jsonl`, `export.json`, `data.md`: file names, not `section.field`.
FILE_SUFFIXES = {"json", "jsonl", "md", "py", "yaml", "html", "parquet", "csv"}


def _docs() -> list[tuple[Path, str]]:
    return [(p, p.read_text()) for p in DOCS if p.is_file()]


def _where(path: Path, text: str, pos: int) -> str:
    return f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, pos) + 1}"


# --- dotted module names -------------------------------------------------------------------------------------


def _module_file(parts: list[str]) -> Path | None:
    """src/vlmrl/a/b.py or src/vlmrl/a/b/__init__.py for ["vlmrl", "a", "b"]."""
    base = SRC.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@cache
def _names(path: Path) -> dict[str, ast.AST | None]:
    """Top-level names a module defines or imports (classes map to their node, for `Class.method`)."""
    names: dict[str, ast.AST | None] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node if isinstance(node, ast.ClassDef) else None
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names[leaf.id] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = None
    return names


def resolve_dotted(ref: str) -> str | None:
    """None when `vlmrl.a.b.name` names a module file and a definition in it, else what is missing.

    A trailing `*` (`vlmrl.common.io.write_*`) asks for some name with that prefix.

    >>> resolve_dotted("vlmrl.grading.grader.grade") is None
    True
    >>> resolve_dotted("vlmrl.engine.rollout.nosuchmodule")
    'no module vlmrl.engine.rollout.nosuchmodule, nor nosuchmodule in vlmrl.engine.rollout'
    """
    prefix = ref.endswith("*")
    parts = ref.rstrip("*").split(".")
    for cut in range(len(parts), 0, -1):
        module = _module_file(parts[:cut])
        if module is not None:
            break
    else:
        return f"no module {ref}"
    rest = parts[cut:]
    if not rest:
        return None
    scope: dict[str, ast.AST | None] = _names(module)
    for i, name in enumerate(rest):
        last = i == len(rest) - 1
        if last and prefix:
            if not any(n.startswith(name) for n in scope):
                return f"nothing named {name}* in {'.'.join(parts[:cut])}"
            return None
        if name not in scope:
            return f"no module {'.'.join(parts[: cut + i + 1])}, nor {name} in {'.'.join(parts[: cut + i])}"
        node = scope[name]
        if not last:
            if not isinstance(node, ast.ClassDef):
                return f"{name} in {'.'.join(parts[:cut])} is not a class with members"
            scope = {
                n.name: None for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            }
    return None


def test_dotted_names_resolve() -> None:
    broken = []
    for path, text in _docs():
        for m in DOTTED.finditer(text):
            problem = resolve_dotted(m.group(0))
            if problem:
                broken.append(f"{_where(path, text, m.start())}: `{m.group(0)}`: {problem}")
    assert not broken, "\n".join(broken)


# Train fields of development versions before 0.1.0 that the benchmark notes name when telling an experiment's
# history (benchmarks/README.md): no config has them (a config naming one is refused as an unknown key).
HISTORICAL_FIELDS = {f"train.{name}" for name in (
    "rollout_stacked", "rollout_adapter_copies", "rollout_stacked_kernel", "rollout_decode_kernel", "loss_kernels",
    "trim_padding", "group_by_length", "rollout_merge", "rollout_guards", "rollout_filled_window",
    "adapter_input_cast", "fast_generation", "reward_weights")}


def _config_fields() -> set[str]:
    from pydantic import BaseModel

    from vlmrl.config.schema import Config

    fields: set[str] = set()

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            fields.add(prefix + name)
            if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
                walk(info.annotation, f"{prefix}{name}.")

    walk(Config, "")
    return fields


def test_short_module_names_resolve() -> None:
    """`pipeline.settings_fingerprint`, `rollout.fast.deferred_stop_check`: a code span whose first part is a
    vlmrl module names something in it (config fields such as `train.optim` and files such as `train.jsonl`
    are not module names)."""
    fields = _config_fields() | HISTORICAL_FIELDS
    broken = []
    for path, text in _docs():
        for m in re.finditer(r"`([a-z_]\w*(?:\.\w+)+)(?:\(\))?`", text):
            ref = m.group(1)
            first, last = ref.split(".")[0], ref.split(".")[-1]
            if ref in fields or last in FILE_SUFFIXES or _module_file(["vlmrl", first]) is None:
                continue
            problem = resolve_dotted(f"vlmrl.{ref}")
            if problem:
                broken.append(f"{_where(path, text, m.start())}: `{ref}`: {problem}")
    assert not broken, "\n".join(broken)


def test_imports_in_code_resolve() -> None:
    """`from vlmrl.report import write_report` in a docs example imports names that exist."""
    broken = []
    for path, text in _docs():
        for m in re.finditer(r"from (vlmrl(?:\.\w+)*) import ([\w, ]+?)(?: as \w+)?(?=[;\n)\"'`]|$)", text):
            for name in (n.strip() for n in m.group(2).split(",")):
                problem = resolve_dotted(f"{m.group(1)}.{name}")
                if problem:
                    broken.append(f"{_where(path, text, m.start())}: `{m.group(0)}`: {problem}")
    assert not broken, "\n".join(broken)


# --- paths and links ---------------------------------------------------------------------------------------


def expand(pattern: str) -> list[str]:
    """One level of `{a,b}` alternatives.

    >>> expand("results/x.{md,json}")
    ['results/x.md', 'results/x.json']
    >>> expand("docs/data.md")
    ['docs/data.md']
    """
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [pattern[: m.start()] + alt + pattern[m.end() :] for alt in m.group(1).split(",")]


def _exists(relative: str, base: Path = ROOT) -> bool:
    if "*" in relative:
        return any(base.glob(relative.rstrip("/")))
    return (base / relative).exists()


def test_paths_exist() -> None:
    broken = []
    for path, text in _docs():
        for m in PATH.finditer(text):
            ref = m.group(1).rstrip(".,:;")
            if ref in GENERATED:
                assert (ROOT / GENERATED[ref]).is_file(), GENERATED[ref]
                continue
            missing = [p for p in expand(ref) if not _exists(p)]
            if missing:
                broken.append(f"{_where(path, text, m.start())}: `{ref}` ({', '.join(missing)} missing)")
    assert not broken, "\n".join(broken)


def test_markdown_links_resolve() -> None:
    broken = []
    for path, text in _docs():
        for m in LINK.finditer(text):
            target = m.group(1).split("#")[0]
            if not target or re.match(r"[a-z]+:", target):
                continue
            if not (path.parent / target).exists():
                broken.append(f"{_where(path, text, m.start())}: link to {target}")
    assert not broken, "\n".join(broken)


def test_config_fields_exist() -> None:
    """`train.rollout.fast` and the like are fields of Config (run outputs such as `train.jsonl` are not fields)."""
    fields = _config_fields()
    refused = HISTORICAL_FIELDS  # named where the docs tell their history, or what is refused (docs/rewards.md)
    broken = []
    for path, text in _docs():
        for m in FIELD.finditer(text):
            name = f"{m.group(1)}.{m.group(2)}"
            if (
                name in fields
                or name in refused
                or m.group(2) in FILE_SUFFIXES
                or text[m.end() : m.end() + 1] == "("
            ):
                continue  # a field, or a file such as `train.jsonl`, or a call such as `model.dequantize()`
            broken.append(f"{_where(path, text, m.start())}: `{name}` is not a config field")
    assert not broken, "\n".join(broken)


def test_benchmarks_readme_names_every_script() -> None:
    """benchmarks/README.md's table is the index of benchmarks/: a script added there must be listed."""
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    scripts = sorted(p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".sh", ".py"))
    assert scripts and not [s for s in scripts if f"`{s}`" not in readme], (
        "scripts missing from benchmarks/README.md"
    )


def test_environment_variables_exist() -> None:
    """Every `VLMRL_*` name the docs tell a user to set is read somewhere in src/ or benchmarks/."""
    code = "\n".join(
        p.read_text()
        for root in (SRC, ROOT / "benchmarks")
        for p in root.rglob("*")
        if p.suffix in (".py", ".sh")
    )
    broken = []
    for path, text in _docs():
        for m in re.finditer(r"\bVLMRL_[A-Z_]+\b", text):
            if m.group(0) not in code:
                broken.append(f"{_where(path, text, m.start())}: {m.group(0)} is read nowhere")
    assert not broken, "\n".join(broken)


# --- the Layout block ----------------------------------------------------------------------------------------


def _layout_block() -> str:
    text = (ROOT / "README.md").read_text()
    assert "\n## Layout" in text, "README has no Layout section"
    section = text.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    blocks = FENCE.findall(section)
    assert blocks, "README's Layout section has no code block"
    return blocks[0]


def test_layout_names_existing_files() -> None:
    block = _layout_block()
    base = SRC / "vlmrl"
    broken = []
    for line in block.splitlines()[1:]:
        left = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        for entry in re.findall(r"[\w*]+\.py|\w+(?:/\w+)*/", left):  # `engine/loss/`: a package inside one
            if not (any(base.glob(entry)) if "*" in entry else (base / entry).exists()):
                broken.append(f"src/vlmrl/{entry}")
    assert not broken, f"README Layout names missing files: {broken}"


def test_layout_names_every_module_and_package() -> None:
    """A new user reads the Layout block as the map of src/vlmrl/: every top-level module and package is on it."""
    block = _layout_block()
    named = set(re.findall(r"\w+(?=\.py|/)", block))
    entries = [p for p in (SRC / "vlmrl").iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()]
    unnamed = sorted(p.name for p in entries if p.stem not in named and p.name != "__init__.py")
    assert not unnamed, f"README Layout does not name: {unnamed}"


def _packages() -> list[Path]:
    return sorted(p.parent for p in (SRC / "vlmrl").rglob("__init__.py") if p.parent != SRC / "vlmrl")


@pytest.mark.parametrize("package", _packages(), ids=lambda p: str(p.relative_to(SRC / "vlmrl")))
def test_layout_lists_every_module_of_every_package(package: Path) -> None:
    """The Layout names each package and each of its modules; a module added later must be named too."""
    words = set(re.findall(r"\w+", _layout_block()))
    modules = sorted(p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert package.name in words and not [m for m in modules if m not in words], (
        f"{package.relative_to(SRC / 'vlmrl')}/: the Layout does not name {[m for m in modules if m not in words]}")


# --- commands and flags ---------------------------------------------------------------------------------------


def _options(help_text: str) -> dict[str, frozenset[str] | None]:
    """The options of a rendered --help: each row's leading `--x` / `-x` tokens, with the choices that row lists
    (`--strategy <ddp|fsdp|zero2|zero3>`), or None for a free value or a flag."""
    options: dict[str, frozenset[str] | None] = {}
    for line in help_text.splitlines():
        row = line.strip().lstrip("│|").strip().split()
        names = [t for t in row[: next((k for k, t in enumerate(row) if not t.startswith("-")), len(row))]]
        rest = row[len(names) :]
        choice = re.fullmatch(r"<([\w-]+(?:\|[\w-]+)+)>", rest[0]) if rest else None
        for name in names:
            options[name] = frozenset(choice.group(1).split("|")) if choice else None
    return options


@cache
def _help(command: str) -> dict[str, frozenset[str] | None] | None:
    """Options in `vlmrl [command] --help`, rendered in-process; None for an unknown command."""
    from typer.testing import CliRunner

    from vlmrl.cli.app import app

    args = [*command.split(), "--help"] if command else ["--help"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200", "NO_COLOR": "1"})
    if result.exit_code != 0:
        return None
    return _options(result.output)


def _code_lines() -> list[tuple[str, str]]:
    """(where, line) for each line of a fenced block (backslash continuations joined) and each inline span."""
    lines = []
    for path, text in _docs():
        for m in FENCE.finditer(text):
            joined = m.group(1).replace("\\\n", " ")
            for offset, line in enumerate(joined.splitlines()):
                lines.append((_where(path, text, m.start(1)) + f"+{offset}", line))
        prose = FENCE.sub(lambda f: "\n" * f.group(0).count("\n"), text)  # same line numbers, no blocks
        for m in INLINE.finditer(prose):
            lines.append((_where(path, prose, m.start()), m.group(1).replace("\n", " ").replace("\\|", "|")))
    return lines


def commands_in(line: str) -> list[tuple[str, str]]:
    """(command, the rest of its invocation) for each `vlmrl <command> ...` in a line of code, comments dropped.

    >>> commands_in("vlmrl train CONFIG --gpus 2   # FSDP2 --not-this")
    [('train', 'CONFIG --gpus 2')]
    >>> commands_in("vlmrl config show seed && vlmrl --debug train|eval X")
    [('config show', 'seed'), ('', '--debug'), ('train', 'X'), ('eval', 'X')]
    """
    code = re.split(r"\s#", line, maxsplit=1)[0]
    found = []
    matches = list(COMMAND.finditer(code))
    for i, m in enumerate(matches):
        tail = code[m.end() : matches[i + 1].start() if i + 1 < len(matches) else len(code)]
        tail = re.split(r"\s(?:&&|;|\|)(?:\s|$)", tail, maxsplit=1)[0].strip()
        if m.group(1).strip():
            found.append(("", m.group(1).strip()))
        for command in m.group(2).split("|"):
            sub = re.match(r"(show|validate)\b", tail) if command == "config" else None
            found.append((f"config {sub.group(1)}", tail[sub.end() :].strip()) if sub else (command, tail))
    return found


def flags_of(line: str) -> list[tuple[str, list[str]]]:
    """(command, its `--flags`) for each command in a line of code.

    >>> flags_of("vlmrl train CONFIG --gpus 2 --strategy fsdp   # FSDP2 --not-this")
    [('train', ['--gpus', '--strategy'])]
    >>> flags_of("vlmrl config show seed --set run.name=x")
    [('config show', ['--set'])]
    >>> flags_of("vlmrl --debug train|eval X --nodes 2")
    [('', ['--debug']), ('train', ['--nodes']), ('eval', ['--nodes'])]
    """
    return [(command, re.findall(r"(?<![\w-])--[\w-]+", tail)) for command, tail in commands_in(line)]


def _placeholder(token: str) -> bool:
    """`CONFIG`, `RUN_DIR`, `$COMMON`, `...`, `[--private]`: written for the reader to fill in."""
    return not re.fullmatch(r"[a-z0-9][\w.|-]*", token)


def test_command_flags_exist() -> None:
    broken = []  # an unknown command, or a flag its --help does not list
    for where, line in _code_lines():
        for command, flags in flags_of(line):
            options = _help(command)
            if options is None:
                broken.append(f"{where}: `vlmrl {command}` is not a command ({line.strip()})")
                continue
            broken += [f"{where}: `vlmrl {command}` has no {f} ({line})" for f in flags if f not in options]
    assert not broken, "\n".join(broken)


def test_option_values_and_presets_exist() -> None:
    """`--strategy fsdp` is one of the listed choices, and `vlmrl run seed` names a preset."""
    from vlmrl.config.load import PRESETS

    takes_config = {"run", "prepare", "eval", "train", "export", "config show", "config validate"}
    broken = []
    for where, line in _code_lines():
        for command, tail in commands_in(line):
            options, tokens = _help(command) or {}, tail.split()
            for k, token in enumerate(tokens[:-1]):
                choices, value = options.get(token), tokens[k + 1]
                if choices and not _placeholder(value) and not set(value.split("|")) <= choices:
                    broken.append(f"{where}: `vlmrl {command} {token} {value}`: not one of {sorted(choices)}")
            first = tokens[0] if command in takes_config and tokens else ""
            if command == "doctor" and "--config" in tokens[:-1]:  # `vlmrl doctor --config seed`
                first = tokens[tokens.index("--config") + 1]
            named = first and not _placeholder(first) and "/" not in first and not first.endswith(".yaml")
            if named and first not in PRESETS:
                broken.append(
                    f"{where}: `vlmrl {command} ... {first}`: no preset {first!r} ({', '.join(PRESETS)})"
                )
    assert not broken, "\n".join(broken)


def test_the_checks_can_fail() -> None:
    """Each checker reports a reference that does not exist (so a pass above means something)."""
    assert resolve_dotted("vlmrl.fastgen") == "no module vlmrl.fastgen, nor fastgen in vlmrl"
    assert resolve_dotted("vlmrl.engine.rollout.fast.no_such_function") is not None
    assert resolve_dotted("vlmrl.common.io.write_*") is None and resolve_dotted("vlmrl.common.io.nothing_*") is not None
    assert not _exists("src/vlmrl/fastgen.py") and _exists("src/vlmrl/engine/rollout/fast.py")
    assert flags_of("vlmrl train X --no-such-flag") == [("train", ["--no-such-flag"])]
    assert "--no-such-flag" not in (_help("train") or {}) and "--gpus" in (_help("train") or {})
    assert (_help("train") or {})["--strategy"] == {"ddp", "fsdp", "zero2", "zero3"}
    assert _help("fastgen") is None


def test_doctests_of_this_file() -> None:
    import doctest
    import sys

    result = doctest.testmod(sys.modules[__name__])
    assert result.attempted and not result.failed
