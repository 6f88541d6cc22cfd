"""Stage 2, model load: one function from a `ModelConfig` to a model, its processor and where they came from.

Backends: Unsloth's `FastVisionModel` when it is installed and a CUDA GPU is present (`backend: auto`), else
transformers (+ bitsandbytes for 4-bit). 4-bit loads on CUDA, and on the CPU with bitsandbytes >= 0.48 (its
CPU backend quantizes and dequantizes nf4 there; slow, but the same numbers, so the seed's QLoRA recipe can be
tested offline). Where bitsandbytes cannot do 4-bit the request is an error, never a silent fallback to
16/32-bit, because the memory and numbers of such a run would not be the ones the user asked for.

`model.name` may also be `tiny:<arch>` (a random-weight offline model built into the run directory) or
`demo-policy` (the project's small warm-started policy, built on first use; see `vlmrl.models.demo`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlmrl.common.cpu_numerics import pin_cpu_threads
from vlmrl.config.builtin_models import DEMO_POLICIES, is_local_only  # noqa: F401 (re-exported)
from vlmrl.config.schema import ModelConfig
from vlmrl.models.lora import VISION_MARKERS
from vlmrl.preflight.doctor import four_bit_unsupported_reason

log = logging.getLogger(__name__)

FAMILIES = {
    "qwen3_vl": "Qwen3-VL",
    "qwen2_5_vl": "Qwen2.5-VL",
    "gemma3": "Gemma 3",
    "idefics3": "SmolVLM (Idefics3)",
}


class ModelLoadError(RuntimeError):
    """The model cannot be loaded as configured; the message says which field to change."""


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel (possibly PEFT-wrapped later)
    processor: Any  # the family's ProcessorMixin
    backend: str  # "unsloth" | "transformers"
    family: str  # a key of FAMILIES
    source: str  # the resolved hub id or folder, recorded in every artifact

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def resolve_model_source(name: str, run_dir: Path | None = None, seed: int = 0) -> str:
    """Turn `tiny:<arch>` / `demo-policy` into a folder (building it offline once; a demo policy's build is
    seeded by the run's `seed`); anything else is unchanged."""
    if not torch.cuda.is_available():  # a CPU run: the same digits whatever the host's core count
        pin_cpu_threads()
    if name.startswith("tiny:"):
        from vlmrl.models.tiny import TINY_ARCHS, build_tiny_model

        arch = name.removeprefix("tiny:")
        if arch not in TINY_ARCHS:
            raise ModelLoadError(f"model.name={name!r}: unknown tiny arch; choose tiny:{'|tiny:'.join(TINY_ARCHS)}.")
        folder = (run_dir or Path(".")) / "base-model"
        if not (folder / "config.json").exists():
            build_tiny_model(arch, folder, seed=0)
        return str(folder.resolve())
    if name in DEMO_POLICIES:
        from vlmrl.models.demo import ensure_demo_policy, recipe_for

        return str(ensure_demo_policy(recipe_for(name, seed)))
    return name


def choose_backend(config: ModelConfig) -> str:
    has_cuda = torch.cuda.is_available()
    has_unsloth = importlib.util.find_spec("unsloth") is not None
    if config.backend == "unsloth" and not (has_cuda and has_unsloth):
        raise ModelLoadError(
            "model.backend=unsloth needs the `unsloth` extra and a CUDA GPU "
            f"(unsloth installed: {has_unsloth}, CUDA: {has_cuda}); set model.backend=transformers."
        )
    if config.backend == "auto":
        return "unsloth" if (has_cuda and has_unsloth) else "transformers"
    return config.backend


def load_model(config: ModelConfig, run_dir: Path | None = None, *, for_training: bool = False,
               seed: int = 0) -> LoadedModel:
    """Load the base model and processor as configured (no adapter); `seed` is the run's (a demo policy's
    build follows it)."""
    if config.load_in_4bit and (reason := four_bit_unsupported_reason()):
        raise ModelLoadError(f"model.load_in_4bit=true cannot work here: {reason}.")
    backend = choose_backend(config)  # before resolving: a wrong backend should not cost a build or download
    source = resolve_model_source(config.name, run_dir, seed)
    family = detect_family(source)
    if backend == "unsloth":
        model, processor = _load_unsloth(config, source)
    else:
        model, processor = _load_transformers(config, source)
    if getattr(processor, "tokenizer", None) is not None:
        processor.tokenizer.padding_side = "left"  # batched generation appends on the right
    log.info("loaded %s (%s, %s backend)", source, FAMILIES.get(family, family), backend)
    return LoadedModel(model=model, processor=processor, backend=backend, family=family, source=source)


BASE_RECORD = "vlmrl_base.json"


def base_identity(config_name: str, source: str) -> dict:
    """What an adapter must be loaded onto: the configured name and a hash of the base model's config.json
    (local folders only; a hub id is identified by its name)."""
    import hashlib

    config_json = Path(source) / "config.json"
    digest = hashlib.sha256(config_json.read_bytes()).hexdigest()[:16] if config_json.is_file() else None
    return {"model_name": config_name, "config_sha256": digest}


ADAPTER_WEIGHTS = "adapter_model.safetensors"  # PEFT's weights file, beside its adapter_config.json


def adapter_files_problem(folder: Path, *, require_weights: bool = True) -> str | None:
    """Why the adapter saved in `folder` cannot be trusted (None when it can): `adapter_config.json` must parse
    as a JSON object and `adapter_model.safetensors` be whole (its header parses and the file is as long as the
    header says; absent, it is a problem only when `require_weights`). Nothing is loaded: a save cut short by a
    kill or a full disk is found before a load trips on it. A folder holding PEFT's older `adapter_model.bin`
    instead is not checked beyond its config."""
    config = folder / "adapter_config.json"
    try:
        parsed = json.loads(config.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"{config.name} missing"
    except (OSError, ValueError) as exc:
        return f"{config.name} is not valid JSON ({str(exc).splitlines()[0]})"
    if not isinstance(parsed, dict):
        return f"{config.name} is not a JSON object"
    weights = folder / ADAPTER_WEIGHTS
    if not weights.exists() and ((folder / "adapter_model.bin").exists() or not require_weights):
        return None
    return safetensors_problem(weights)


def safetensors_problem(path: Path) -> str | None:
    """Why the safetensors file `path` is not whole (None when it is), from its header alone: 8 bytes of header
    length, the JSON header, then the tensors' bytes up to the largest end offset the header names."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else None
            if length is None or length > size - 8:
                return f"{path.name} is truncated ({size} bytes: its header is cut off)"
            header = json.loads(f.read(length))
        ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    except FileNotFoundError:
        return f"{path.name} missing"
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        return f"{path.name} has an unreadable header ({type(exc).__name__})"
    need = 8 + length + max(ends, default=0)
    if size < need:
        return f"{path.name} is truncated ({size} bytes; its header describes {need})"
    return None


def adapter_base_problem(adapter: Path, model_name: str, run_dir: Path | None = None, seed: int = 0) -> str | None:
    """Why `adapter` does not belong on the base `model_name` names (None when it does): no adapter there, a
    damaged one (`adapter_files_problem`), or one trained on another base. `vlmrl train` records the base exactly
    (`vlmrl_base.json`: the name and a hash of its config.json); an adapter without that record is matched by
    PEFT's `base_model_name_or_path`, where a run folder copied or moved elsewhere keeps the same folder name."""
    adapter_config = adapter / "adapter_config.json"
    if not adapter_config.is_file():
        return f"{adapter}: no adapter here (adapter_config.json missing); train first or pass --adapter DIR."
    if damage := adapter_files_problem(adapter, require_weights=False):  # missing weights: PEFT says so itself
        return (f"{adapter}: damaged adapter ({damage}); if it is a run's train/final, `vlmrl train` or `vlmrl run` "
                "rebuilds it from the last good checkpoint.")
    recorded = json.loads(adapter_config.read_text()).get("base_model_name_or_path")
    expected = resolve_model_source(model_name, run_dir, seed)
    identity_file = adapter / BASE_RECORD
    if identity_file.is_file():  # exact, and independent of where the run lives
        trained_on = json.loads(identity_file.read_text())
        if trained_on != base_identity(model_name, expected):
            return (f"{adapter}: this adapter was trained on {trained_on}, but this config's base model is "
                    f"{base_identity(model_name, expected)}.")
        return None
    same = recorded is not None and (recorded == expected or Path(recorded).name == Path(expected).name
                                     or Path(recorded).resolve() == Path(expected).resolve())
    if not same:
        return f"{adapter}: this adapter was trained on {recorded!r}, but model.name resolves to {expected!r}."
    return None


def detect_family(source: str) -> str:
    """The model family from a local config.json, or from the hub id's name when not local."""
    config_path = Path(source) / "config.json"
    if config_path.is_file():
        model_type = json.loads(config_path.read_text()).get("model_type", "")
    else:
        model_type = source.lower()
    # Hub names spell families with separators ("gemma-3", "Qwen2.5-VL"): compare with all of them removed.
    squashed = re.sub(r"[-_./]", "", model_type.lower())
    for family in FAMILIES:
        if family.replace("_", "") in squashed:
            return family
    return model_type or "unknown"


MULTIMODAL_TOKEN_FIELDS = (
    "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",  # Qwen-VL
    "image_token_index", "boi_token_index", "eoi_token_index",  # Gemma 3
)


def multimodal_token_ids(model_config: Any) -> list[int]:
    """Image/video placeholder and delimiter ids. A sampled one would make the next forward pass look for an
    image that is not there (Qwen's rope index crashes on a stray `<|vision_start|>`), so rollouts suppress them.
    TRL suppresses only `image_token_id`."""
    ids = {getattr(model_config, name, None) for name in MULTIMODAL_TOKEN_FIELDS}
    return sorted(i for i in ids if isinstance(i, int))


def resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, name)


def _load_transformers(config: ModelConfig, source: str) -> tuple[Any, Any]:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    kwargs: dict[str, Any] = {"dtype": resolve_dtype(config.dtype)}
    if config.attn_implementation != "auto":
        kwargs["attn_implementation"] = config.attn_implementation
    if config.load_in_4bit:
        kwargs["quantization_config"] = nf4_config(resolve_dtype(config.dtype))
        kwargs["device_map"] = {"": torch.cuda.current_device()} if torch.cuda.is_available() else "cpu"
    elif torch.cuda.is_available():
        kwargs["device_map"] = {"": torch.cuda.current_device()}
    try:
        model = AutoModelForImageTextToText.from_pretrained(source, **kwargs)
        processor = AutoProcessor.from_pretrained(source)
    except OSError as exc:
        raise ModelLoadError(f"model.name={source!r}: cannot load ({str(exc).splitlines()[0]}).") from None
    return model, processor


def nf4_config(compute_dtype: torch.dtype) -> Any:
    """The one 4-bit layout used everywhere (loading, the merged-4bit export, the benchmark)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
        # The vision tower and projector (lora.VISION_MARKERS: every family's names, the LoRA check's too) are
        # frozen and small next to the language model: keep them exact. transformers 5 matches these from the
        # start of the module name (or as a suffix), so "visual" alone no longer skips "model.visual.blocks...";
        # both spellings keep older layouts (top-level `visual`) covered.
        llm_int8_skip_modules=[*VISION_MARKERS, *(f"model.{m}" for m in VISION_MARKERS), "lm_head"],
    )


def load_with_adapter(config: ModelConfig, run_dir: Path | None, adapter: Path | None, seed: int = 0) -> LoadedModel:
    """The base model with a saved LoRA adapter on top (or none), in eval mode."""
    loaded = load_model(config, run_dir, seed=seed)
    if adapter is not None:
        from peft import PeftModel

        loaded.model = PeftModel.from_pretrained(loaded.model, str(adapter))
    loaded.model.eval()
    return loaded


def _load_unsloth(config: ModelConfig, source: str) -> tuple[Any, Any]:
    from unsloth import FastVisionModel

    model, processor = FastVisionModel.from_pretrained(
        source,
        load_in_4bit=config.load_in_4bit,
        max_seq_length=config.max_seq_length,
        dtype=None if config.dtype == "auto" else resolve_dtype(config.dtype),
    )
    return model, processor
