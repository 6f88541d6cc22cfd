"""Every figure README.md and docs/ publish as vlmrl's is backed by a claim record, and says what the record says.

The citation syntax (benchmarks/README.md, "Claims"): a link `[claim ID](.../benchmarks/claims/ID.json)` near the
figures, and after them, in the same sentence or table cell, an HTML comment that names each figure:

    13.8 s per step <!-- claim h200-bf16-step: step_s=13.8 -->

Each `name=value` must be written in the text since the previous claim comment of the paragraph (the figure as the
reader sees it), and must equal the record's `numbers.name` at the precision printed (13.8 backs 13.8237). Also:
each cited claim exists, each claim's sources are in the tree, and each claim holds what its suite reads from
those sources today (`python benchmarks/suite.py ID --refresh` rewrites it). No GPU, no network, stdlib only.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLAIMS = ROOT / "benchmarks" / "claims"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[claim ([a-z0-9-]+)\]\(([^)\s]+)\)")
COMMENT = re.compile(r"<!-- claim ([a-z0-9-]+):((?:\s+[\w.]+=\S+)+)\s*-->")
REQUIRED = ("id", "what", "command", "git_commit", "versions", "device", "shared_host", "numbers", "source")


def _claim(claim_id: str) -> dict | None:
    path = CLAIMS / f"{claim_id}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _equal(printed: str, value) -> bool:
    """Whether the record's value is the printed one at the printed precision (`+0.043` backs 0.04296875)."""
    if isinstance(value, bool) or printed in ("true", "false"):
        return str(value).lower() == printed
    if not isinstance(value, (int, float)):
        return False
    number = float(printed.replace(",", ""))
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return math.isclose(number, value, abs_tol=0.5 * 10**-decimals + 1e-12)


def check(text: str, where: str, path: Path = ROOT / "README.md") -> list[str]:
    """Every problem with the claim citations in one markdown text."""
    problems = []
    for match in LINK.finditer(text):
        claim_id, target = match.groups()
        if _claim(claim_id) is None:
            problems.append(f"{where}: cites claim {claim_id}, which has no benchmarks/claims/{claim_id}.json")
        elif (path.parent / target).resolve() != CLAIMS / f"{claim_id}.json":
            problems.append(f"{where}: the link of claim {claim_id} points at {target}")
    start = 0
    for match in COMMENT.finditer(text):
        paragraph = text.rfind("\n\n", 0, match.start()) + 2
        scope, start = text[max(start, paragraph):match.start()], match.end()
        line = text.count("\n", 0, match.start()) + 1
        claim_id, pairs = match.group(1), match.group(2).split()
        claim = _claim(claim_id)
        if claim is None:
            problems.append(f"{where}:{line}: claim {claim_id} does not exist")
            continue
        for pair in pairs:
            name, printed = pair.split("=", 1)
            if name not in claim["numbers"]:
                problems.append(f"{where}:{line}: claim {claim_id} has no number {name}")
            elif not _equal(printed, claim["numbers"][name]):
                problems.append(f"{where}:{line}: {name}={printed}, but claim {claim_id} says "
                                f"{claim['numbers'][name]}")
            if not re.search(rf"(?<![\w.]){re.escape(printed)}(?!\d|\.\d)", scope):
                problems.append(f"{where}:{line}: {name}={printed} is not written before its comment")
    return problems


def _docs() -> list[tuple[Path, str]]:
    return [(p, p.read_text()) for p in DOCS]


def test_citations_name_existing_claims_and_their_figures() -> None:
    problems = [p for path, text in _docs() for p in check(text, str(path.relative_to(ROOT)), path)]
    assert not problems, "\n".join(problems)


def test_docs_cite_claims() -> None:
    """The manual pages that publish measurements do cite (a citation dropped by an edit is noticed)."""
    for name in ("README.md", "docs/speed.md", "docs/multi_gpu.md"):
        assert COMMENT.search((ROOT / name).read_text()), f"{name} cites no claim"


@pytest.mark.parametrize("path", sorted(CLAIMS.glob("*.json")), ids=lambda p: p.stem)
def test_claim_records_are_complete_and_their_sources_exist(path: Path) -> None:
    claim = json.loads(path.read_text())
    assert [k for k in REQUIRED if k not in claim] == [], f"{path.name} lacks fields"
    assert claim["id"] == path.stem and re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", claim["id"])
    assert isinstance(claim["shared_host"], bool) and claim["numbers"] and claim["source"]
    for source in claim["source"]:
        assert (ROOT / source).is_file(), f"{path.name}: its source {source} is not in the tree"


def _suite_module():
    spec = importlib.util.spec_from_file_location("benchmarks_suite", ROOT / "benchmarks" / "suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks" / "suites").glob("*.json")), ids=lambda p: p.stem)
def test_each_claim_holds_what_its_suite_reads_from_its_sources(path: Path) -> None:
    """A results file rewritten without `suite.py ID --refresh` afterwards fails here."""
    suite, module = json.loads(path.read_text()), _suite_module()
    files = {alias: json.loads((ROOT / p).read_text()) for alias, p in suite["results"].items()}
    claim = _claim(path.stem)
    assert claim is not None, f"suite {path.name} has no claim: python benchmarks/suite.py {path.stem} --refresh"
    assert claim["numbers"] == module.numbers(suite, files), f"run: python benchmarks/suite.py {path.stem} --refresh"
    assert sorted(suite["results"].values()) == claim["source"]


def test_the_checks_can_fail() -> None:
    """A wrong figure, a figure not written in the text, an unknown number and an unknown claim are each caught."""
    claim_id = "h200-bf16-step"
    step = _claim(claim_id)["numbers"]["step_s"]
    good = f"vlmrl's step: {step:.1f} s <!-- claim {claim_id}: step_s={step:.1f} -->"
    assert check(good, "synthetic") == []
    wrong = f"vlmrl's step: {step + 1:.1f} s <!-- claim {claim_id}: step_s={step + 1:.1f} -->"
    assert any("but claim" in p for p in check(wrong, "synthetic"))
    unwritten = f"vlmrl's step is fast <!-- claim {claim_id}: step_s={step:.1f} -->"
    assert any("not written" in p for p in check(unwritten, "synthetic"))
    earlier = f"{step:.1f} s <!-- claim {claim_id}: step_s={step:.1f} --> and again <!-- claim {claim_id}: step_s={step:.1f} -->"
    assert any("not written" in p for p in check(earlier, "synthetic"))
    assert any("no number" in p for p in check(f"1.0 <!-- claim {claim_id}: nothing=1.0 -->", "synthetic"))
    assert any("does not exist" in p for p in check("1.0 <!-- claim no-such-claim: x=1.0 -->", "synthetic"))
    assert any("has no benchmarks/claims" in p for p in check("[claim no-such](x.json)", "synthetic"))
    assert _equal("+0.043", 0.04296875) and not _equal("+0.044", 0.04296875) and _equal("1,024", 1024)
