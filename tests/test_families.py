"""One real GRPO step per model family, offline: vlmrl's `train` on each tiny build, TRL's GRPOTrainer inside.

Per family (Qwen3-VL, Qwen2.5-VL, Gemma 3, SmolVLM/Idefics3): LoRA sits on the language layers only, the step
moves LoRA weights and nothing else, the vision tower and projector are bit-identical afterwards and carry no
LoRA, and the loss is finite. A random model never earns the real correctness reward, so (as in test_train.py)
a length-dependent reward stands in for it to give GRPO non-zero advantages.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.helpers import varied_reward
from vlmrl.common.io import read_jsonl
from vlmrl.config.schema import load_config
from vlmrl.models.lora import LoraLayoutError, is_language_param, is_vision_param, verify_lora_layout
from vlmrl.models.tiny import TINY_ARCHS
from vlmrl.pipeline import prepare_with_budget
from vlmrl.train.stage import train

pytestmark = pytest.mark.slow  # ~10-20 s per family on 2 cores


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_a_grpo_step_trains_language_lora_only(arch: str, tmp_path: Path, monkeypatch, captured) -> None:
    monkeypatch.setattr("vlmrl.grading.rewards.correctness_reward", varied_reward)
    config = load_config(
        "demo",
        [
            f"model.name=tiny:{arch}",
            f"run.output_dir={tmp_path}",
            "data.num_synthetic=12",
            "data.holdout_size=4",
            "train.max_completion_length=8",
            "train.max_steps=1",
            "train.per_device_train_batch_size=4",  # one prompt, its 4 generations
            "train.save_steps=1",
        ],
    )
    prepare_with_budget(config, config.run_dir)
    train(config, config.run_dir)

    model, before = captured["model"], captured["before"]
    after = {n: p.detach() for n, p in model.named_parameters()}
    vision = [n for n in after if is_vision_param(n)]
    assert vision, "the family's vision tower was not recognised"
    assert not [n for n in vision if ".lora_" in n]  # no adapter anywhere in the tower or projector
    assert all(torch.equal(before[n], after[n]) for n in vision)
    lora = [n for n in after if ".lora_" in n]
    assert lora and all(is_language_param(n) for n in lora)
    assert not [n for n in after if ".lora_" not in n and not torch.equal(before[n], after[n])]
    lora_b = [n for n in lora if ".lora_B." in n]
    assert any(not torch.equal(before[n], after[n]) for n in lora_b)  # B starts at zero; the step moved it

    rows = [r for r in read_jsonl(config.run_dir / "train" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1]
    assert math.isfinite(rows[0]["loss"])
    rollouts = read_jsonl(config.run_dir / "train" / "rollouts.jsonl")
    assert len(rollouts) == 4 and any(r["advantage"] != 0 for r in rollouts)


def test_a_trainable_idefics3_connector_fails_the_layout_check(tmp_path: Path) -> None:
    """The connector is the vision side's projector: the check must name it, not let it train."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from vlmrl.models.tiny import build_tiny_model

    base = AutoModelForImageTextToText.from_pretrained(build_tiny_model("idefics3", tmp_path / "m"))
    peft_config = LoraConfig(r=2, target_modules=r".*(text_model\..*\.q_proj|connector\..*\.proj)")
    with pytest.raises(LoraLayoutError, match=r"vision parameter trains: .*connector"):
        verify_lora_layout(get_peft_model(base, peft_config))


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_a_float16_grpo_step_is_finite(arch: str, tmp_path: Path, monkeypatch, captured) -> None:
    """`model.dtype: float16` (a T4 has no bfloat16): the base loads in fp16, the float32 LoRA trains, and one
    step's loss, rewards and adapter gradients are finite."""
    monkeypatch.setattr("vlmrl.grading.rewards.correctness_reward", varied_reward)
    config = load_config("demo", [f"model.name=tiny:{arch}", f"run.output_dir={tmp_path}", "model.dtype=float16",
                                  "data.num_synthetic=12", "data.holdout_size=4", "train.max_completion_length=8",
                                  "train.max_steps=1", "train.per_device_train_batch_size=4", "train.save_steps=1"])
    prepare_with_budget(config, config.run_dir)
    train(config, config.run_dir)
    model, before = captured["model"], captured["before"]
    assert {p.dtype for n, p in model.named_parameters() if not p.requires_grad and p.is_floating_point()} == {
        torch.float16}
    lora = {n: p.detach() for n, p in model.named_parameters() if ".lora_" in n}
    assert lora and all(torch.isfinite(p).all() for p in lora.values())
    assert any(not torch.equal(before[n], p) for n, p in lora.items())  # the step moved the adapter
    rows = read_jsonl(config.run_dir / "train" / "metrics.jsonl")
    assert rows and math.isfinite(rows[0]["loss"]) and math.isfinite(rows[0]["reward"])
