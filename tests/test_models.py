"""Stages 2-3: every tiny family loads through `load_model`, LoRA lands on the language layers only.

The tiny models are the three real architectures with random weights (vlmrl.models.tiny), so the module
names the layout checks see are the ones a hub checkpoint has. Each family is built once per module.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from vlmrl.config.schema import LoraConfig, ModelConfig
from vlmrl.models.loading import ModelLoadError, detect_family, load_model
from vlmrl.models.lora import (
    ATTENTION_PROJ,
    MLP_PROJ,
    LoraLayoutError,
    apply_lora,
    is_language_param,
    is_vision_param,
    verify_lora_layout,
)
from vlmrl.models.tiny import TINY_ARCHS

MODEL_CLASSES = {
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
}
NUM_LAYERS = 2  # build_tiny_model's default
ON_CPU = not torch.cuda.is_available()
CPU_ONLY = pytest.mark.skipif(not ON_CPU, reason="checks what a CPU-only machine refuses")
VISION_PREFIXES = (
    "model.visual.", "model.vision_tower.", "model.multi_modal_projector.", "model.vision_model.", "model.connector.",
)  # fmt: skip


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory) -> dict[str, Path]:
    """One run directory per family; `tiny:<arch>` builds its base-model there on first load."""
    return {arch: tmp_path_factory.mktemp(f"models_{arch}") for arch in TINY_ARCHS}


def _load(arch: str, run_dir: Path, **fields):
    return load_model(ModelConfig(name=f"tiny:{arch}", backend="transformers", **fields), run_dir)


# ---------------------------------------------------------------------------------------------------------------
# loading


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_each_tiny_family_loads_through_load_model(arch: str, run_dirs) -> None:
    loaded = _load(arch, run_dirs[arch])
    assert loaded.backend == "transformers"
    assert loaded.family == arch
    assert type(loaded.model).__name__ == MODEL_CLASSES[arch]
    assert loaded.source == str((run_dirs[arch] / "base-model").resolve())
    if ON_CPU:
        assert loaded.device == torch.device("cpu")
        assert next(loaded.model.parameters()).dtype == torch.float32  # dtype auto = float32 on the CPU
    assert loaded.processor.tokenizer.padding_side == "left"  # batched generation needs left padding


@CPU_ONLY
def test_load_in_4bit_on_cpu_with_an_old_bitsandbytes_is_an_error_naming_the_field(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object() if name == "bitsandbytes" else None)
    monkeypatch.setattr("importlib.metadata.version", lambda name: "0.45.5")
    with pytest.raises(ModelLoadError) as info:
        _load("qwen3_vl", tmp_path, load_in_4bit=True)
    message = str(info.value)
    assert "model.load_in_4bit" in message and "0.45.5" in message and "bitsandbytes>=0.48" in message
    assert "\n" not in message
    assert not (tmp_path / "base-model").exists()  # refused before anything was built, no silent fallback


def test_load_in_4bit_without_bitsandbytes_says_what_to_install(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ModelLoadError, match=r"pip install 'vlmrl\[quant\]'"):
        _load("qwen3_vl", tmp_path, load_in_4bit=True)
    assert not (tmp_path / "base-model").exists()


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed (dev extra)")
def test_load_in_4bit_loads_nf4_layers_here_and_lora_trains_over_them(run_dirs) -> None:
    from bitsandbytes.nn import Linear4bit

    loaded = _load("qwen3_vl", run_dirs["qwen3_vl"], load_in_4bit=True)
    layers = loaded.model.model.language_model.layers
    assert isinstance(layers[0].self_attn.q_proj, Linear4bit) and isinstance(layers[0].mlp.down_proj, Linear4bit)
    assert not any(isinstance(m, Linear4bit) for m in loaded.model.model.visual.modules())  # vision kept exact
    model, _ = apply_lora(loaded.model, LoraConfig(r=4, alpha=8))
    ids = torch.randint(0, 100, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


@CPU_ONLY
def test_unsloth_backend_without_unsloth_or_cuda_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelConfig(name="tiny:qwen3_vl", backend="unsloth"), tmp_path)
    message = str(info.value)
    assert "model.backend=unsloth" in message and "model.backend=transformers" in message


@CPU_ONLY
def test_unsloth_backend_is_refused_before_the_model_is_built(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="model.backend=unsloth"):
        load_model(ModelConfig(name="tiny:gemma3", backend="unsloth"), tmp_path)
    assert not (tmp_path / "base-model").exists()


@CPU_ONLY
def test_auto_backend_is_transformers_on_the_cpu(run_dirs) -> None:
    loaded = load_model(ModelConfig(name="tiny:qwen3_vl", backend="auto"), run_dirs["qwen3_vl"])
    assert loaded.backend == "transformers"


def test_unknown_tiny_arch_names_the_choices(tmp_path: Path) -> None:
    choices = r"tiny:qwen3_vl\|tiny:qwen2_5_vl\|tiny:gemma3\|tiny:idefics3"
    with pytest.raises(ModelLoadError, match=rf"tiny:llava.*{choices}"):
        _load("llava", tmp_path)


@pytest.mark.parametrize(
    ("source", "family"),
    [
        ("Qwen/Qwen3-VL-8B-Instruct", "qwen3_vl"),
        ("unsloth/Qwen3-VL-8B-Instruct-unsloth-bnb-4bit", "qwen3_vl"),
        ("Qwen/Qwen2.5-VL-7B-Instruct", "qwen2_5_vl"),
        ("google/gemma-3-4b-it", "gemma3"),  # the hub spells it with a dash
        ("unsloth/gemma-3-12b-it-unsloth-bnb-4bit", "gemma3"),
    ],
)
def test_family_is_detected_from_hub_ids(source: str, family: str) -> None:
    assert detect_family(source) == family


def test_family_of_an_unknown_model_is_not_guessed() -> None:
    assert detect_family("Qwen/Qwen2-VL-2B-Instruct") not in TINY_ARCHS  # Qwen2-VL is not Qwen2.5-VL


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_family_is_read_from_a_local_config_json(arch: str, run_dirs) -> None:
    _load(arch, run_dirs[arch])  # makes sure the folder exists
    folder = run_dirs[arch] / "base-model"
    renamed = folder.parent / "some-checkpoint"  # the folder name says nothing; config.json does
    if not renamed.exists():
        renamed.symlink_to(folder, target_is_directory=True)
    assert detect_family(str(renamed)) == arch


# ---------------------------------------------------------------------------------------------------------------
# LoRA


def _expected_lora_params(model, r: int) -> int:
    """r * (in + out) for every adapted linear layer, counted from the modules themselves."""
    total = 0
    for module in model.modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            base = module.base_layer
            total += r * (base.in_features + base.out_features)
    return total


def _lora_module_names(model) -> list[str]:
    return sorted({name.split(".lora_")[0] for name, _ in model.named_parameters() if ".lora_" in name})


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_lora_adapts_only_language_attention_and_mlp(arch: str, run_dirs) -> None:
    loaded = _load(arch, run_dirs[arch])
    named = loaded.model.named_parameters()
    vision_before = sum(p.numel() for n, p in named if n.startswith(VISION_PREFIXES))
    model, report = apply_lora(loaded.model, LoraConfig(r=4, alpha=8))

    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable, "nothing trains"
    for name in trainable:
        assert ".lora_A." in name or ".lora_B." in name, name
        assert is_language_param(name), name

    modules = _lora_module_names(model)
    suffixes = sorted({m.rsplit(".", 1)[-1] for m in modules})
    assert suffixes == sorted(ATTENTION_PROJ + MLP_PROJ)
    assert len(modules) == NUM_LAYERS * len(ATTENTION_PROJ + MLP_PROJ)
    assert all(re.search(r"\.(language_model|text_model)\.layers\.", m) for m in modules)

    # The vision side is untouched, although Gemma's SigLIP has q_proj/k_proj/v_proj and Qwen2.5-VL's vision
    # blocks have gate_proj/up_proj/down_proj: names the language targets share.
    vision = [(n, p) for n, p in model.named_parameters() if is_vision_param(n)]
    assert vision and not any(p.requires_grad for _, p in vision)
    assert not any(".lora_" in n for n, _ in vision)
    assert sum(p.numel() for _, p in vision) == vision_before

    assert report.trainable_params == sum(p.numel() for p in trainable.values())
    assert report.trainable_params == _expected_lora_params(model, r=4)
    assert report.total_params == sum(p.numel() for p in model.parameters())
    assert report.lora_modules == len(modules)
    assert report.vision_trainable_params == 0
    summary = report.as_dict()
    assert summary["trainable_percent"] == round(100 * report.trainable_params / report.total_params, 4)
    assert 0 < summary["trainable_percent"] < 100


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_lora_b_starts_at_zero_so_the_wrapped_model_equals_the_base(arch: str, run_dirs) -> None:
    loaded = _load(arch, run_dirs[arch])
    model, _ = apply_lora(loaded.model, LoraConfig(r=4, alpha=8))
    b = [p for n, p in model.named_parameters() if ".lora_B." in n]
    assert b and all(torch.count_nonzero(p) == 0 for p in b)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_layout_check_catches_a_vision_parameter_made_trainable_by_hand(arch: str, run_dirs) -> None:
    loaded = _load(arch, run_dirs[arch])
    model, _ = apply_lora(loaded.model, LoraConfig(r=4, alpha=8))
    verify_lora_layout(model)  # as wrapped: fine
    name, param = next((n, p) for n, p in model.named_parameters() if is_vision_param(n))
    param.requires_grad_(True)
    with pytest.raises(LoraLayoutError) as info:
        verify_lora_layout(model)
    assert f"vision parameter trains: {name}" in str(info.value)


def test_layout_check_catches_a_trainable_language_base_weight(run_dirs) -> None:
    loaded = _load("qwen3_vl", run_dirs["qwen3_vl"])
    model, _ = apply_lora(loaded.model, LoraConfig(r=4, alpha=8))
    name, param = next((n, p) for n, p in model.named_parameters() if n.endswith("embed_tokens.weight"))
    param.requires_grad_(True)
    with pytest.raises(LoraLayoutError, match=f"non-LoRA parameter trains: {name}"):
        verify_lora_layout(model)


def test_layout_check_refuses_a_model_without_lora(run_dirs) -> None:
    loaded = _load("qwen3_vl", run_dirs["qwen3_vl"])
    for param in loaded.model.parameters():
        param.requires_grad_(False)
    with pytest.raises(LoraLayoutError, match="no LoRA module"):
        verify_lora_layout(loaded.model)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_attention_false_leaves_only_mlp_targets(arch: str, run_dirs) -> None:
    loaded = _load(arch, run_dirs[arch])
    model, report = apply_lora(loaded.model, LoraConfig(r=4, alpha=8, attention=False))
    modules = _lora_module_names(model)
    assert sorted({m.rsplit(".", 1)[-1] for m in modules}) == sorted(MLP_PROJ)
    assert len(modules) == NUM_LAYERS * len(MLP_PROJ) == report.lora_modules
    assert not any(m.endswith(ATTENTION_PROJ) for m in modules)
    assert report.trainable_params == _expected_lora_params(model, r=4)


def test_mlp_false_leaves_only_attention_targets(run_dirs) -> None:
    loaded = _load("qwen3_vl", run_dirs["qwen3_vl"])
    model, report = apply_lora(loaded.model, LoraConfig(r=4, alpha=8, mlp=False))
    modules = _lora_module_names(model)
    assert sorted({m.rsplit(".", 1)[-1] for m in modules}) == sorted(ATTENTION_PROJ)
    assert report.lora_modules == NUM_LAYERS * len(ATTENTION_PROJ)
