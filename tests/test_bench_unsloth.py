"""The `unsloth` bench path's wiring, on the CPU: its own process with `unsloth` imported first, its record in the
table, and one-line refusals. Unsloth itself needs CUDA, so a stand-in `unsloth` package (written to a temporary
folder) records the import order and the LoRA it is asked for, loads the tiny model with transformers and wraps it
with PEFT; the child then really trains it for two steps on the CPU. The GPU rows come from
benchmarks/gpu_unsloth.sh (benchmarks/NOTES.md, "Unsloth")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlmrl.bench import BenchSettings, build_processor, load_shapes, markdown_table, run_unsloth, summarize
from vlmrl.bench.unsloth_path import SITE_ENV, child_env, unsloth_unavailable_reason

FAKE_UNSLOTH = '''
import json, os, sys
# What Unsloth must precede, as loaded when it is imported: the child must have imported none of them.
_log = {"before": sorted(m for m in ("transformers", "trl", "peft") if m in sys.modules)}

def _write():
    with open(os.environ["FAKE_UNSLOTH_LOG"], "w") as f:
        json.dump(_log, f)

_write()

class FastVisionModel:
    @staticmethod
    def from_pretrained(name, load_in_4bit, dtype, max_seq_length, **kwargs):
        if os.environ.get("FAKE_UNSLOTH_FAIL"):
            raise RuntimeError("stand-in refuses to load")
        from transformers import AutoModelForImageTextToText, AutoProcessor
        _log["loaded"] = {"name": name, "load_in_4bit": load_in_4bit}
        _write()
        return AutoModelForImageTextToText.from_pretrained(name, dtype=dtype), AutoProcessor.from_pretrained(name)

    @staticmethod
    def get_peft_model(model, r, lora_alpha, finetune_vision_layers, finetune_language_layers,
                       finetune_attention_modules, finetune_mlp_modules, **kwargs):
        from peft import LoraConfig, get_peft_model
        _log["lora"] = {"r": r, "alpha": lora_alpha, "vision": finetune_vision_layers,
                        "language": finetune_language_layers, "attention": finetune_attention_modules,
                        "mlp": finetune_mlp_modules}
        _write()
        targets = r".*language_model.*\\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
        return get_peft_model(model, LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=targets,
                                                task_type="CAUSAL_LM"))
'''


@pytest.fixture
def fake_unsloth(tmp_path, monkeypatch):
    site = tmp_path / "unsloth-site"
    (site / "unsloth").mkdir(parents=True)
    (site / "unsloth" / "__init__.py").write_text(FAKE_UNSLOTH)
    log = tmp_path / "fake-unsloth.json"
    monkeypatch.setenv(SITE_ENV, str(site))
    monkeypatch.setenv("FAKE_UNSLOTH_LOG", str(log))
    return site, log


def _settings() -> BenchSettings:
    return BenchSettings(paths=["unsloth"], prompts=2, generations=2, completion=4, steps=2, lora_r=4,
                         image_size=64, prompt_bucket=16)


@pytest.mark.slow
def test_the_unsloth_path_runs_in_its_own_process_with_unsloth_first_and_joins_the_table(fake_unsloth, tmp_path):
    site, log = fake_unsloth
    settings = _settings()
    model_dir = build_processor(tmp_path / "work", settings.image_size)  # a complete tiny Qwen3-VL folder
    result = run_unsloth(settings, model_dir, tmp_path / "work")
    assert result["error"] is None, result["error"]
    seen = json.loads(log.read_text())
    assert seen["before"] == [] and result["imported_before_unsloth"] == []
    assert seen["loaded"] == {"name": str(model_dir), "load_in_4bit": False}
    assert seen["lora"] == {"r": 4, "alpha": 4, "vision": False, "language": True, "attention": True, "mlp": True}
    assert len(result["steps"]) == 2 and all(s["seconds"] > 0 for s in result["steps"])
    assert result["lora_modules"] > 0 and len(result["log"]) == 2
    # the separate site: the child imported the stand-in from it, not from this interpreter's path
    assert result["versions"]["unsloth"] is None and str(site) not in sys.path

    summary = summarize(settings, load_shapes("qwen3_vl_8b"), {"matmul_tflops": 800, "copy_bandwidth_tbs": 4.0},
                        [result], prompt_tokens=300)
    row = summary["paths"]["unsloth"]
    assert row["step_seconds"] == result["steps"][1]["seconds"] and row["lora_modules"] == result["lora_modules"]
    table = markdown_table(summary)
    assert f"| unsloth | {row['step_seconds']:.1f} |" in table
    assert "unsloth: its own process (" in table and "imported before unsloth: nothing it patches" in table


@pytest.mark.slow
def test_a_failing_unsloth_process_is_recorded_as_the_paths_error(fake_unsloth, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_UNSLOTH_FAIL", "1")
    settings = _settings()
    model_dir = build_processor(tmp_path / "work", settings.image_size)
    result = run_unsloth(settings, model_dir, tmp_path / "work")
    assert result["steps"] == [] and "exited 1" in result["error"] and "stand-in refuses to load" in result["error"]
    summary = summarize(settings, load_shapes("qwen3_vl_8b"), {"matmul_tflops": 800, "copy_bandwidth_tbs": 4.0},
                        [result], prompt_tokens=300)
    assert "| unsloth | failed: the unsloth process exited 1" in markdown_table(summary)


def test_a_separate_site_leaves_only_itself_and_vlmrl_importable(fake_unsloth, monkeypatch):
    site, _ = fake_unsloth
    monkeypatch.setenv("PYTHONPATH", "/somewhere/newer-trl")
    paths = child_env()["PYTHONPATH"].split(os.pathsep)
    assert paths[0] == str(site) and len(paths) == 2 and (Path(paths[1]) / "vlmrl" / "__init__.py").is_file()


def test_without_unsloth_or_cuda_the_reason_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(SITE_ENV, str(tmp_path))  # an empty folder: no unsloth in it
    reason = unsloth_unavailable_reason()
    assert reason is not None and "\n" not in reason and f"unsloth in {SITE_ENV}={tmp_path}: no" in reason


def test_the_cli_refuses_the_unsloth_path_in_one_line_without_unsloth(tmp_path):
    env = {**os.environ, SITE_ENV: str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "vlmrl.cli", "bench", "--paths", "vlmrl,unsloth", "--out",
                           str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=120, check=False)
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "bench path unsloth needs the unsloth package" in lines[0]
    assert not (tmp_path / "out").exists()


REPO = Path(__file__).resolve().parents[1]


def test_slimming_the_unsloth_wheel_drops_studio_and_the_cli_and_keeps_the_library(tmp_path):
    import importlib.util
    import zipfile

    spec = importlib.util.spec_from_file_location("slim", REPO / "benchmarks" / "slim_unsloth_wheel.py")
    slim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(slim)
    wheel = tmp_path / "unsloth-1.0-py3-none-any.whl"
    files = {"unsloth/__init__.py": "x = 1\n", "studio/big.js": "a" * 10000, "unsloth_cli/app.py": "app = 1\n",
             "unsloth-1.0.dist-info/top_level.txt": "studio\nunsloth\nunsloth_cli\n",
             "unsloth-1.0.dist-info/entry_points.txt": "[console_scripts]\nunsloth = unsloth_cli:app\n",
             "unsloth-1.0.dist-info/RECORD": "unsloth/__init__.py,sha256=a,6\nstudio/big.js,sha256=b,10000\n"
                                             "unsloth_cli/app.py,sha256=c,8\nunsloth-1.0.dist-info/RECORD,,\n"}
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for name, text in files.items():
            z.writestr(name, text)
    before, after = slim.slim_wheel(wheel)
    assert after < before
    with zipfile.ZipFile(wheel) as z:
        assert sorted(z.namelist()) == sorted(n for n in files if not n.startswith(("studio/", "unsloth_cli/")))
        assert z.read("unsloth/__init__.py") == b"x = 1\n"
        assert z.read("unsloth-1.0.dist-info/top_level.txt") == b"unsloth\n"
        assert z.read("unsloth-1.0.dist-info/RECORD").decode().splitlines() == [
            "unsloth/__init__.py,sha256=a,6", "unsloth-1.0.dist-info/RECORD,,"]
        assert b"unsloth_cli" not in z.read("unsloth-1.0.dist-info/entry_points.txt")


def test_the_gpu_script_refuses_without_wheels_and_combines_what_it_finds(tmp_path):
    script = REPO / "benchmarks" / "gpu_unsloth.sh"
    env = {**os.environ, SITE_ENV: str(tmp_path / "site")}
    done = subprocess.run(["bash", str(script), str(tmp_path / "out"), "bf16"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0 and "no .whl-unsloth/*.whl here" in done.stderr
    out = tmp_path / "results"
    out.mkdir()
    (out / "h200_unsloth_4bit.json").write_text(json.dumps({"paths": {"unsloth": {"error": "x"}}}))
    (out / "h200_unsloth_4bit.md").write_text("| unsloth | failed: x |\n")
    done = subprocess.run(["bash", str(script), str(out), "combine"], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert list(json.loads((out / "h200_unsloth.json").read_text())) == ["4bit"]
    assert (out / "h200_unsloth.md").read_text().startswith("## 4bit\n\n| unsloth | failed: x |")


@pytest.mark.slow
def test_run_bench_sends_the_unsloth_path_to_its_own_process_and_writes_its_row(fake_unsloth, tmp_path, monkeypatch):
    from vlmrl.bench import run
    from vlmrl.engine.rollout.compile_cache import CompileCache

    def no_in_process_run(*args, **kwargs):
        raise AssertionError("the unsloth path ran in the bench's own process")

    saved = []
    cache = CompileCache("/c/inductor", "/c/triton", "explicit", cold=True, files_at_start=0)
    monkeypatch.setattr(run, "prepare_device", lambda settings, work, cap=True: (cache, work))
    monkeypatch.setattr(run, "measure_ceilings", lambda: {"matmul_tflops": 800, "copy_bandwidth_tbs": 4.0})
    # the tiny processor folder is a complete model: it stands in for the 8B-shaped weights saved once
    monkeypatch.setattr(run, "save_weights_once", lambda shapes, processor_dir, work: saved.append(1) or processor_dir)
    monkeypatch.setattr(run, "run_path", no_in_process_run)
    summary = run.run_bench(_settings(), tmp_path / "out", tmp_path / "work")
    assert saved == [1] and summary["paths"]["unsloth"]["error"] is None
    written = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert written["paths"]["unsloth"]["steps_measured"] == 1 and written["raw"][0]["imported_before_unsloth"] == []
    assert "| unsloth | " in (tmp_path / "out" / "bench.md").read_text()


def test_the_gpu_script_combines_paths_run_in_calls_of_their_own(tmp_path):
    """Unsloth's first step alone takes ~4 of a call's 10 minutes, so each path can run in its own call
    (`gpu_unsloth.sh OUT bf16 unsloth`); combine keeps every record, bf16 before 4-bit."""
    script = REPO / "benchmarks" / "gpu_unsloth.sh"
    for name in ("4bit", "bf16_vlmrl", "bf16_unsloth"):
        (tmp_path / f"h200_unsloth_{name}.json").write_text(json.dumps({"name": name}))
        (tmp_path / f"h200_unsloth_{name}.md").write_text(f"| {name} |\n")
    done = subprocess.run(["bash", str(script), str(tmp_path), "combine"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    combined = json.loads((tmp_path / "h200_unsloth.json").read_text())
    assert list(combined) == ["bf16_unsloth", "bf16_vlmrl", "4bit"]
    assert combined["bf16_vlmrl"] == {"name": "bf16_vlmrl"}
    assert "## bf16_unsloth\n\n| bf16_unsloth |" in (tmp_path / "h200_unsloth.md").read_text()
