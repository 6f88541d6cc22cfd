"""train.auto_batch: the largest per-device batch the memory preflight lets fit the card (vlmrl.preflight.memory),
chosen against fake card sizes here (no GPU in the tests), and a one-line note with no change on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.helpers import quick_config
from vlmrl.common.io import read_json
from vlmrl.config.schema import load_config
from vlmrl.pipeline import prepare_with_budget
from vlmrl.preflight import memory
from vlmrl.preflight.memory import (
    GPU_MARGIN,
    auto_batch,
    choose_batch,
    estimate_memory,
    load_shapes,
    with_batch,
)
from vlmrl.train.stage import _auto_batch, build_grpo_config, train

SHAPES = load_shapes("qwen3_vl_8b")


def _peak(config, batch: int) -> float:
    return estimate_memory(with_batch(config, batch), SHAPES, prompt_tokens=config.data.max_prompt_tokens,
                           fast_generation=True).peak_gib


@pytest.mark.parametrize("four_bit", [True, False])
def test_the_choice_is_the_largest_multiple_of_the_group_that_fits(four_bit):
    config = load_config("seed", [f"model.load_in_4bit={str(four_bit).lower()}"])
    chosen = []
    # fake card sizes; bf16 weights alone are 16 GiB, so a 24 GiB card fits no bf16 batch of 1024-token prompts
    for gib in (24.0, 48.0, 80.0, 141.0) if four_bit else (48.0, 80.0, 141.0):
        choice = choose_batch(config, SHAPES, gpu_gib=gib, max_batch=4096)
        b = choice.per_device_train_batch_size
        assert b % 4 == 0 and choice.configured == 8 and choice.gpu_gib == gib
        assert _peak(config, b) <= GPU_MARGIN * gib < _peak(config, b + 4), (gib, b)  # the next one would not fit
        assert choice.predicted_peak_gib == _peak(config, b) and "limited by memory" in choice.note
        chosen.append(b)
    assert chosen == sorted(chosen) and chosen[-1] > chosen[0]  # a bigger card, a bigger batch


def test_the_data_caps_the_batch_and_a_card_too_small_changes_nothing():
    config = load_config("seed", [])
    capped = choose_batch(config, SHAPES, gpu_gib=141.0, max_batch=20)
    assert capped.per_device_train_batch_size == 20 and "limited by the data" in capped.note
    tiny_card = choose_batch(config, SHAPES, gpu_gib=4.0, max_batch=4096)
    assert tiny_card.per_device_train_batch_size == 8 and "stays 8" in tiny_card.note


def test_off_by_default_and_a_note_without_a_gpu(monkeypatch):
    assert auto_batch(load_config("seed", []), max_batch=64) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    choice = auto_batch(load_config("seed", ["train.auto_batch=true"]), max_batch=64)
    assert choice.per_device_train_batch_size == 8 and choice.note == (
        "train.auto_batch: no CUDA GPU here; per_device_train_batch_size stays 8")


def test_on_a_fake_gpu_train_passes_the_choice_to_trl_and_records_it(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * 2**30))
    config = load_config("seed", ["train.auto_batch=true"])
    said = []
    # 1000 prompts allow 1000 x 4 / 4 micro-steps = 1000 completions per device: memory decides
    choice = _auto_batch(config, tmp_path, 1000, said.append)
    assert choice == choose_batch(config, SHAPES, gpu_gib=80.0, max_batch=1000)
    assert said == [choice.note] and read_json(tmp_path / "auto_batch.json") == choice.as_dict()
    # 10 prompts fill one generation batch of 10 x 4 completions: 40 / 4 micro-steps = 10 per device -> 8
    assert _auto_batch(config, tmp_path, 10, said.append).per_device_train_batch_size == 8
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # GRPOConfig itself, on this CPU machine
    args, _ = build_grpo_config(config, tmp_path / "out", batch=choice.per_device_train_batch_size)
    assert args.per_device_train_batch_size == choice.per_device_train_batch_size != 8
    assert args.generation_batch_size == choice.per_device_train_batch_size * 4


def test_unknown_shapes_change_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(memory, "shapes_for", lambda name: None)
    choice = auto_batch(load_config("seed", ["train.auto_batch=true"]), max_batch=64)
    assert choice.per_device_train_batch_size == 8 and "no config.json or shipped shapes" in choice.note


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's one-line note and unchanged batch")
def test_training_on_the_cpu_notes_and_keeps_the_batch(tmp_path):
    config = quick_config(tmp_path, "train.auto_batch=true", "train.max_steps=1")
    prepare_with_budget(config, config.run_dir)
    said: list[str] = []
    train(config, config.run_dir, console_callback=said.append)
    summary = read_json(config.run_dir / "train" / "summary.json")
    note = "train.auto_batch: no CUDA GPU here; per_device_train_batch_size stays 8"
    assert summary["auto_batch"]["note"] == note and summary["auto_batch"]["per_device_train_batch_size"] == 8
    assert note in said and read_json(config.run_dir / "train" / "auto_batch.json") == summary["auto_batch"]
