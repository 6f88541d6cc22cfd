"""The memory preflight on several GPUs (vlmrl.preflight.memory: `gpus`, `strategy`): the arithmetic of what each
strategy shards, and the Qwen3-VL-32B shapes. Not yet checked against GPU measurements (benchmarks/gpu_scaling.py
records each configuration's measured peak beside this prediction)."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from vlmrl.cli.app import app
from vlmrl.common import distributed
from vlmrl.config.schema import load_config
from vlmrl.preflight.memory import (
    GIB,
    GPU_MARGIN,
    count_params,
    estimate_memory,
    kv_bytes_per_token,
    language_param_count,
    load_shapes,
    shape_names,
    shapes_for,
)

BF16 = ["model.load_in_4bit=false", "train.optim=adamw_torch"]  # the bench's bf16 recipe
B32 = load_shapes("qwen3_vl_32b")
B8 = load_shapes("qwen3_vl_8b")


def test_qwen3_vl_32b_shapes():
    assert shape_names() == ["qwen3_vl_32b", "qwen3_vl_8b"]
    assert shapes_for("Qwen/Qwen3-VL-32B-Instruct") == B32 and shapes_for("Qwen/Qwen3-VL-8B-Instruct") == B8
    language, vision, _ = count_params(B32)
    # a 32.8B decoder (64 layers of 5120, untied head) and the 8B's vision tower (0.43B): Qwen3-VL-32B's 33.4B
    assert 32.6e9 < language < 32.9e9 and 0.4e9 < vision < 0.45e9
    assert kv_bytes_per_token(B32["text_config"]) == 64 * 2 * 8 * 128 * 2  # layers x K,V x kv heads x dims x bf16


def _estimate(shapes, overrides, gpus=1, strategy="ddp"):
    return estimate_memory(load_config("seed", overrides), shapes, prompt_tokens=310, fast_generation=True, gpus=gpus,
                           strategy=strategy)


@pytest.mark.parametrize("shapes", [B8, B32])
def test_ddp_replicates_and_fsdp_shards_the_weights_and_the_lora_state(shapes):
    one = _estimate(shapes, BF16)
    assert _estimate(shapes, BF16, 8, "ddp") == one  # a whole model per GPU
    t = shapes["text_config"]
    head = t["vocab_size"] * t["hidden_size"]
    block = (language_param_count(t) - head) / t["num_hidden_layers"] * 2  # one decoder layer, bf16
    for gpus in (2, 4, 8):
        fsdp = _estimate(shapes, BF16, gpus, "fsdp")
        # 1/N of the weights, plus the block in use, the one prefetched and the LM head, gathered
        assert math.isclose(fsdp.weights_gib, one.weights_gib / gpus + (2 * block + 2 * head) / GIB)
        assert math.isclose(fsdp.lora_and_optimizer_gib, one.lora_and_optimizer_gib / gpus)
        # the cache, the prompt pass and the loss pass are per GPU: not divided
        assert (fsdp.kv_cache_gib, fsdp.prefill_gib, fsdp.training_gib) == (one.kv_cache_gib, one.prefill_gib,
                                                                             one.training_gib)
        # no stacked projections or adapter copies when sharded: the training phase is weights + state + activations
        assert math.isclose(fsdp.peak_gib, max(fsdp.weights_gib + fsdp.lora_and_optimizer_gib + fsdp.training_gib,
                                               fsdp.weights_gib + fsdp.lora_and_optimizer_gib + fsdp.kv_cache_gib
                                               + 32 * 310 * kv_bytes_per_token(t) / GIB))


def test_the_32b_does_not_fit_one_80_gb_card_but_fits_two_under_fsdp_and_one_h200():
    one = _estimate(B32, BF16)
    assert one.peak_gib > GPU_MARGIN * 80 and one.peak_gib < GPU_MARGIN * 140  # an H100 80GB no, an H200 yes
    assert _estimate(B32, BF16, 2, "fsdp").peak_gib < 0.7 * one.peak_gib
    assert _estimate(B32, BF16, 2, "ddp").peak_gib > GPU_MARGIN * 80  # DDP does not help


def test_zero2_shards_only_gradients_and_moments_and_zero3_gathers_all_for_rollouts():
    one, zero2 = _estimate(B8, BF16), _estimate(B8, BF16, 4, "zero2")
    assert zero2.weights_gib == one.weights_gib
    # of AdamW's 16 bytes a LoRA parameter the fp32 weight (4) stays whole, gradient and moments (12) are 1/4
    assert math.isclose(zero2.lora_and_optimizer_gib, one.lora_and_optimizer_gib * (4 + 12 / 4) / 16)
    fsdp, zero3 = _estimate(B8, BF16, 4, "fsdp"), _estimate(B8, BF16, 4, "zero3")
    assert zero3.weights_gib == fsdp.weights_gib
    assert math.isclose(zero3.peak_gib - fsdp.peak_gib, one.weights_gib)  # TRL gathers the whole model for rollouts


def test_4bit_storage_is_not_sharded_by_fsdp():
    one, fsdp = _estimate(B8, []), _estimate(B8, [], 4, "fsdp")
    language, vision, _ = count_params(B8)
    head = B8["text_config"]["vocab_size"] * B8["text_config"]["hidden_size"]
    quantized = (language - head) * 0.5625
    # the nf4 decoder stays whole; the 16-bit rest (head, embeddings, vision) is 1/4, the head gathered
    assert math.isclose(fsdp.weights_gib, (quantized + (head + vision) * 2 / 4 + head * 2) / GIB)
    assert fsdp.weights_gib > 0.9 * one.weights_gib


def test_launched_strategy_reads_what_accelerate_sets(monkeypatch):
    assert distributed.launched_strategy() == "ddp"
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert distributed.launched_strategy() == "fsdp"
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    assert distributed.launched_strategy() == "zero3"


def test_doctor_predicts_each_gpu_of_a_sharded_run():
    result = CliRunner().invoke(app, ["doctor", "--config", "seed", "--set", "model.name=Qwen/Qwen3-VL-32B-Instruct",
                                      "--set", "model.load_in_4bit=false", "--set", "train.optim=adamw_torch",
                                      "--prompt-tokens", "310", "--gpus", "2", "--strategy", "fsdp"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "each of 2 GPUs, fsdp" in text
    expected = _estimate(B32, BF16, 2, "fsdp").peak_gib
    assert f"│ peak │ {expected:.1f} GiB │" in text
