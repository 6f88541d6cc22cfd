"""Stage 8, export: the adapter is saved and verified from disk, and the checks fail when they should.

One tiny model is trained once per module (2 GSPO steps, with a length-based stand-in for the correctness
reward so that advantages are non-zero and every LoRA B matrix moves off zero), then exported.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from tests.helpers import QUICK, copy_run, quick_config
from vlmrl.common.io import read_json, read_jsonl
from vlmrl.config.schema import Config
from vlmrl.engine.rollout.generation import encode_batch
from vlmrl.export.stage import ExportError, check_base_model, export_adapter, verify_adapter_weights
from vlmrl.models.loading import load_model

PASSING = ("lora_b_nonzero", "lora_finite", "base_model_matches", "reload_reproduces_logits", "merged_16bit")


EXPORT = (*QUICK, "export.merged_16bit=true")  # the small run, exporting the merged 16-bit model too


@pytest.fixture(scope="module")
def trained(quick_trained, tmp_path_factory) -> tuple[Config, Path]:
    """A copy of the session's 2-step trained run (tests/conftest.py), with this module's config."""
    output_dir = tmp_path_factory.mktemp("export")
    return quick_config(output_dir, base=EXPORT), copy_run(quick_trained, output_dir)


@pytest.fixture(scope="module")
def exported(trained) -> tuple[Config, Path, dict]:
    config, run_dir = trained
    return config, run_dir, export_adapter(config, run_dir)


def copy_trained_run(run_dir: Path, output_dir: Path) -> Path:
    """The trained run without checkpoints or exports, under output_dir (a config there finds it)."""
    target = output_dir / run_dir.name
    skip = shutil.ignore_patterns("checkpoints", "adapter", "merged-16bit", "export.json")
    shutil.copytree(run_dir, target, symlinks=True, ignore=skip)
    return target


def checks_by_name(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


def holdout_logits(model, processor, run_dir: Path) -> torch.Tensor:
    item = read_jsonl(run_dir / "data" / "holdout.jsonl")[0]
    with Image.open(run_dir / item["images"][0]) as img:
        device = next(model.parameters()).device
        batch = encode_batch(processor, [item["prompt"]], [img.convert("RGB")], device)
    with torch.inference_mode():
        return model(**batch).logits.float().cpu()


# ---------------------------------------------------------------------------------------------------------------
# a trained adapter exports with every check passed


def test_export_writes_the_adapter_and_every_check_passes(exported) -> None:
    _, run_dir, report = exported
    adapter = run_dir / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    assert read_json(run_dir / "export.json") == report
    checks = checks_by_name(report)
    for name in PASSING:
        assert checks[name]["passed"] is True, checks[name]
    assert checks["reload_reproduces_logits"]["value"] <= 1e-3
    merged = checks["merged_16bit"]["value"]
    assert merged["max_logit_diff"] <= 1e-3 and merged["greedy_token_agreement"] == 1.0 and merged["items"] >= 1
    assert "from the 16-bit base" in checks["merged_16bit"]["detail"]
    assert checks["merged_4bit"]["passed"] is None and checks["gguf"]["passed"] is None  # not requested
    assert report["all_passed"] is True
    # paths inside the run folder are stored relative to it, so a moved run's export.json stays true
    assert (report["base_model"], report["adapter_dir"], report["source"]) == ("base-model", "adapter", "train/final")
    # shareable: a tiny base is on no hub, so it travels inside the adapter, which names it relatively
    assert report["shared_base_model"] == "base-model"
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == "base-model"
    assert (adapter / "base-model" / "config.json").is_file() and (adapter / "README.md").is_file()
    assert (adapter / "tokenizer_config.json").is_file() and (run_dir / "merged-16bit" / "tokenizer_config.json").is_file()
    # the exported B matrices are the trained ones
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    final = load_file(str(run_dir / "train" / "final" / "adapter_model.safetensors"))
    assert saved.keys() == final.keys() and all(torch.equal(saved[k], final[k]) for k in saved)
    b = [k for k in saved if "lora_B" in k]
    assert checks["lora_b_nonzero"]["value"] == f"{len(b)}/{len(b)}"


def test_the_adapter_changes_the_models_output_and_the_merged_model_matches(exported) -> None:
    """The reload check compares adapter with adapter; this one makes sure the adapter does something."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    config, run_dir, _ = exported
    loaded = load_model(config.model, run_dir)
    base = holdout_logits(loaded.model.eval(), loaded.processor, run_dir)
    with_adapter = PeftModel.from_pretrained(loaded.model, str(run_dir / "adapter")).eval()
    adapted = holdout_logits(with_adapter, loaded.processor, run_dir)
    assert (adapted - base).abs().max().item() > 1e-5

    merged = AutoModelForImageTextToText.from_pretrained(str(run_dir / "merged-16bit")).eval()
    assert not any("lora_" in name for name, _ in merged.named_parameters())  # a plain model, no PEFT
    assert torch.allclose(holdout_logits(merged, loaded.processor, run_dir), adapted, atol=1e-3)


# ---------------------------------------------------------------------------------------------------------------
# verify_adapter_weights fails on broken adapters


def _broken_copy(adapter: Path, tmp_path: Path, damage) -> tuple[Path, str]:
    target = tmp_path / "adapter"
    shutil.copytree(adapter, target)
    tensors = load_file(str(target / "adapter_model.safetensors"))
    key = damage(tensors)
    save_file(tensors, str(target / "adapter_model.safetensors"))
    return target, key


def _zero_one_b(tensors: dict) -> str:
    key = min(k for k in tensors if "lora_B" in k)
    tensors[key] = torch.zeros_like(tensors[key])
    return key


def _nan_in_one_a(tensors: dict) -> str:
    key = max(k for k in tensors if "lora_A" in k)
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] = float("nan")
    return key


def test_verify_passes_on_the_exported_adapter(exported) -> None:
    _, run_dir, _ = exported
    checks = {c.name: c for c in verify_adapter_weights(run_dir / "adapter")}
    assert checks["lora_b_nonzero"].passed is True and checks["lora_finite"].passed is True


def test_verify_fails_on_a_hand_zeroed_b(exported, tmp_path: Path) -> None:
    _, run_dir, _ = exported
    adapter, key = _broken_copy(run_dir / "adapter", tmp_path, _zero_one_b)
    checks = {c.name: c for c in verify_adapter_weights(adapter)}
    total = sum("lora_B" in k for k in load_file(str(adapter / "adapter_model.safetensors")))
    assert checks["lora_b_nonzero"].passed is False
    assert checks["lora_b_nonzero"].value == f"{total - 1}/{total}"
    assert key in checks["lora_b_nonzero"].detail
    assert checks["lora_finite"].passed is True


def test_verify_fails_on_a_nan_injected_adapter(exported, tmp_path: Path) -> None:
    _, run_dir, _ = exported
    adapter, key = _broken_copy(run_dir / "adapter", tmp_path, _nan_in_one_a)
    checks = {c.name: c for c in verify_adapter_weights(adapter)}
    assert checks["lora_finite"].passed is False and checks["lora_finite"].value == 1
    assert key in checks["lora_finite"].detail
    assert checks["lora_b_nonzero"].passed is True  # NaN is non-zero: only the finiteness check catches it


def test_verify_fails_without_the_weights_file(tmp_path: Path) -> None:
    checks = verify_adapter_weights(tmp_path)
    assert [(c.name, c.passed) for c in checks] == [("adapter_file", False)]


def test_base_model_check_fails_for_another_base(tmp_path: Path) -> None:
    recorded = {"base_model_name_or_path": "google/gemma-3-4b-it"}
    (tmp_path / "adapter_config.json").write_text(json.dumps(recorded))
    check = check_base_model(tmp_path, "/runs/demo/base-model")  # a name that is not tiny:/demo: unchanged
    assert check.passed is False and check.value == "google/gemma-3-4b-it" and "gemma-3-4b-it" in check.detail
    (tmp_path / "adapter_config.json").write_text(json.dumps({}))
    assert check_base_model(tmp_path, "/runs/demo/base-model").passed is False  # nothing recorded
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/elsewhere/base-model"}))
    assert check_base_model(tmp_path, "/runs/demo/base-model").passed is True  # a moved run: the same folder name


# ---------------------------------------------------------------------------------------------------------------
# export_adapter refuses, and records, a failed check


def test_export_raises_on_a_failed_check_and_records_it(trained, tmp_path: Path) -> None:
    config, run_dir = trained
    copy = copy_trained_run(run_dir, tmp_path)
    broken, key = _broken_copy(copy / "train" / "final", tmp_path, _zero_one_b)
    config = quick_config(tmp_path, "export.merged_16bit=false", base=EXPORT)
    with pytest.raises(ExportError) as info:
        export_adapter(config, copy, source=broken)
    message = str(info.value)
    assert "lora_b_nonzero" in message and str(copy / "export.json") in message
    report = read_json(copy / "export.json")
    checks = checks_by_name(report)
    assert report["all_passed"] is False
    assert checks["lora_b_nonzero"]["passed"] is False and key in checks["lora_b_nonzero"]["detail"]
    # the copied run's adapter records the original run's base-model folder, and that is accepted
    assert checks["base_model_matches"]["passed"] is True
    assert [n for n, c in checks.items() if c["passed"] is False] == ["lora_b_nonzero"]


def test_export_without_a_trained_adapter_loads_no_model(tmp_path: Path, monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("load_model was called before the adapter was checked")

    monkeypatch.setattr("vlmrl.models.loading.load_model", refuse)
    config = quick_config(tmp_path, base=EXPORT)
    with pytest.raises(ExportError, match=str(config.run_dir / "train" / "final")):
        export_adapter(config, config.run_dir)
    assert not (config.run_dir / "export.json").exists()


# ---------------------------------------------------------------------------------------------------------------
# issue 37: every path in export.json is relative to the run folder


def all_strings(value) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in all_strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in all_strings(v)]
    return [value] if isinstance(value, str) else []


def test_export_json_names_no_path_of_this_machine(exported) -> None:
    _, run_dir, report = exported
    assert not [s for s in all_strings(report) if str(run_dir) in s or str(run_dir.resolve()) in s]


def test_gguf_files_are_stored_relative_to_the_run_folder(tmp_path: Path, monkeypatch) -> None:
    """Before: the GGUF paths were relative to the working directory, so a moved run pointed elsewhere."""
    from vlmrl.export import gguf
    from vlmrl.export.stage import _gguf_check

    monkeypatch.chdir(tmp_path)
    run_dir = Path("runs") / "r"  # as `--set run.output_dir=runs` gives it: relative to where vlmrl was started
    files = {"model": str(run_dir / "gguf" / "model-f16.gguf"), "mmproj": str(run_dir / "gguf" / "mmproj-f16.gguf")}
    monkeypatch.setattr(gguf, "missing_requirements", list)
    monkeypatch.setattr(gguf, "find_converter", lambda configured: Path("tools/llama.cpp"))
    monkeypatch.setattr(gguf, "convert", lambda *args: {"files": dict(files), "outtype": "f16"})
    monkeypatch.setattr(gguf, "read_back", lambda found, merged: {"problems": []})
    monkeypatch.setattr(gguf, "try_generate", lambda model: {"generated": None, "detail": "skipped"})
    check = _gguf_check(quick_config(tmp_path, "export.gguf=f16", base=EXPORT), run_dir)
    assert check.value["files"] == {"model": "gguf/model-f16.gguf", "mmproj": "gguf/mmproj-f16.gguf"}
    assert check.value["converter"] == str(tmp_path.resolve() / "tools" / "llama.cpp")  # outside the run: absolute
