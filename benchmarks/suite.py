"""Rerun a published claim, or rewrite it from its results file.

Every figure README.md and docs/ publish as vlmrl's comes from one claim record, `benchmarks/claims/<id>.json`.
Its suite, `benchmarks/suites/<id>.json`, says how to measure it again:

  what         one line
  device       what the commands need, and what measured the results (the claim's device where the file has none)
  shared_host  whether the committed results ran beside other jobs on their host (or "alias:path" to read it)
  commands     shell commands, run in order from the repository root; {out} is the output folder
  fresh        alias -> the file a rerun writes, under {out}
  results      alias -> the committed results file the claim is read from (benchmarks/results/...)
  numbers      name -> "alias:path" in that file: dotted keys and [i] list indexes; "[*]" takes every item and
               needs a reduction, "min(...)" or "max(...)"; "A / B" divides two such paths
  meta         git_commit / versions / device / command -> "alias:path" (a path the file lacks gives null; a
               value without a colon is taken as written, e.g. the commit of a file that does not name it;
               without a command, the claim's is the suite's commands)
  note         optional: what a reader of the claim must know (what ran beside it, what is not measured)

    python benchmarks/suite.py --list                 the claims, their ids and what they say
    python benchmarks/suite.py ID [--out DIR]         run the suite's commands, print fresh numbers beside the claim's
    python benchmarks/suite.py ID --refresh           rewrite benchmarks/claims/ID.json from the suite's results files

After a rerun, copy the fresh file over the committed one in benchmarks/results/, then `--refresh`. Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLAIMS = ROOT / "benchmarks" / "claims"
SUITES = ROOT / "benchmarks" / "suites"
TOKEN = re.compile(r"\.?([^.\[\]]+)|\[(\*|\d+)\]")


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def lookup(data, path: str):
    """The value at a dotted path (`a.b[0].c`; `[*]` maps over a list); KeyError where it is missing."""
    values, many = [data], False
    for key, index in TOKEN.findall(path):
        if index == "*":
            values, many = [item for value in values for item in value], True
        elif index:
            values = [value[int(index)] for value in values]
        else:
            values = [value[key] for value in values]
    return values if many else values[0]


def figure(files: dict[str, dict], spec: str):
    """One number from a spec: `alias:path`, `min(alias:path)`, `max(...)`, or `A / B`."""
    if " / " in spec:
        top, bottom = (figure(files, part.strip()) for part in spec.split(" / ", 1))
        return None if top is None or bottom is None else top / bottom
    reduce = re.fullmatch(r"(min|max)\((.+)\)", spec)
    alias, path = (reduce.group(2) if reduce else spec).split(":", 1)
    value = lookup(files[alias], path)
    if reduce:
        return (min if reduce.group(1) == "min" else max)(value)
    return value


def numbers(suite: dict, files: dict[str, dict]) -> dict:
    return {name: figure(files, spec) for name, spec in suite["numbers"].items()}


def meta(suite: dict, files: dict[str, dict]) -> dict:
    found = {}
    for name in ("command", "git_commit", "versions", "device", "shared_host"):
        spec = suite["shared_host"] if name == "shared_host" else suite.get("meta", {}).get(name)
        if not isinstance(spec, str) or ":" not in spec:
            found[name] = spec
            continue
        try:
            found[name] = figure(files, spec)
        except (KeyError, IndexError, TypeError):
            found[name] = None
    return found


def suite_of(claim_id: str) -> dict:
    path = SUITES / f"{claim_id}.json"
    if not path.is_file():
        sys.exit(f"no suite {path.relative_to(ROOT)}; --list shows the claims")
    return load(path)


def refresh(claim_id: str) -> dict:
    """The claim record rebuilt from the suite's committed results files."""
    suite = suite_of(claim_id)
    files = {alias: load(ROOT / path) for alias, path in suite["results"].items()}
    found = meta(suite, files)
    found["device"] = found["device"] or suite["device"]  # the suite's words where the file names no device
    claim = {"id": claim_id, "what": suite["what"], "command": found.pop("command") or " && ".join(suite["commands"]),
             **found, "numbers": numbers(suite, files), "source": sorted(suite["results"].values())}
    if suite.get("note"):
        claim["note"] = suite["note"]
    (CLAIMS / f"{claim_id}.json").write_text(json.dumps(claim, indent=2) + "\n")
    return claim


def rerun(claim_id: str, out: Path) -> int:
    """Run the suite's commands into `out`, then print each number fresh beside the claim's."""
    suite = suite_of(claim_id)
    out.mkdir(parents=True, exist_ok=True)
    for command in suite["commands"]:
        command = command.replace("{out}", str(out))
        print(f"+ {command}", flush=True)
        if subprocess.run(command, shell=True, cwd=ROOT, check=False).returncode:
            print(f"failed: {command}")
            return 1
    files = {alias: load(Path(path.replace("{out}", str(out)))) for alias, path in suite["fresh"].items()}
    fresh = numbers(suite, files)
    claimed = load(CLAIMS / f"{claim_id}.json")["numbers"]
    width = max(map(len, fresh))
    print(f"{'number':<{width}}  {'claim':>14}  {'fresh':>14}")
    for name, value in fresh.items():
        print(f"{name:<{width}}  {_show(claimed.get(name)):>14}  {_show(value):>14}")
    print(f"to publish: copy {', '.join(suite['fresh'].values())} over {', '.join(suite['results'].values())} "
          f"(with {{out}} = {out}), then: python benchmarks/suite.py {claim_id} --refresh")
    return 0


def _show(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def listing() -> None:
    for path in sorted(CLAIMS.glob("*.json")):
        claim = load(path)
        rerunnable = "" if (SUITES / path.name).is_file() else "  (no suite)"
        print(f"{claim['id']:<22} {claim['what']}{rerunnable}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Rerun a published claim, or rewrite it from its results file.")
    parser.add_argument("claim", nargs="?", help="a claim id (benchmarks/claims/<id>.json)")
    parser.add_argument("--list", action="store_true", help="list the claims")
    parser.add_argument("--refresh", action="store_true", help="rewrite the claim from the suite's results files")
    parser.add_argument("--out", type=Path, help="where the commands write (default: a new temporary folder)")
    args = parser.parse_args(argv)
    if args.list or not args.claim:
        listing()
        return 0
    if args.refresh:
        claim = refresh(args.claim)
        print(json.dumps(claim["numbers"], indent=2))
        return 0
    return rerun(args.claim, args.out or Path(tempfile.mkdtemp(prefix=f"suite-{args.claim}-")))


if __name__ == "__main__":
    sys.exit(main())
