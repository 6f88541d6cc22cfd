"""Crash-safe files (vlmrl.common.io): whole files are replaced atomically, record files survive a torn last line,
and the disk preflight refuses before writing.

The torn-line property is checked at every possible kill point: for random records, the file is cut at a
random byte (what SIGKILL during `append_jsonl` can leave), then read and appended to. `TORN_EXAMPLES` cuts.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlmrl.common import io
from vlmrl.common.io import (
    DiskSpaceError,
    append_jsonl,
    check_disk_space,
    checkpoint_bytes,
    read_jsonl,
    strict_json,
    write_json_atomic,
    write_jsonl_atomic,
    write_text_atomic,
)

TORN_EXAMPLES = 500


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


# --- atomic whole-file writes -------------------------------------------------------------------------------


@pytest.mark.parametrize("fail_at", ["fsync", "replace"])
def test_failed_atomic_write_leaves_the_old_file_intact_and_no_temp_file(tmp_path, monkeypatch, fail_at):
    path = tmp_path / "summary.json"
    write_json_atomic(path, {"n": 16})

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(io.os, fail_at, boom)  # the new text is written, then the write fails
    with pytest.raises(OSError, match="No space"):
        write_json_atomic(path, {"n": 99, "pad": "x" * 10_000})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"n": 16}
    assert _leftovers(tmp_path) == []


def test_jsonl_writer_failing_midway_leaves_the_old_file(tmp_path):
    path = tmp_path / "train.jsonl"
    write_jsonl_atomic(path, [{"id": "a"}, {"id": "b"}])

    def rows():
        yield {"id": "c"}
        raise RuntimeError("the producer died after one row")

    with pytest.raises(RuntimeError):
        write_jsonl_atomic(path, rows())
    assert read_jsonl(path) == [{"id": "a"}, {"id": "b"}]
    assert _leftovers(tmp_path) == []


def test_interrupt_during_write_cleans_up(tmp_path, monkeypatch):
    path = tmp_path / "config.yaml"
    write_text_atomic(path, "old\n")
    monkeypatch.setattr(io.os, "replace", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        write_text_atomic(path, "new\n")
    monkeypatch.undo()
    assert path.read_text() == "old\n" and _leftovers(tmp_path) == []


def test_atomic_write_creates_parent_folders(tmp_path):
    write_json_atomic(tmp_path / "a" / "b" / "x.json", [1, 2])
    assert json.loads((tmp_path / "a" / "b" / "x.json").read_text()) == [1, 2]


# --- JSONL records ------------------------------------------------------------------------------------------


def test_read_jsonl_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c", "comp')  # killed inside the third line
    assert read_jsonl(path) == [{"id": "a"}, {"id": "b"}]


def test_read_jsonl_raises_on_a_damaged_middle_line_naming_file_and_line(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text('{"id": "a"}\n{"id": "b", "comp\n{"id": "c"}\n')  # damage that no kill can make
    with pytest.raises(ValueError, match=r"records\.jsonl:2: not valid JSON"):
        read_jsonl(path)


def test_read_jsonl_missing_and_empty_files(tmp_path):
    assert read_jsonl(tmp_path / "absent.jsonl") == []
    (tmp_path / "empty.jsonl").write_text("")
    assert read_jsonl(tmp_path / "empty.jsonl") == []
    (tmp_path / "blank.jsonl").write_text('\n{"a": 1}\n\n')
    assert read_jsonl(tmp_path / "blank.jsonl") == [{"a": 1}]


def test_append_truncates_a_torn_tail_before_appending(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')
    append_jsonl(path, [{"step": 2}, {"step": 3}])
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'


def test_append_keeps_a_complete_last_line_that_only_lacks_its_newline(tmp_path):
    """read_jsonl counts such a line, so evaluation treats its id as done; cutting it would lose the record."""
    path = tmp_path / "baseline_records.jsonl"
    path.write_text('{"id": "a"}\n{"id": "b"}')
    assert [r["id"] for r in read_jsonl(path)] == ["a", "b"]
    append_jsonl(path, [{"id": "c"}])
    assert [r["id"] for r in read_jsonl(path)] == ["a", "b", "c"]


def test_append_finds_the_last_newline_beyond_one_read_chunk(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    big = {"completion": "x" * (3 * io._CHUNK)}
    append_jsonl(path, [big])
    with open(path, "a") as handle:
        handle.write('{"completion": "' + "y" * (2 * io._CHUNK))  # a torn line longer than two chunks
    append_jsonl(path, [{"completion": "z"}])
    assert read_jsonl(path) == [big, {"completion": "z"}]


def test_append_to_a_file_that_is_only_a_torn_line(tmp_path):
    path = tmp_path / "health.jsonl"
    path.write_bytes('{"step": 1, "warn": "é'.encode()[:-1])  # cut inside a two-byte UTF-8 character
    assert read_jsonl(path) == []
    append_jsonl(path, [{"step": 1}])
    assert read_jsonl(path) == [{"step": 1}]


rows_strategy = st.lists(
    st.dictionaries(st.sampled_from(["id", "step", "completion", "reward"]),
                    st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=30), st.booleans()),
                    min_size=1),
    min_size=1, max_size=8,
)


@pytest.mark.slow  # ~3 s: many kill points
@settings(max_examples=TORN_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=rows_strategy, cut=st.floats(0, 1), more=rows_strategy)
def test_any_kill_point_during_appends_loses_no_complete_record(rows, cut, more, tmp_path_factory):
    """Write `rows` one append at a time, cut the file at any byte (a kill mid-append), then read and append
    again: exactly the records whose line was complete survive, in order, and nothing is duplicated."""
    path = tmp_path_factory.mktemp("torn") / "records.jsonl"
    for row in rows:
        append_jsonl(path, [row])
    data = path.read_bytes()
    at = int(cut * len(data))
    path.write_bytes(data[:at])

    lines = [strict_json(r).encode() for r in rows]  # how append_jsonl writes a row (an infinity as null)
    expected, offset = [], 0
    for row, line in zip(rows, lines):
        if offset + len(line) <= at:  # its JSON is all there (its newline may not be)
            expected.append(json.loads(line))
        offset += len(line) + 1
    assert read_jsonl(path) == expected
    append_jsonl(path, more)
    assert read_jsonl(path) == expected + [json.loads(strict_json(r)) for r in more]
    assert path.read_bytes().endswith(b"\n")


# --- disk preflight ----------------------------------------------------------------------------------------

Usage = namedtuple("Usage", "total used free")


def test_disk_check_refuses_naming_path_free_and_needed(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10 * 2**30, 10 * 2**30 - 5 * 2**20, 5 * 2**20))
    target = tmp_path / "train" / "checkpoints"  # does not exist yet: its existing parent is measured
    with pytest.raises(DiskSpaceError) as info:
        check_disk_space(target, 3 * 2**30, what="one checkpoint")
    message = str(info.value)
    assert str(target) in message and "5.0 MiB free" in message and "one checkpoint needs about 3.00 GiB" in message
    assert "run.output_dir" in message  # and how to fix it
    assert not target.exists()


def test_disk_check_passes_with_room(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(shutil, "disk_usage", lambda p: seen.append(Path(p)) or Usage(1, 0, 2**30))
    check_disk_space(tmp_path / "a" / "b", 2**30)  # exactly enough is enough
    assert seen == [tmp_path]


def test_checkpoint_size_estimate():
    # fp32 weights (4 bytes) + Adam's two moments (8 bytes) per trainable parameter, plus a 64 MiB margin
    assert checkpoint_bytes(0) == 64 * 2**20
    assert checkpoint_bytes(1_000_000) == 12_000_000 + 64 * 2**20
    assert checkpoint_bytes(10, margin_bytes=0) == 120


def test_disk_check_on_the_real_filesystem(tmp_path):
    check_disk_space(tmp_path, 1)
    with pytest.raises(DiskSpaceError):
        check_disk_space(tmp_path, shutil.disk_usage(tmp_path).total + 1)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_writes_follow_the_users_umask(tmp_path, umask, mode):
    """mkstemp creates 0600 files; a report written under umask 022 must be readable by others (issue 20)."""
    old = os.umask(umask)
    try:
        write_text_atomic(tmp_path / "report.html", "<p>hi</p>")
    finally:
        os.umask(old)
    assert (tmp_path / "report.html").stat().st_mode & 0o777 == mode


def test_match_umask_opens_only_private_files(tmp_path):
    """safetensors writes weights 0600 (issue 20: adapter weights unreadable to a teammate)."""
    private, chosen = tmp_path / "adapter" / "w.safetensors", tmp_path / "adapter" / "script.sh"
    private.parent.mkdir()
    private.write_bytes(b"x")
    chosen.write_bytes(b"x")
    private.chmod(0o600)
    chosen.chmod(0o700)
    old = os.umask(0o022)
    try:
        io.match_umask(tmp_path)
    finally:
        os.umask(old)
    assert private.stat().st_mode & 0o777 == 0o644 and chosen.stat().st_mode & 0o777 == 0o700
