"""Stage 8, export: save the LoRA adapter, then verify it from disk rather than assume it.

Checks (each with its figure, all written to `export.json`):
  - every LoRA B matrix is non-zero: B starts at zero, so a zero B is a module that never trained;
  - every A and B value is finite;
  - the base model recorded in the adapter is the configured one;
  - a fresh base model + the saved adapter reproduces the in-memory model's logits on a held-out item;
  - optional `merged-16bit/`: merged, saved, reloaded, and its logits match the adapter model;
  - optional `merged-4bit/` (CUDA + bitsandbytes) and GGUF (Unsloth + llama.cpp): done when possible,
    otherwise recorded as skipped with the reason and the manual route.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlmrl.config import Config
from vlmrl.io import match_umask, read_jsonl, write_json_atomic

log = logging.getLogger(__name__)


class ExportError(RuntimeError):
    pass


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool | None  # None = skipped
    value: Any = None
    detail: str = ""

    def as_dict(self) -> dict:
        return {"name": self.name, "passed": self.passed, "value": self.value, "detail": self.detail}


def export_adapter(config: Config, run_dir: Path, *, source: Path | None = None) -> dict:
    """Save `train/final` (or `source`) to `run_dir/adapter/`, verify it, write `export.json`."""
    from vlmrl.evaluate import check_adapter
    from vlmrl.models.loading import BASE_RECORD, load_with_adapter, resolve_model_source
    from vlmrl.rundir import relative_to_run

    chosen = _chosen_checkpoint(config, run_dir) if source is None else {"choice": "given", "source": str(source)}
    source = Path(chosen["source"])
    check_adapter(source, config, run_dir)
    out = run_dir / "adapter"
    trained = load_with_adapter(config.model, run_dir, source)
    if out.exists():
        shutil.rmtree(out)
    trained.model.save_pretrained(str(out))
    match_umask(out)  # safetensors writes the weights 0600
    if (source / BASE_RECORD).is_file():
        shutil.copyfile(source / BASE_RECORD, out / BASE_RECORD)
    checks = verify_adapter_weights(out)
    expected_base = resolve_model_source(config.model.name, run_dir)
    checks.append(check_base_model(out, expected_base))

    item = _probe_item(run_dir)
    reference = _logits(trained, run_dir, item)
    reloaded = load_with_adapter(config.model, run_dir, out)
    diff = (reference - _logits(reloaded, run_dir, item)).abs().max().item()
    checks.append(Check("reload_reproduces_logits", diff <= config.export.logits_atol, diff,
                        f"max |logit difference| on item {item['id']}, tolerance {config.export.logits_atol}"))
    del reloaded
    if config.export.merged_16bit:
        checks.append(_merged_16bit(config, run_dir, trained, item, reference))
    checks.append(_merged_4bit(config, run_dir, trained, item, reference))
    checks.append(_gguf_check(config))

    report = {
        "fingerprint": export_fingerprint(config),
        # relative to the run folder where inside it: a moved or copied run's export.json stays true
        "adapter_dir": relative_to_run(out, run_dir),
        "source": relative_to_run(source, run_dir),
        "base_model": relative_to_run(expected_base, run_dir),
        "checkpoint": {**chosen, "source": relative_to_run(Path(chosen["source"]), run_dir)},
        "checks": [c.as_dict() for c in checks],
        "all_passed": all(c.passed is not False for c in checks),
    }
    write_json_atomic(run_dir / "export.json", report)
    if not report["all_passed"]:
        failed = ", ".join(c.name for c in checks if c.passed is False)
        raise ExportError(f"export verification failed ({failed}); see {run_dir / 'export.json'}.")
    return report


def _chosen_checkpoint(config: Config, run_dir: Path) -> dict:
    """Which adapter folder export.checkpoint picks (`best`: the kept best validation step), as recorded."""
    from vlmrl.evaluate import default_adapter_dir
    from vlmrl.validation import BEST_DIR, best_checkpoint

    if config.export.checkpoint == "last":
        return {"choice": "last", "source": str(default_adapter_dir(run_dir))}
    best = best_checkpoint(run_dir)
    if best is None:
        raise ExportError(f"export.checkpoint=best: no kept best checkpoint in {run_dir / 'train' / BEST_DIR}; "
                          "train with train.eval_every_steps set (and export.checkpoint=best), or export `last`.")
    return {"choice": "best", "source": str(run_dir / "train" / BEST_DIR), **best}


def export_fingerprint(config: Config) -> str:
    from vlmrl.train import train_fingerprint

    return train_fingerprint(config) + config.fingerprint("export")[:8]


def is_exported(config: Config, run_dir: Path) -> bool:
    path = run_dir / "export.json"
    if not path.exists() or not (run_dir / "adapter" / "adapter_config.json").exists():
        return False
    report = json.loads(path.read_text())
    return bool(report.get("all_passed")) and report.get("fingerprint") == export_fingerprint(config)


def verify_adapter_weights(adapter_dir: Path) -> list[Check]:
    """Non-zero B and finite A/B, read from the saved safetensors file."""
    from safetensors.torch import load_file

    path = adapter_dir / "adapter_model.safetensors"
    if not path.exists():
        return [Check("adapter_file", False, None, f"{path} missing")]
    tensors = load_file(str(path))
    b_mats = {k: v for k, v in tensors.items() if "lora_B" in k}
    zero_b = sorted(k for k, v in b_mats.items() if not torch.any(v != 0))
    non_finite = sorted(k for k, v in tensors.items() if "lora_" in k and not torch.isfinite(v).all())
    return [
        Check("lora_b_nonzero", bool(b_mats) and not zero_b, f"{len(b_mats) - len(zero_b)}/{len(b_mats)}",
              ("zero B (never trained): " + ", ".join(zero_b[:5])) if zero_b else "every B matrix has non-zero entries"),
        Check("lora_finite", not non_finite, len(non_finite),
              ("non-finite: " + ", ".join(non_finite[:5])) if non_finite else "all A/B values finite"),
    ]


def check_base_model(adapter_dir: Path, expected: str) -> Check:
    recorded = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    # A run directory copied or moved elsewhere records its old base-model path: accept the same folder name,
    # as `evaluate.check_adapter` does, so a copied run that evaluates also exports.
    same = recorded is not None and (
        recorded == expected
        or Path(recorded).resolve() == Path(expected).resolve()
        or Path(recorded).name == Path(expected).name
    )
    return Check("base_model_matches", same, recorded, f"expected {expected}")


def _probe_item(run_dir: Path) -> dict:
    items = read_jsonl(run_dir / "data" / "holdout.jsonl")
    if not items:
        raise ExportError(f"{run_dir / 'data' / 'holdout.jsonl'}: no held-out item to verify logits on.")
    return items[0]


@torch.inference_mode()
def _logits(loaded: Any, run_dir: Path, item: dict) -> torch.Tensor:
    from PIL import Image

    from vlmrl.data.items import record_images
    from vlmrl.generation import encode_batch

    images = []
    for path in record_images(item):  # every image of the probe item, in order
        with Image.open(run_dir / path) as img:
            images.append(img.convert("RGB"))
    batch = encode_batch(loaded.processor, [item["prompt"]], [images], loaded.device)
    return loaded.model(**batch).logits.float().cpu()


def _merged_16bit(config: Config, run_dir: Path, trained: Any, item: dict, reference: torch.Tensor) -> Check:
    from transformers import AutoModelForImageTextToText

    if config.model.load_in_4bit:
        return Check("merged_16bit", None, None, "merging into 4-bit weights is lossy; load the base in 16-bit to merge")
    out = run_dir / "merged-16bit"
    merged = trained.model.merge_and_unload()
    merged.save_pretrained(str(out))
    trained.processor.save_pretrained(str(out))
    reloaded = AutoModelForImageTextToText.from_pretrained(str(out), dtype=merged.dtype).to(trained.device).eval()
    trained.model = reloaded
    diff = (reference - _logits(trained, run_dir, item)).abs().max().item()
    # Merging changes the summation order, so allow a few units of the dtype's rounding.
    tolerance = max(config.export.logits_atol, 1e-2 if merged.dtype != torch.float32 else config.export.logits_atol)
    return Check("merged_16bit", diff <= tolerance, diff, f"{out}: max |logit difference| vs adapter, tol {tolerance}")


def _merged_4bit(config: Config, run_dir: Path, trained: Any, item: dict, reference: torch.Tensor) -> Check:
    """Quantize `merged-16bit/` to bnb nf4, save, reload. 4-bit rounding moves logits by design, so the check is
    that the reloaded model predicts the same next token as the adapter model at >= 90% of positions."""
    if not config.export.merged_4bit:
        return Check("merged_4bit", None, None, "not requested (export.merged_4bit=false)")
    if not (torch.cuda.is_available() and importlib.util.find_spec("bitsandbytes")):
        return Check("merged_4bit", None, None, "skipped: needs CUDA and bitsandbytes (pip install 'vlmrl[quant]')")
    source = run_dir / "merged-16bit"
    if not (source / "config.json").exists():
        return Check("merged_4bit", None, None, "skipped: needs export.merged_16bit=true (it quantizes that folder)")
    from transformers import AutoModelForImageTextToText

    from vlmrl.models.loading import nf4_config

    out = run_dir / "merged-4bit"
    model = AutoModelForImageTextToText.from_pretrained(str(source), quantization_config=nf4_config(torch.bfloat16),
                                                        device_map={"": torch.cuda.current_device()})
    model.save_pretrained(str(out))
    trained.processor.save_pretrained(str(out))
    del model
    trained.model = AutoModelForImageTextToText.from_pretrained(str(out), device_map={"": torch.cuda.current_device()})
    logits = _logits(trained, run_dir, item)
    agreement = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    return Check("merged_4bit", agreement >= 0.9, agreement, f"{out}: next-token agreement with the adapter model")


def _gguf_check(config: Config) -> Check:
    if not config.export.gguf:
        return Check("gguf", None, None, "not requested (export.gguf=false)")
    if importlib.util.find_spec("unsloth") is None or shutil.which("llama-quantize") is None:
        return Check("gguf", None, None,
                     "skipped: needs Unsloth and llama.cpp. Manual route: export merged-16bit, then run llama.cpp's "
                     "convert_hf_to_gguf.py on it (and llama-quantize for q4_k_m).")
    return Check("gguf", None, None, "skipped: Unsloth GGUF export for vision models is not wired yet")
