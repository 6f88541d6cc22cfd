"""The scripts in benchmarks/, on the CPU: each imports (so a module that moved is found where it went), the ones
with a command line answer `--help`, and engine_variants.py turns the engine's A/B variants (the bench plugins in
benchmarks/variants/, tests/test_variants.py) into bench paths that plain `vlmrl bench` does not offer. What they measure needs a GPU; that is their own business."""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))


def _load(script: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script as a module (not run as __main__), its folder importable as when it runs."""
    monkeypatch.syspath_prepend(str(script.parent))
    spec = importlib.util.spec_from_file_location(f"benchmarks_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as `python script.py` has it: a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def variants():
    """The bench's variant registry, restored after the test: the product has none."""
    from vlmrl.bench import run

    saved = dict(run.VARIANTS)
    yield run.VARIANTS
    run.VARIANTS.clear()
    run.VARIANTS.update(saved)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_each_script_imports_without_a_gpu(script, monkeypatch):
    module = _load(script, monkeypatch)
    assert module.__doc__, f"{script.name}: say what it measures"


@pytest.mark.parametrize("script", [s for s in SCRIPTS if "add_argument" in s.read_text()], ids=lambda p: p.name)
def test_scripts_with_a_command_line_parse_their_arguments(script, monkeypatch, capsys):
    module = _load(script, monkeypatch)
    monkeypatch.setattr(sys, "argv", [script.name, "--help"])
    takes_argv = bool(inspect.signature(module.main).parameters)  # main(argv) or main() reading sys.argv
    with pytest.raises(SystemExit) as done:
        module.main(["--help"]) if takes_argv else module.main()
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out


def test_engine_variants_parses_the_bench_command_line(variants, monkeypatch, capsys):
    module = _load(ROOT / "benchmarks" / "engine_variants.py", monkeypatch)
    with pytest.raises(SystemExit) as done:
        module.main(["bench", "--help"])
    assert done.value.code == 0 and "--paths" in capsys.readouterr().out
    assert "vlmrl-merged" in variants  # registered before the command ran


def test_variant_paths_run_through_the_script_only(variants, monkeypatch):
    from vlmrl.bench import PATHS, path_names
    from vlmrl.cli.app import app

    assert PATHS == ("plain", "vlmrl", "unsloth") and path_names() == PATHS  # the product's bench
    runner = CliRunner()
    refused = runner.invoke(app, ["bench", "--paths", "vlmrl,vlmrl-merged"], terminal_width=200)
    assert refused.exit_code != 0 and "unknown bench path(s) vlmrl-merged" in refused.output
    assert "benchmarks/engine_variants.py" in refused.output
    _load(ROOT / "benchmarks" / "engine_variants.py", monkeypatch).register()
    result = runner.invoke(app, ["bench", "--paths", "vlmrl,vlmrl-merged,vlmrl-nope"], terminal_width=200)
    assert result.exit_code != 0 and "unknown bench path(s) vlmrl-nope;" in result.output  # the variant is known


def test_dynamic_sampling_pairs_compares_item_by_item_and_refuses_other_items(monkeypatch):
    """The on/off comparison pairs each held-out item's outcome across the two records: the difference and its
    discordant counts come from the items, and two records of other held-out sets are not compared."""
    pairs = _load(ROOT / "benchmarks" / "dynamic_sampling_pairs.py", monkeypatch)

    def record(after: str, swapped: str, ids: str = "h") -> dict:
        return {"runs": [{"seed": 0, "after_correct": after, "after_swapped_correct": swapped, "item_ids_sha256": ids,
                          "accuracy": {"before": 0.25, "delta": 0.25}}]}

    result = pairs.compare(record("1100", "1000"), record("1110", "0000"))
    diff = result["per_seed"][0]["on_minus_off"]
    assert (diff["items_only_on_right"], diff["items_only_off_right"]) == (1, 0)
    assert diff["accuracy_diff"] == 0.25 and diff["mcnemar_p"] == 1.0
    assert diff["visual_gain_diff"] == (3 - 0) / 4 - (2 - 1) / 4
    assert result["per_seed"][0]["off"]["accuracy_after"] == 0.5 and result["pooled_on_minus_off"] == diff
    with pytest.raises(SystemExit, match="held-out items differ"):
        pairs.compare(record("1100", "1000"), record("1110", "0000", ids="other"))


NCU_CSV = '''==PROF== Connected to process 4242 (/usr/bin/python3)
==PROF== Profiling "nvjet_sm90_tst_128x32" - 0: 0%....50%....100% - 1 pass
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","python3","127.0.0.1","nvjet_sm90_tst_128x32_64x10_4x1_v_bz_TNT","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","33,554,432"
"0","4242","python3","127.0.0.1","nvjet_sm90_tst_128x32_64x10_4x1_v_bz_TNT","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","65,536"
"0","4242","python3","127.0.0.1","nvjet_sm90_tst_128x32_64x10_4x1_v_bz_TNT","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","16,000"
"1","4242","python3","127.0.0.1","triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0","1","7","(512, 1, 1)","(32, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","0"
"1","4242","python3","127.0.0.1","triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0","1","7","(512, 1, 1)","(32, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
"1","4242","python3","127.0.0.1","triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0","1","7","(512, 1, 1)","(32, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","3.5"
'''


def test_token_step_ncu_reads_ncu_csv_and_sets_each_kernel_against_its_bytes(monkeypatch):
    ncu = _load(ROOT / "benchmarks" / "token_step_ncu.py", monkeypatch)
    kernels = ncu.read_ncu_csv(NCU_CSV)
    assert [(k["id"], k["bytes_read"], k["bytes_written"]) for k in kernels] == [(0, 33554432, 65536), (1, 0, 0)]
    assert kernels[0]["seconds"] == pytest.approx(16e-6) and kernels[1]["seconds"] == pytest.approx(3.5e-6)
    result = ncu.profile(kernels, bandwidth=4.2e12)
    matmul, norm = result["per_kernel"]
    assert (matmul["kind"], norm["kind"]) == ("matmul", "norm")
    assert matmul["x_bytes"] == pytest.approx(16e-6 / ((33554432 + 65536) / 4.2e12))
    assert matmul["achieved_tbs"] == pytest.approx((33554432 + 65536) / 16e-6 / 1e12)
    assert norm["x_bytes"] is None  # no DRAM traffic: nothing to set it against
    assert result["step"]["us"] == pytest.approx(19.5) and list(result["by_kind"]) == ["matmul", "norm"]
    norm_name = "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0"
    assert result["by_name"][norm_name]["kernels"] == 1 and result["by_name"][norm_name]["kind"] == "norm"
    table = ncu.markdown(result)
    assert "One token step: 2 kernels, 20 us of kernel time" in table and "no DRAM bytes" in table
    assert f"| `{norm_name}` | norm, 1 | 3.5 |" in table
    with pytest.raises(ValueError, match="no ncu CSV header"):
        ncu.read_ncu_csv("==PROF== nothing profiled\n")
    with pytest.raises(ValueError, match="lack some of"):
        ncu.read_ncu_csv("\n".join(NCU_CSV.splitlines()[:4]))
    with pytest.raises(ValueError, match="unit 'cycle' is not one"):  # never read as seconds
        ncu.read_ncu_csv(NCU_CSV.replace('"usecond","3.5"', '"cycle","3.5"'))
    with pytest.raises(ValueError, match="profiled no kernel"):
        ncu.profile([], 4.2e12)


def test_token_step_ncu_writes_its_tables_from_the_window_the_run_stopped_at(monkeypatch, tmp_path):
    ncu = _load(ROOT / "benchmarks" / "token_step_ncu.py", monkeypatch)
    (tmp_path / "token_step_ncu.csv").write_text(NCU_CSV)
    window = {"settings": {"completion": 1024}, "device": "a GPU", "versions": {"torch": "2.11.0"},
              "ceilings": {"copy_bandwidth_tbs": 4.2}, "rollout": 1, "git_commit": "abc1234"}
    (tmp_path / ncu.WINDOW).write_text(json.dumps(window))
    result = ncu.write(tmp_path)
    assert result["rollout"] == 1 and result["bandwidth_tbs"] == pytest.approx(4.2)
    assert result["git_commit"] == "abc1234"  # the suite's claim reads its commit from the profile
    assert result["per_kernel"][0]["x_bytes"] == pytest.approx(16e-6 / ((33554432 + 65536) / 4.2e12))
    assert json.loads((tmp_path / "token_step_profile.json").read_text())["device"] == "a GPU"
    assert (tmp_path / "token_step_profile.md").read_text().startswith("One token step: 2 kernels")
    # a profile made before the run stopped at its window: the bench's own record, the second rollout
    (tmp_path / ncu.WINDOW).unlink()
    (tmp_path / "bench").mkdir()
    bench = ({key: value for key, value in window.items() if key not in ("rollout", "git_commit")}
             | {"ceilings": {"copy_bandwidth_tbs": 3.0}})
    (tmp_path / "bench" / "bench.json").write_text(json.dumps(bench))
    old = ncu.write(tmp_path)
    assert old["rollout"] == 2 and old["bandwidth_tbs"] == pytest.approx(3.0) and old["git_commit"] is None


def test_token_step_ncu_sets_two_profiles_side_by_side(monkeypatch):
    ncu = _load(ROOT / "benchmarks" / "token_step_ncu.py", monkeypatch)
    kernels = ncu.read_ncu_csv(NCU_CSV)
    a = ncu.profile(kernels, 4.2e12)
    b = ncu.profile([kernels[0], {**kernels[1], "seconds": 5.5e-6}, {**kernels[1], "id": 2, "name": "second_step"}],
                    4.2e12)
    table = ncu.against(a, b)
    assert table.startswith("A: 2 kernels, 20 us; B: 3 kernels, 25 us (+6 us).")
    norm = "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0"
    lines = table.splitlines()
    kernel_rows = lines[lines.index("The 25 kernel names whose time differs most:") + 4:]
    # largest difference first; a kernel only one side ran shows zero calls on the other
    assert kernel_rows[0] == "| `second_step` | 0 | 0.0 | 1 | 3.5 | +3.5 |"
    assert kernel_rows[1] == f"| `{norm}` | 1 | 3.5 | 1 | 5.5 | +2.0 |"
    assert "| matmul | 1 | 16.0 | 2 | 19.5 | +3.5 |" in lines  # second_step counts as a matmul


# ncu's raw page (`--page raw --csv --print-units base`): a column per metric, a units row under the header
NCU_RAW = """==PROF== Disconnected
"ID","Process ID","Kernel Name","gpu__time_duration.sum","launch__grid_size",\
"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_selected_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"
"","","","ns","","inst","inst","inst","inst"
"0","11","nf4_tiles","52,100","256","0.75","0.25","1","1.5"
"1","11","nf4_splits","3,000","64","0.5","","1","0.25"
"2","11","nf4_tiles","20,000","128","0.5","4.0","1","1.0"
"""
# ncu's source page (`--page source --print-source sass --csv`) for one kernel
NCU_SOURCE = """"Kernel Name","nf4_tiles",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed"
"0x10","      PRMT R1, R2, 0x7610, R3","30","20","2,048"
"0x20","      @!P0 LDG.E R4, desc[UR4][R6.64]","10","10","1,024"
"0x30","      PRMT R5, R2, 0x7632, R5","30","25","1,024"
"0x40","      FMUL R7, R4, R8","30","15","4,096"
"""


def test_nf4_stalls_reads_ncu_raw_and_source_pages(monkeypatch):
    stalls = _load(ROOT / "benchmarks" / "nf4_stalls.py", monkeypatch)
    raw = stalls.read_raw(NCU_RAW)
    assert [k["id"] for k in raw] == [0, 1, 2]  # the units row is not a kernel
    assert raw[0]["metrics"]["gpu__time_duration.sum"] == 52100
    source = stalls.read_source(NCU_SOURCE)
    assert list(source) == ["PRMT", "FMUL", "LDG"]  # most samples first; a predicate is not an opcode
    assert source["PRMT"] == {"samples": 0.6, "instructions": 3072 / 8192}
    result = stalls.tables(raw, ["12288x4096", "4096x4096"], [source, {}, {}])
    tiles, splits, second = result["kernels"]
    assert (tiles["label"], splits["label"], second["label"]) == (
        "12288x4096", "12288x4096 (sum of K splits)", "4096x4096")
    assert tiles["us"] == pytest.approx(52.1) and tiles["programs"] == 256
    # largest first; a blank cell is no figure
    assert tiles["stalls"] == [("wait", 1.5), ("selected", 1.0), ("long_scoreboard", 0.75), ("mio_throttle", 0.25)]
    assert splits["stalls"] == [("selected", 1.0), ("long_scoreboard", 0.5), ("wait", 0.25)]
    assert second["stalls"][0] == ("mio_throttle", 4.0) and "opcodes" not in second
    table = stalls.markdown(result)
    assert "| 12288x4096 | 52.1 |" in table and "- 12288x4096: PRMT 60% / 38%, FMUL 30% / 50%, LDG 10% / 12%" in table
    with pytest.raises(ValueError, match="no ncu CSV header"):
        stalls.read_raw("==PROF== nothing profiled\n")
    with pytest.raises(ValueError, match="no SASS source table"):
        stalls.read_source("nothing\n")


def test_token_step_timeline_sets_wall_time_against_the_gpus_busy_time(monkeypatch):
    timeline = _load(ROOT / "benchmarks" / "token_step_timeline.py", monkeypatch)
    assert timeline.union([(20, 25), (0, 10), (5, 12), (21, 22), (12, 12)]) == [(0, 12), (20, 25)]  # 17 us busy
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "a", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "b", "ts": 50, "dur": 100},    # overlaps a: busy 150 us so far
        {"ph": "X", "cat": "gpu_memcpy", "name": "c", "ts": 400, "dur": 50},  # after a 250 us gap
        {"ph": "X", "cat": "kernel", "name": "d", "ts": 460, "dur": 40},    # a 10 us gap: not counted
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 30},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 390, "dur": 10},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},
        {"ph": "i", "cat": "kernel", "name": "an instant, not an interval", "ts": 0}]}
    s = timeline.summarize(trace, wall_s=1e-3, steps=2, top_ops=[])
    assert s["wall_ms"] == pytest.approx(0.5) and s["gpu_busy_ms"] == pytest.approx(0.12)
    assert s["gpu_summed_ms"] == pytest.approx(0.145) and s["gpu_events"] == 2
    assert s["idle_ms"] == pytest.approx(0.38)
    assert s["gaps_over_20us"] == 0.5 and s["largest_gaps_us"] == [250.0]
    assert s["runtime"] == [{"name": "cudaGraphLaunch", "calls": 1.0, "host_ms": pytest.approx(0.02)}]
    with pytest.raises(ValueError, match="no GPU event"):
        timeline.summarize({"traceEvents": trace["traceEvents"][4:]}, 1e-3, 1, [])
    table = timeline.markdown({"path": "vlmrl", "token_step": 64, "rollout": 1, "device": "a GPU", "timeline": s,
                                "unprofiled_wall_ms": 0.45})
    assert "| GPU idle (wall - busy) | 0.38 |" in table and "| `cudaGraphLaunch` | 1.0 | 0.020 |" in table
    assert "unprofiled | 0.45 |" in table


@pytest.mark.slow  # ~20 s: a tiny model's compiled generate, twice
def test_host_ops_counts_the_eager_ops_of_a_compiled_token_step(monkeypatch, tmp_path):
    """host_ops.py counts, per token step, the ops issued outside the compiled graph: each sampled token's one
    multinomial draw among them, the prompt pass's ops not, and it names where they come from."""
    host_ops = _load(ROOT / "benchmarks" / "host_ops.py", monkeypatch)
    record = host_ops.census(tokens=6, layers=1, work=tmp_path)
    assert record["compiled_regions_per_step"] >= 0.8  # every token step after the first runs the compiled graph
    assert record["by_op"]["aten::multinomial"] == pytest.approx(1.0, abs=0.2)  # one draw a token, eager
    assert record["ops_per_step"] == pytest.approx(sum(record["by_op"].values()))
    assert any("generation/utils.py" in name for name in record["by_source"])
    assert "| op | per token step |" in host_ops.markdown(record)


@pytest.mark.slow  # ~7 s: two tiny models' compiled generate, twice each way
@pytest.mark.parametrize("arch", ["qwen2_5_vl", "idefics3"])
def test_other_families_decode_the_same_tokens_with_the_recorded_step(arch, monkeypatch, tmp_path):
    """The recorded token step is on for every full-attention family: transformers' loop over a tiny Qwen2.5-VL and
    SmolVLM (Idefics3), with step_graph_check.py's stand-in recorder, gives the compiled tokens, each `generate`
    call recorded once and replayed (real CUDA graphs: the same script on a GPU)."""
    import torch

    check = _load(ROOT / "benchmarks" / "step_graph_check.py", monkeypatch)
    torch.manual_seed(0)
    result = check.check(6, 1, tmp_path, arch)
    assert result["same_tokens"] and result["arch"] == arch, result
    assert [(c["recordings"], c["failed"]) for c in result["calls"]] == [(1, None), (1, None)]
    assert all(c["replays"] > 0 for c in result["calls"])


def test_nf4_matmul_finds_every_kernel_and_its_settings(monkeypatch):
    """nf4_matmul.py's kernels resolve to their matmul and settings chooser (the product's settings moved once
    from `nf4` to `nf4_settings`, and the table kept pointing at the old place)."""
    nf4_matmul = _load(ROOT / "benchmarks" / "nf4_matmul.py", monkeypatch)
    from vlmrl.engine.rollout import nf4_settings

    choosers = {name: nf4_matmul._kernel(name)[1] for name in nf4_matmul.KERNELS}
    assert all(choosers[name] is nf4_settings.config for name in ("v2", "pairs", "loads", "shuffle", "bytes"))
    assert choosers["v1"].__module__ == "variants.nf4_v1" and callable(nf4_matmul._kernel("v2")[0])
