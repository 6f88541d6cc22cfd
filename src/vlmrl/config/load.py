"""The loading side of the config: from a preset name or YAML file and `key.path=value` overrides to the raw
mapping that `vlmrl.config.schema` validates, and from pydantic's errors back to one readable message.

What lives here: the preset names and their files (``vlmrl/config/presets/``), YAML parsing that turns every parser
failure into a `ConfigError` (bounded in size, aliases expanded included, and refusing a key given twice),
overrides, the schema version a run folder's config.yaml must carry (`SCHEMA_VERSION`), and the error text
(unknown keys named with the closest valid key, quoted values cut short).
`load_config`, `validate_config` and `dump_config` stay in `vlmrl.config.schema`, which imports this module (never
the other way round), so the schema is passed in where an error message needs it. Left out: the schema itself, and
resolving paths against the config file's folder (that needs the validated config: `vlmrl.config.schema.load_config`).
"""

from __future__ import annotations

import difflib
import reprlib
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

PRESETS = ("demo", "demo-gpu", "seed", "seed-16gb", "gspo-paper")
# Bounds on a config: the shipped presets are under 4 KB and 500 characters expanded; these leave room for any
# config a person writes and stop a file (or an alias chain) that would take minutes to walk.
MAX_CONFIG_BYTES = 1_000_000
MAX_EXPANDED_SIZE = 2_000_000  # characters of every scalar plus one per collection, aliases expanded
MAX_QUOTED = 200  # characters of a value an error message quotes
MAX_ERRORS = 20  # problems an error message lists


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file, the field and the fix."""


class SchemaVersionError(ConfigError):
    """A config of another schema version than this vlmrl's (`SCHEMA_VERSION`); the message says what to do."""


# The version of the config's layout that `dump_config` writes into every run folder's config.yaml
# (`schema_version:`). Raise it when a field is renamed, moved or removed: a run folder written under another
# version is then refused (`check_schema_version`), never migrated. vlmrl 0.1.0 is the first with it.
SCHEMA_VERSION = 1


def check_schema_version(raw: dict, origin: str, *, run_folder: bool = False) -> None:
    """Refuse a config of another schema version in one line saying what to do. A config file of one's own may
    leave `schema_version` out; a run folder's config.yaml (`run_folder`) must carry this vlmrl's: without it,
    the folder was written by a development version from before schema versions."""
    version = raw.get("schema_version")
    if version == SCHEMA_VERSION and not isinstance(version, bool):
        return
    if run_folder:
        found = "no schema_version" if "schema_version" not in raw else f"schema_version {quoted(version)}"
        raise SchemaVersionError(
            f"{origin}: {found}, this vlmrl reads schema_version {SCHEMA_VERSION}: the run folder was written by "
            "another version and is not resumed; run your config under another run.name (a new run folder), or "
            "with --force to replace what vlmrl wrote in this one.")
    if "schema_version" in raw:
        raise SchemaVersionError(
            f"{origin}: schema_version {quoted(version)}, this vlmrl reads schema_version {SCHEMA_VERSION}: delete the "
            "line and check the file's fields against docs/config.md.")


def check_trl_overrides(raw: dict, origin: str) -> None:
    """`train.trl_overrides` is a mapping (a list or a scalar there is named in one line)."""
    train = raw.get("train")
    if isinstance(train, dict) and not isinstance(train.get("trl_overrides", {}), dict):
        given = train["trl_overrides"]
        raise ConfigError(f"{origin}: train.trl_overrides must be a mapping of GRPOConfig fields (e.g. {{beta: 0.04}}), "
                          f"got {type(given).__name__} {quoted(given)}.")


def refuse_reward_weights(raw: dict, origin: str) -> None:
    """`train.reward_weights` (GRPOConfig's name for the weights) is refused with the `rewards:` list that sets them."""
    train = raw.get("train")
    if not (isinstance(train, dict) and "reward_weights" in train):
        return
    old = train["reward_weights"]
    fmt, cor = old if isinstance(old, list) and len(old) == 2 else (0.3, 1.0)
    raise ConfigError(
        f"{origin}: train.reward_weights: vlmrl takes the weights from the top-level `rewards:` list; write "
        f"`rewards: [{{name: format, weight: {quoted(fmt)}}}, {{name: correctness, weight: {quoted(cor)}}}]` "
        "(and add `{function: my_rewards.py:name, weight: ...}` entries for your own)."
    )


def read_source(source: str) -> tuple[dict, str]:
    """(the parsed mapping, where it came from) for a preset name or a YAML file path."""
    if source in PRESETS:
        text = resources.files("vlmrl.config.presets").joinpath(f"{source}.yaml").read_text()
        origin = f"preset {source}"
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"{clip(source)}: no such config file and not a preset (presets: {', '.join(PRESETS)}).")
        if (size := path.stat().st_size) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{source}: {size} bytes; a config file holds at most {MAX_CONFIG_BYTES} "
                              "(put data in data.source, code in a reward file).")
        text = path.read_text(errors="replace")
        origin = str(path)
    try:
        raw = _parse_yaml(text)
    except ConfigError as exc:
        raise ConfigError(f"{origin}: {exc}") from None
    except Exception as exc:  # noqa: BLE001  see _parse_yaml
        first_line = (str(exc) or type(exc).__name__).splitlines()[0]
        raise ConfigError(f"{origin}: not valid YAML ({clip(first_line)}).") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{origin}: the top level must be a mapping of sections, got {type(raw).__name__}.")
    return raw, origin


def apply_override(raw: dict, item: str) -> None:
    """Set `section.field=value` in the raw mapping; the value is YAML when it parses, else the text as typed.
    A mapping given to `train.trl_overrides` adds to the entries already there (a preset's scheduler or clip
    range lives there too), key by key."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {quoted(item)}: expected section.field=value, e.g. train.learning_rate=1e-5.")
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {quoted(item)}: {clip(part)} is not a section.")
        node = child
    before = node.get(parts[-1])
    try:
        node[parts[-1]] = _parse_yaml(value)
    except ConfigError as exc:  # YAML, but too large or with a key twice: not something to keep as text
        raise ConfigError(f"override {clip(key)}: {exc}") from None
    except Exception:  # noqa: BLE001  not YAML: keep the text as typed, and let validation judge it
        node[parts[-1]] = value
    if parts == ["train", "trl_overrides"] and isinstance(before, dict) and isinstance(node[parts[-1]], dict):
        node[parts[-1]] = {**before, **node[parts[-1]]}


def _parse_yaml(text: str) -> Any:
    """yaml.safe_load, bounded, with every key once per mapping: at most MAX_CONFIG_BYTES of text and
    MAX_EXPANDED_SIZE once its aliases are expanded (a 2 KB file of nested aliases expands to gigabytes in
    whatever walks it: validation, an error message), both a ConfigError, as is a key given twice (YAML keeps
    the last one silently). PyYAML's constructors raise plain ValueError, IndexError, AttributeError or
    RecursionError (not YAMLError) on some inputs (`2001-13-01`, `!!int x`, `!!timestamp x`, 5000 nested `[`):
    callers treat any other exception here as "not valid YAML" (found by tests/test_fuzz_config.py).

    >>> _parse_yaml("a: &x [1, 2]\\nb: *x")
    {'a': [1, 2], 'b': [1, 2]}
    >>> _parse_yaml("a: 1\\nb: 2\\na: 3")
    Traceback (most recent call last):
    vlmrl.config.load.ConfigError: line 3: key 'a' given twice in one mapping (first on line 1); keep one.
    """
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{len(text)} characters; a config holds at most {MAX_CONFIG_BYTES}.")
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node) > MAX_EXPANDED_SIZE:
            raise ConfigError(f"over {MAX_EXPANDED_SIZE} characters once its aliases (*name) are expanded; "
                              "write the values out, or use fewer aliases.")
        return loader.construct_document(node)
    finally:
        loader.dispose()


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (a `<<: *merge` key may be overridden)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[tuple[str, str], int] = {}
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                line = key.start_mark.line + 1
                if (key.tag, key.value) in seen:
                    raise ConfigError(f"line {line}: key {clip(key.value)!r} given twice in one mapping (first on "
                                      f"line {seen[key.tag, key.value]}); keep one.")
                seen[key.tag, key.value] = line
        return super().construct_mapping(node, deep=deep)


def _expanded_size(root: yaml.Node) -> int:
    """Characters and collections of the document with every alias expanded, capped just past
    MAX_EXPANDED_SIZE: each node walked once (aliases share nodes), without recursion (a deep document must not
    exhaust the stack). An alias inside its own anchor (an endless value) is a ConfigError."""
    sizes: dict[int, int] = {}
    entered: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        children = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                    else [] if isinstance(node, yaml.ScalarNode) else node.value)
        if done:  # every child is sized now, unless it is this node or one above it
            if any(id(c) not in sizes for c in children):
                raise ConfigError(f"line {node.start_mark.line + 1}: an alias inside its own anchor (an endless "
                                  "value); write the value out.")
            sizes[id(node)] = min(1 + sum(sizes[id(c)] for c in children), MAX_EXPANDED_SIZE + 1)
        elif id(node) not in entered:
            entered.add(id(node))
            if isinstance(node, yaml.ScalarNode):
                sizes[id(node)] = 1 + len(node.value)
            else:
                stack.append((node, True))
                stack.extend((c, False) for c in children)
    return sizes[id(root)]


def clip(text: Any, limit: int = MAX_QUOTED) -> str:
    """`text` (str() of it) cut to `limit` characters, saying how long it was: what a message quotes of a value.

    >>> clip("x" * 500, 10)
    'xxxxxxxxxx... (500 characters)'
    """
    text = text if isinstance(text, str) else str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def quoted(value: Any, limit: int = MAX_QUOTED) -> str:
    """repr() of a value for a message, bounded in length and in the work it takes (a value may nest deeply or
    hold a long string many times over).

    >>> quoted([1, "a"]), len(quoted(["x" * 10_000] * 1000)) < 2 * MAX_QUOTED
    ("[1, 'a']", True)
    """
    short = reprlib.Repr()
    short.maxstring, short.maxother, short.maxlevel = limit, limit, 4
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = 8
    return clip(short.repr(value), limit)


def describe_errors(exc: ValidationError, origin: str, root: type[BaseModel]) -> str:
    """pydantic's errors as one message: each field's path and problem, unknown keys with the closest
    valid one (`root` is the schema searched, `vlmrl.config.schema.Config`)."""
    lines = [f"{origin}: invalid configuration"]
    errors = exc.errors(include_url=False)
    for err in errors[:MAX_ERRORS]:
        loc = clip(".".join(str(p) for p in err["loc"]))
        if "entry" in err.get("ctx", {}):  # about one entry of a mapping field (train.trl_overrides.beta)
            loc, err = f"{loc}.{clip(err['ctx']['entry'])}", {**err, "input": err["ctx"]["value"]}
        if err["type"] == "extra_forbidden":
            lines.append(f"  unknown key {loc!r}{_suggest(err['loc'], root)}")
        else:
            msg = clip(err["msg"].removeprefix("Value error, "), 4 * MAX_QUOTED)
            lines.append(f"  {loc or '(config)'}: {msg}" + (f" (got {quoted(err['input'])})" if loc else ""))
    if len(errors) > MAX_ERRORS:
        lines.append(f"  ... and {len(errors) - MAX_ERRORS} more")
    return "\n".join(lines)


def _suggest(loc: tuple, root: type[BaseModel]) -> str:
    if len(loc) == 1:  # a flat, TRL-style key at the top level: point to the section that holds it
        homes = _sections_holding(str(loc[0]), root)
        if homes:
            return f"; did you mean {' or '.join(repr(h) for h in homes)}? (fields live in their section)"
    model = root
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        model = annotation
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.5)
    prefix = ".".join(str(p) for p in loc[:-1])
    return f"; did you mean '{prefix + '.' if prefix else ''}{close[0]}'?" if close else ""


def _sections_holding(name: str, root: type[BaseModel]) -> list[str]:
    """`section.name` for every section with a field `name`.

    >>> from vlmrl.config.schema import Config  # only here: this module never imports the schema
    >>> _sections_holding("report_to", Config)
    ['train.report_to']
    >>> _sections_holding("nonsense", Config)
    []
    """
    return [f"{section}.{name}" for section, field in root.model_fields.items()
            if name in getattr(field.annotation, "model_fields", {})]
