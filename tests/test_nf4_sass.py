"""benchmarks/nf4_sass.py: the product's nf4 kernel built offline for sm_90 finds its K loop, and that loop reads
x in 16-byte loads along k (never 2 bytes a row at a time, as the design before did: benchmarks/NOTES.md) and
multiplies on Hopper's warpgroup tensor-core instructions, without spilling registers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SASS = """\
        /*0100*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0110*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0120*/                   HGMMA.64x32x16.F32.BF16 R24, gdesc[UR8], RZ ;
        /*0130*/               @!P0 BRA `(.L_x_1) ;
        /*0140*/                   EXIT ;
"""


def test_the_loop_is_read_between_its_label_and_its_backward_branch(benchmark_script):
    assert benchmark_script("nf4_sass").loop_opcodes(SASS) == {"LDG.E.128": 1, "HGMMA.64x32x16.F32.BF16": 1, "BRA": 1}


@pytest.mark.slow  # ~4 s: a ptxas build
def test_the_kernel_built_for_sm90_reads_x_along_k(tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a real build, not the interpreter
    out = tmp_path / "sass.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "nf4_sass.py"), "--json", str(out)],
                         capture_output=True, text=True, env=env, timeout=600, check=False)
    if run.returncode == 2:
        pytest.skip(run.stderr.strip())
    assert run.returncode == 0, run.stderr
    counts = json.loads(out.read_text())
    opcodes = counts["opcodes"]
    assert opcodes.get("LDG.E.128", 0) >= 4 and not opcodes.get("LDG.E.U16")
    assert any(op.startswith("HGMMA") for op in opcodes)
    assert counts["spill_bytes"] == 0 and counts["weights_per_thread"] == 64
    assert counts["instructions_per_weight"] < 12  # the design before took 12.7 (results/cpu_nf4_sass.json)


@pytest.mark.slow  # ~7 s: ptxas on every tuned tile
def test_each_measured_tile_builds_for_sm90_without_spilling(tmp_path):
    """Every tile of nf4_settings.TUNED_SM90 (the settings the product takes on sm_90) compiles offline to a loop on Hopper's
    tensor-core instructions with x read in 16-byte loads, and no register spills (a Triton upgrade that made one
    spill would slow the token step the table was measured for); its K splits summed by the last to finish, which
    reads the others' shares only after every thread's stores, a barrier and the count (released and acquired at
    GPU scope), then a barrier: the order that makes them visible (the interpreter, one program at a time, cannot
    tell)."""
    pytest.importorskip("triton.backends.nvidia")
    from vlmrl.engine.rollout import nf4_settings

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "tuned.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "nf4_sass.py"), "--tuned", "--json", str(out)],
                         capture_output=True, text=True, env=env, timeout=600, check=False)
    if run.returncode == 2:
        pytest.skip(run.stderr.strip())
    assert run.returncode == 0, run.stderr
    built = json.loads(out.read_text())
    shapes = {(n, k, rows) for n, k, _, rows in nf4_settings.TUNED_SM90}
    assert {(*map(int, s.split(" x ")), r["rows"]) for r in built for s in r["shapes"]} == shapes
    for r in built:
        assert r["spill_bytes"] == 0, r["tile"]
        assert any(op.startswith("HGMMA") for op in r["opcodes"])
        assert r["opcodes"].get("LDG.E.128", 0) >= 1 and not r["opcodes"].get("LDG.E.U16")  # x in 16-byte loads
        order = r["split_sum_order"]  # K split: the last split to finish sums the shares (CUTLASS's semaphore order)
        count = order.index("count (acquire, release)")
        assert order[count - 2:count + 3] == ["stores", "barrier", "count (acquire, release)", "barrier",
                                              "shares read through L2"], order
        assert order.count("count (acquire, release)") == 1 and order[-1] == "counter reset", order


@pytest.mark.slow  # ~9 s: three ptxas builds
def test_the_shuffles_and_the_pair_table_take_fewer_loop_instructions_than_table_loads(tmp_path):
    """The product's lookups by warp shuffle, and the variant with one table lookup a byte (benchmarks/variants/
    nf4_pairs.py), exist for the instructions they save in the loop the profile found bound by its own issue
    (benchmarks/NOTES.md): built offline for sm_90 at the rule's tile, each must take fewer of them per weight than
    its loop with a table load a nibble (the product's: nf4_loads.py; the pair table's, a byte at a time:
    nf4_lookups' "byte-loads"), without spilling."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    counts = {}
    for design in ("loads", "byte-loads", "pairs", "v2"):
        out = tmp_path / f"{design}.json"
        run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "nf4_sass.py"), "--kernel", design,
                              "--json", str(out)], capture_output=True, text=True, env=env, timeout=600, check=False)
        if run.returncode == 2:
            pytest.skip(run.stderr.strip())
        assert run.returncode == 0, run.stderr
        counts[design] = json.loads(out.read_text())
    loads = counts["loads"]
    assert counts["pairs"]["kernel"] == "pairs" and counts["pairs"]["spill_bytes"] == 0
    assert counts["pairs"]["opcodes"].get("LDG.E.64", 0) >= 1  # one 8-byte lookup a byte
    # against the loop it was built beside: a byte at a time, a table load a nibble
    assert counts["pairs"]["instructions_per_weight"] < 0.8 * counts["byte-loads"]["instructions_per_weight"]
    shuffle = counts["v2"]
    assert shuffle["kernel"] == "v2" and shuffle["spill_bytes"] == 0
    # a shuffle a weight, and the table's loads gone from the loop (what loads remain: the block scales)
    assert shuffle["opcodes"].get("SHFL.IDX", 0) == shuffle["weights_per_thread"]
    assert not loads["opcodes"].get("SHFL.IDX")
    assert shuffle["opcodes"].get("LDG.E", 0) < loads["opcodes"]["LDG.E"] // 4
    assert shuffle["instructions_per_weight"] < 0.85 * loads["instructions_per_weight"]


@pytest.mark.slow  # ~6 s: four ptxas builds
def test_the_group_step_kernel_builds_for_sm90_at_each_group_in_the_split_sums_order(tmp_path):
    """The bf16 group-step kernel (vlmrl.engine.rollout.group_step), built offline for sm_90 as the product launches
    it at Qwen3-VL-8B's four groups and 32 rows: its dots on Hopper's warpgroup MMA, no register spills, and where
    K is split, the last split to finish reads the others' shares only after every thread's stores, a barrier and
    the count (released and acquired at GPU scope), then a barrier, and resets the count last (what one program at a
    time in the interpreter cannot tell)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "group_step.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "nf4_sass.py"), "--group-step", "--json",
                          str(out)], capture_output=True, text=True, env=env, timeout=600, check=False)
    if run.returncode == 2:
        pytest.skip(run.stderr.strip())
    assert run.returncode == 0, run.stderr
    built = {r["group"]: r for r in json.loads(out.read_text())}
    assert {g: r["splits"] for g, r in built.items()} == {"q/k/v": 2, "o": 4, "gate/up": 1, "down": 4}  # as measured
    for group, r in built.items():
        assert r["spill_bytes"] == 0 and r["warpgroup_mma"] > 0, group
        order = r["split_sum_order"]
        if r["splits"] == 1:
            assert order == [], group
            continue
        count = order.index("count (acquire, release)")
        assert order[count - 2:count + 3] == ["stores", "barrier", "count (acquire, release)", "barrier",
                                              "shares read through L2"], (group, order)
        assert order.count("count (acquire, release)") == 1 and order[-1] == "counter reset", (group, order)
