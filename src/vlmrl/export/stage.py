"""Stage 8, export: save the LoRA adapter, then verify it from disk rather than assume it.

Checks (each with its figure, all written to `export.json`):
  - every LoRA B matrix is non-zero: B starts at zero, so a zero B is a module that never trained;
  - every A and B value is finite;
  - the base model recorded in the adapter is the configured one;
  - a fresh base model + the saved adapter reproduces the in-memory model's logits on a held-out item;
  - optional `merged-16bit/` and `merged-4bit/` (also over an nf4 base, CPU or CUDA): merged, saved, reloaded
    with plain transformers, logits and greedy tokens compared with base + adapter (`vlmrl.export.merge`);
  - optional GGUF through llama.cpp's converter, read back (`vlmrl.export.gguf`).
Every exported folder gets the processor and a model card (`vlmrl.export.share`); `push_to_hub` uploads one.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlmrl.common.io import match_umask, read_jsonl, write_json_atomic
from vlmrl.config.schema import Config
from vlmrl.models.loading import adapter_base_problem
from vlmrl.run import layout
from vlmrl.run.claim import relative_to_run

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
    """Save `train/final` (or `source`) to `run_dir/adapter/`, verify it, write the merges and GGUF asked for,
    make every folder shareable (processor + model card), write `export.json`."""
    from vlmrl.export import merge as em
    from vlmrl.export.share import save_processor, shareable_base_name, write_model_card
    from vlmrl.models.loading import BASE_RECORD, load_with_adapter, resolve_model_source

    chosen = _chosen_checkpoint(config, run_dir) if source is None else {"choice": "given", "source": str(source)}
    source = Path(chosen["source"])
    if problem := adapter_base_problem(source, config.model.name, run_dir, config.run.seed):
        raise ExportError(problem)
    out = run_dir / layout.ADAPTER
    trained = load_with_adapter(config.model, run_dir, source, config.run.seed)
    if out.exists():
        shutil.rmtree(out)
    trained.model.save_pretrained(str(out))
    match_umask(out)  # safetensors writes the weights 0600
    if (source / BASE_RECORD).is_file():
        shutil.copyfile(source / BASE_RECORD, out / BASE_RECORD)
    checks = verify_adapter_weights(out)
    expected_base = resolve_model_source(config.model.name, run_dir, config.run.seed)
    checks.append(check_base_model(out, config.model.name, run_dir, config.run.seed))

    items = _probe_items(run_dir)
    reference = em.logits(trained, run_dir, items[0])
    reloaded = load_with_adapter(config.model, run_dir, out, config.run.seed)
    diff = (reference - em.logits(reloaded, run_dir, items[0])).abs().max().item()
    checks.append(Check("reload_reproduces_logits", diff <= em.LOGITS_ATOL, diff,
                        f"max |logit difference| on item {items[0]['id']}, tolerance {em.LOGITS_ATOL}"))
    del reloaded
    base_name = shareable_base_name(config, out, expected_base)
    save_processor(trained.processor, out)
    write_model_card(out, config, run_dir, kind="adapter", base_name=base_name)
    checks += _merged_checks(config, run_dir, trained, items, base_name, reference)
    checks.append(_gguf_check(config, run_dir))

    report = {
        "fingerprint": layout.export_fingerprint(config),
        # relative to the run folder where inside it: a moved or copied run's export.json stays true
        "adapter_dir": relative_to_run(out, run_dir),
        "source": relative_to_run(source, run_dir),
        "base_model": relative_to_run(expected_base, run_dir),
        "checkpoint": {**chosen, "source": relative_to_run(Path(chosen["source"]), run_dir)},
        "shared_base_model": base_name,
        "checks": [c.as_dict() for c in checks],
        "all_passed": all(c.passed is not False for c in checks),
    }
    write_json_atomic(run_dir / layout.EXPORT, report)
    if not report["all_passed"]:
        failed = ", ".join(c.name for c in checks if c.passed is False)
        raise ExportError(f"export verification failed ({failed}); see {run_dir / 'export.json'}.")
    return report


def _chosen_checkpoint(config: Config, run_dir: Path) -> dict:
    """Which adapter folder export.checkpoint picks (`best`: the kept best validation step), as recorded."""
    if config.export.checkpoint == "last":
        return {"choice": "last", "source": str(run_dir / layout.FINAL)}
    best = layout.best_checkpoint(run_dir, config)  # None too when kept by another training
    if best is None:
        raise ExportError(f"export.checkpoint=best: no best checkpoint of this training in {run_dir / layout.BEST} "
                          "(none kept, or kept by another training config); train with train.eval_every_steps set "
                          "(and export.checkpoint=best), or export `last`.")
    return {"choice": "best", "source": str(run_dir / layout.BEST), **best}


def push_to_hub(run_dir: Path, repo_id: str, *, private: bool, folder: str = "adapter", api: Any = None) -> str:
    """Upload an exported folder (`adapter`, `merged-16bit`, `merged-4bit`, `gguf`) of a verified export."""
    from vlmrl.export.share import push_folder

    report_path = run_dir / layout.EXPORT
    if not report_path.is_file() or not json.loads(report_path.read_text()).get("all_passed"):
        raise ExportError(f"{run_dir}: no verified export (export.json missing or failed); run vlmrl export first.")
    path = run_dir / folder
    if not path.is_dir():
        raise ExportError(f"{path}: not exported; choose one of adapter, merged-16bit, merged-4bit, gguf that exists.")
    try:
        return push_folder(path, repo_id, private=private, api=api)
    except Exception as exc:  # noqa: BLE001  (network, auth, quota: whatever the hub says, in one line)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ExportError(f"upload to {repo_id} failed: {first} (a token: `hf auth login` or $HF_TOKEN)") from None


def verify_adapter_weights(adapter_dir: Path) -> list[Check]:
    """Non-zero B and finite A/B, read from the saved safetensors file."""
    from safetensors.torch import load_file

    path = adapter_dir / "adapter_model.safetensors"
    if not path.exists():
        return [Check("adapter_file", False, None, f"{path.parent.name}/{path.name} missing")]  # no machine path
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


def check_base_model(adapter_dir: Path, model_name: str, run_dir: Path | None = None, seed: int = 0) -> Check:
    """The exported adapter belongs on the configured base (`vlmrl.models.loading.adapter_base_problem`)."""
    problem = adapter_base_problem(adapter_dir, model_name, run_dir, seed)
    recorded = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if recorded and run_dir is not None:  # a base inside the run (a tiny model): relative, as every path stored
        recorded = relative_to_run(recorded, run_dir)
    return Check("base_model_matches", problem is None, recorded, problem or "the adapter's recorded base is this config's")


def _probe_items(run_dir: Path, count: int = 3) -> list[dict]:
    items = read_jsonl(run_dir / layout.HOLDOUT)
    if not items:
        raise ExportError(f"{run_dir / layout.HOLDOUT}: no held-out item to verify logits on.")
    return items[:count]


def _merged_checks(config: Config, run_dir: Path, trained: Any, items: list[dict], base_name: str,
                   first_logits: torch.Tensor) -> list[Check]:
    """`merged-16bit/` and `merged-4bit/`, each reloaded with plain transformers and compared with base+adapter."""
    from vlmrl.export import merge as em
    from vlmrl.export.share import save_processor, write_model_card
    from vlmrl.models.loading import four_bit_unsupported_reason

    e = config.export
    if not (e.merged_16bit or e.merged_4bit or e.gguf != "off"):
        return [Check("merged_16bit", None, None, "not requested (export.merged_16bit=false)"),
                Check("merged_4bit", None, None, "not requested (export.merged_4bit=false)")]
    reference = em.reference_outputs(trained, run_dir, items, first_logits)  # item 0's logits: computed once
    adapter = run_dir / layout.ADAPTER
    merged16 = run_dir / "merged-16bit"
    dtype = em.write_merged_16bit(config, run_dir, trained, adapter, merged16)
    save_processor(trained.processor, merged16)
    checks = [_route_check("merged_16bit", merged16, run_dir, items, reference,
                           em.merged_tolerance(torch.bfloat16 if config.model.load_in_4bit else dtype),
                           "from the dequantized nf4 base" if config.model.load_in_4bit else "from the 16-bit base")]
    write_model_card(merged16, config, run_dir, kind="merged-16bit", base_name=base_name)
    if e.merged_4bit:
        if (reason := four_bit_unsupported_reason()) is not None:
            checks.append(Check("merged_4bit", False, None, f"cannot quantize here: {reason}"))
        else:
            merged4 = run_dir / "merged-4bit"
            em.write_merged_4bit(merged16, merged4)
            save_processor(trained.processor, merged4)
            checks.append(_route_check("merged_4bit", merged4, run_dir, items, reference, em.NF4_TOLERANCE,
                                       "merged-16bit re-quantized to nf4"))
            write_model_card(merged4, config, run_dir, kind="merged-4bit", base_name=base_name)
    else:
        checks.append(Check("merged_4bit", None, None, "not requested (export.merged_4bit=false)"))
    if not e.merged_16bit:  # written only as the source of merged-4bit / GGUF
        checks[0] = Check("merged_16bit", checks[0].passed, checks[0].value,
                          checks[0].detail + " (written as the source of merged-4bit/GGUF)")
    return checks


def _route_check(name: str, folder: Path, run_dir: Path, items: list[dict], reference: Any, tolerance: Any,
                 route: str) -> Check:
    from vlmrl.export import merge as em

    loaded = em.load_plain(folder)
    result = em.compare(loaded, run_dir, items, reference, tolerance)
    del loaded
    passed = result.pop("passed")
    return Check(name, passed, result, f"{relative_to_run(folder, run_dir)} ({route}) reloaded with plain "
                 f"transformers vs base+adapter on {len(items)} held-out items; tolerance: {tolerance.describe()}")


def _gguf_check(config: Config, run_dir: Path) -> Check:
    from vlmrl.export import gguf as eg

    if config.export.gguf == "off":
        return Check("gguf", None, None, "not requested (export.gguf=off)")
    missing = eg.missing_requirements()
    if missing:
        raise ExportError(f"export.gguf={config.export.gguf} needs {', '.join(missing)}: pip install 'vlmrl[gguf]'.")
    try:
        llama_cpp = eg.find_converter(config.export.llama_cpp_dir)
        if llama_cpp is None:
            llama_cpp = eg.fetch_converter()  # pip download of llama-cpp-python's sdist into the cache, once
        result = eg.convert(run_dir / "merged-16bit", run_dir / "gguf", config.export.gguf, llama_cpp)
    except eg.GgufError as exc:
        raise ExportError(str(exc)) from None
    result["read_back"] = eg.read_back(result["files"], run_dir / "merged-16bit")
    result["llama_cpp_generation"] = eg.try_generate(result["files"]["model"])
    result["files"] = {kind: relative_to_run(path, run_dir) for kind, path in result["files"].items()}
    result["converter"] = relative_to_run(Path(llama_cpp).resolve(), run_dir)  # outside the run: absolute
    passed = not result["read_back"]["problems"] and result["llama_cpp_generation"]["generated"] is not False
    return Check("gguf", passed, result, "converted by llama.cpp's convert_hf_to_gguf.py, read back with the gguf "
                 "package (block count, embedding shape and values vs merged-16bit); "
                 + result["llama_cpp_generation"]["detail"])
