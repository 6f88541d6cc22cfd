"""Rows that have ended read one block of their cache at later token steps (`vlmrl.engine.rollout.finished`): the
rows still generating get the same tokens and logits, the ended rows' masks narrow to their own position, and
masks the module cannot narrow pass through."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.conftest import load_sdpa
from vlmrl.engine.rollout import attention
from vlmrl.engine.rollout import decode_attention as kernel_module
from vlmrl.engine.rollout.decode_attention import HAS_TRITON
from vlmrl.engine.rollout.finished import FinishedRows, finished_rows_read_one_block, token_step_mask

EOS, PAD = 3, 0


class EndRow:
    """Forces `EOS` on row `row` at generated token `at` (0-based), then leaves every row alone."""

    def __init__(self, row: int, at: int):
        self.row, self.at, self.prompt = row, at, None

    def __call__(self, input_ids, scores):
        if self.prompt is None:
            self.prompt = input_ids.shape[1]
        scores = scores.clone()
        scores[:, EOS] = -float("inf")  # nobody else ends
        if input_ids.shape[1] - self.prompt == self.at:
            scores[self.row] = -float("inf")
            scores[self.row, EOS] = 0.0
        return scores


def test_a_row_that_has_ended_attends_to_its_own_position_only():
    rows = FinishedRows(torch.tensor([EOS, 9]))
    full = torch.ones(3, 1, 1, 8, dtype=torch.bool)
    step = rows.mask(torch.tensor([[1, 2, EOS], [1, 2, 4], [1, 2, 9]]), full)
    assert step[:, 0, 0].int().tolist() == [[0, 0, 1, 0, 0, 0, 0, 0], [1] * 8, [0, 0, 1, 0, 0, 0, 0, 0]]
    # a row stays ended when padding follows its end-of-sequence token; the own position moves with the step
    step = rows.mask(torch.tensor([[1, 2, EOS, PAD], [1, 2, 4, 5], [1, 2, 9, PAD]]), full)
    assert step[:, 0, 0].int().tolist() == [[0, 0, 0, 1, 0, 0, 0, 0], [1] * 8, [0, 0, 0, 1, 0, 0, 0, 0]]


def test_masks_it_cannot_narrow_are_left_alone():
    ids = torch.zeros(2, 3, dtype=torch.long)
    assert token_step_mask(torch.ones(2, 1, 1, 4, dtype=torch.bool), ids)
    assert not token_step_mask(torch.ones(1, 1, 1, 4, dtype=torch.bool), ids)  # shared by the batch
    assert not token_step_mask(torch.ones(2, 1, 3, 4, dtype=torch.bool), ids)  # a prompt pass
    assert not token_step_mask(torch.zeros(2, 1, 1, 4), ids)  # additive float mask
    assert not token_step_mask({"full_attention": torch.ones(2, 1, 1, 4, dtype=torch.bool)}, ids)
    assert not token_step_mask(None, ids)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (its CPU interpreter)")
def test_sampled_tokens_of_the_rows_still_generating_are_unchanged(tiny_qwen3_vl, monkeypatch):
    from vlmrl.data.synthetic import generate_items
    from vlmrl.engine.rollout.fast import bucket_static_cache, prefill_into_dynamic_cache
    from vlmrl.engine.rollout.generation import encode_batch

    model, processor = load_sdpa(tiny_qwen3_vl)
    model.to(torch.float16)  # the kernel's dtypes
    items = list(generate_items(3, seed=3, size=128))
    batch = encode_batch(processor, [i.question for i in items], [i.image for i in items], torch.device("cpu"))
    batch["pixel_values"] = batch["pixel_values"].to(torch.float16)
    assert bucket_static_cache(model, 64)
    prefill_into_dynamic_cache(model)
    masks = []
    real = kernel_module.decode_attention
    monkeypatch.setattr(kernel_module, "decode_attention",
                        lambda q, k, v, mask, *a, **kw: masks.append(mask.clone()) or real(q, k, v, mask, *a, **kw))
    layers = model.config.text_config.num_hidden_layers

    def generate(narrow: bool):
        masks.clear()
        settings = {"max_new_tokens": 6, "do_sample": True, "cache_implementation": "static", "eos_token_id": EOS,
                    "pad_token_id": PAD, "return_dict_in_generate": True, "output_logits": True,
                    "logits_processor": [EndRow(row=1, at=1)]}
        torch.manual_seed(0)
        with attention.packed_gqa(model), attention.decode_kernel(on_cpu=True), \
                (finished_rows_read_one_block(model) if narrow else contextlib.nullcontext()):
            out = model.generate(**batch, **settings)
        return out, [m for m in masks[::layers]]  # one mask per token step (every layer gets the same)

    wide, wide_masks = generate(False)
    narrow, narrow_masks = generate(True)
    prompt = batch["input_ids"].shape[1]
    assert narrow.sequences[1, prompt + 1] == EOS and (narrow.sequences[1, prompt + 2:] == PAD).all()
    assert torch.equal(narrow.sequences, wide.sequences)
    for a, b in zip(narrow.logits, wide.logits):
        torch.testing.assert_close(a[[0, 2]], b[[0, 2]], atol=0, rtol=0)  # the rows still generating, bit for bit
    assert all(torch.isfinite(step[1]).all() for step in narrow.logits)  # the ended row's discarded steps too
    assert len(narrow_masks) == len(wide_masks) == 5
    for step, (n, w) in enumerate(zip(narrow_masks, wide_masks)):
        assert torch.equal(n[[0, 2]], w[[0, 2]])
        own = prompt + step  # the step's input token sits at this cache position
        if step >= 1:  # row 1's generated token 1 is its end: the step that reads it, and every later one
            assert n[1, 0, 0].nonzero().flatten().tolist() == [own]
            assert w[1, 0, 0].sum() > 1  # without: its whole prompt and completion
        else:
            assert torch.equal(n[1], w[1])
    assert "prepare_inputs_for_generation" not in vars(model)  # restored
