"""`vlmrl bench --generation-batches`: the per-batch bookkeeping (the GPU runs are the lead's; here run_path is
replaced by a fake that returns what it would)."""

from __future__ import annotations

import json

import pytest

from vlmrl.bench import BenchSettings, load_shapes, markdown_table, summarize, throughput
from vlmrl.engine.rollout.compile_cache import CompileCache


def _result(path: str, steps: list[tuple[float, float]], peak: float, error: str | None = None) -> dict:
    return {"path": path, "error": error, "fast_generation": None, "peak_memory_gib": peak,
            "generation_peak_gib": peak, "training_peak_gib": peak - 1, "peak_reserved_gib": peak + 1,
            "steps": [{"seconds": s, "generate_seconds": g} for s, g in steps]}


def test_rows_report_the_steady_step_and_samples_per_second():
    settings = BenchSettings(completion=1000, steps=2)
    measured = [("vlmrl", 32, _result("vlmrl", [(90.0, 80.0), (20.0, 12.0)], 23.0)),
                ("vlmrl", 64, _result("vlmrl", [(95.0, 85.0), (32.0, 20.0)], 40.0)),
                ("vlmrl", 128, _result("vlmrl", [], 0.0, error="OutOfMemoryError: CUDA out of memory")),
                ("vlmrl", 256, None)]
    rows = throughput.throughput_rows(settings, measured)
    assert [r["per_device_batch"] for r in rows] == [8, 16, 32, 64]
    # 32 completions in the 20 s steady step (the 90 s first step compiles and is excluded)
    assert (rows[0]["step_seconds"], rows[0]["samples_per_second"], rows[0]["first_step_seconds"]) == (20.0, 1.6, 90.0)
    assert rows[1]["samples_per_second"] == 2.0 and rows[1]["decode_ms_per_step"] == 20.0
    assert rows[2]["error"].startswith("OutOfMemoryError") and "step_seconds" not in rows[2]
    assert rows[3]["error"] == "skipped: a smaller batch failed"
    table = throughput.throughput_table({"settings": {**settings.__dict__}, "prompt_tokens": 310, "rows": rows})
    assert "| vlmrl | 64 | 16 | 32.0 | 95.0 | 2.00 | 20.0 | 40.0 | 40.0 / 39.0 | 41.0 |" in table
    assert "| vlmrl | 256 | 64 | failed: skipped: a smaller batch failed |" in table


def test_each_batch_runs_its_own_trainer_and_larger_ones_stop_after_a_failure(monkeypatch, tmp_path):
    calls = []

    def fake_run_path(path, settings, shapes, processor_dir, dataset, work):
        calls.append((path, settings.prompts, len(dataset)))
        batch = settings.prompts * settings.generations
        if batch >= 128:
            return _result(path, [], 0.0, error="OutOfMemoryError: CUDA out of memory")
        return _result(path, [(100.0, 90.0), (batch / 2, batch / 4)], batch / 2)

    cache = CompileCache("/c/inductor", "/c/triton", "explicit", cold=True, files_at_start=0)
    monkeypatch.setattr(throughput, "prepare_device", lambda settings, work: (cache, work))
    monkeypatch.setattr(throughput, "build_processor", lambda work, size: tmp_path)
    monkeypatch.setattr(throughput, "bench_dataset", lambda settings: list(range(settings.prompts * 3)))
    monkeypatch.setattr(throughput, "prompt_tokens_of", lambda processor_dir, dataset: 310)
    monkeypatch.setattr(throughput, "run_path", fake_run_path)
    settings = BenchSettings(paths=["vlmrl"], steps=2)
    summary = throughput.run_throughput(settings, [32, 64, 128, 256], tmp_path / "out", tmp_path)
    # per-device batch = generation batch / 4 generations; the data sized once, for the largest batch
    assert calls == [("vlmrl", 8, 192), ("vlmrl", 16, 192), ("vlmrl", 32, 192)]  # 256 never attempted
    assert [r["samples_per_second"] for r in summary["rows"][:2]] == [2.0, 2.0]
    written = json.loads((tmp_path / "out" / "throughput.json").read_text())
    assert written["compile_cache"]["cold"] is True and written["settings"]["generation_batches"] == [32, 64, 128, 256]
    assert "| vlmrl | 32 | 8 | 16.0 |" in (tmp_path / "out" / "throughput.md").read_text()


def test_the_bench_table_says_whether_the_compile_cache_was_cold():
    settings = BenchSettings(steps=1, paths=["vlmrl"])
    summary = summarize(settings, load_shapes("qwen3_vl_8b"), {"matmul_tflops": 800, "copy_bandwidth_tbs": 4.0},
                        [_result("vlmrl", [(60.0, 50.0)], 20.0)], prompt_tokens=310)
    for cold, word in ((True, "cold (empty)"), (False, "warm")):
        summary["compile_cache"] = CompileCache("/c/inductor", "/c/triton", "explicit", cold, 0 if cold else 9).as_dict()
        assert f"Compile cache /c/inductor: {word} at the start" in markdown_table(summary)
    assert summary["paths"]["vlmrl"]["first_step_seconds"] == 60.0


@pytest.mark.parametrize("text, error", [("32,x", "'x' is not a whole number"), ("0", "positive multiple")])
def test_bad_batches_are_one_line_errors(text, error):
    with pytest.raises(ValueError, match=error):
        throughput.parse_batches(text, 4)


def test_bench_files_are_strict_json(tmp_path):
    """A measurement that is not a number (a failed batch's rate, say) is written as null, never as NaN."""
    throughput._write(tmp_path, "t.json", {"samples_per_second": float("nan"), "peaks": [1.5, float("inf")]})
    assert json.loads((tmp_path / "t.json").read_text(), parse_constant=pytest.fail) == {
        "samples_per_second": None, "peaks": [1.5, None]}
