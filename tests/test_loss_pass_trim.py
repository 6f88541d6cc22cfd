"""The loss pass skips columns that are padding in every row (vlmrl.engine.loss.loss_pass), with the same numbers.

TRL's own `GRPOTrainer._get_per_token_logps_and_entropies` runs on a stand-in trainer (the attributes it reads:
`accelerator.autocast`, `state`, `args`, `_metrics`) over a tiny model with TRL's fused head, with and without
the wrapper: per-token log-probs, entropies and every parameter's gradient must match. The batches are shaped
like a TRL micro-batch: prompts left-padded and completions right-padded to lengths no row of it reaches.
"""

from __future__ import annotations

import contextlib
import types
from collections import defaultdict

import pytest
import torch
import trl.trainer.utils as trl_utils
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
from trl import GRPOTrainer

from vlmrl.engine.loss.loss_pass import LEFT_TRIM_FAMILIES, METRIC, PER_COLUMN, enable_padding_trim
from vlmrl.models.tiny import build_tiny_model

EXTRA_LEFT, EXTRA_RIGHT = 3, 5  # all-padding columns: longer prompts / completions elsewhere in the generation batch
COMPLETIONS = [4, 9, 2]  # real completion tokens per row


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("trim")
    return {arch: build_tiny_model(arch, root / arch) for arch in sorted(LEFT_TRIM_FAMILIES)}


def _model(folder):
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32)
    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))  # as GRPOTrainer.__init__ does
    return model


def _trainer(model):
    """Just what TRL's method and the wrapper read from a GRPOTrainer."""
    fake = types.SimpleNamespace(
        model=model, state=types.SimpleNamespace(global_step=0), args=types.SimpleNamespace(report_to=[]),
        accelerator=types.SimpleNamespace(autocast=contextlib.nullcontext, is_main_process=True),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    fake._get_per_token_logps_and_entropies = types.MethodType(GRPOTrainer._get_per_token_logps_and_entropies, fake)
    return fake


def _batch(folder, *, images: bool = True) -> tuple[dict, int]:
    """A micro-batch as TRL hands it to the loss pass: prompt (left-padded) + completion (right-padded) columns."""
    processor = AutoProcessor.from_pretrained(str(folder))
    processor.tokenizer.padding_side = "left"
    image = processor.image_token if images else ""
    texts = [f"{image} how many squares" + " are there" * i for i in range(3)]
    pictures = [[Image.new("RGB", (64, 64), c)] for c in ("white", "red", "blue")] if images else None
    prompt = processor(text=texts, images=pictures, padding=True, return_tensors="pt")
    pad = processor.tokenizer.pad_token_id
    rows = prompt["input_ids"].shape[0]
    g = torch.Generator().manual_seed(1)
    width = max(COMPLETIONS) + EXTRA_RIGHT
    completion = torch.randint(10, 200, (rows, width), generator=g)
    completion_mask = (torch.arange(width)[None] < torch.tensor(COMPLETIONS)[:, None]).long()
    completion = completion.masked_fill(completion_mask == 0, pad)
    left = torch.full((rows, EXTRA_LEFT), pad)
    ids = torch.cat([left, prompt["input_ids"], completion], 1)
    mask = torch.cat([torch.zeros_like(left), prompt["attention_mask"], completion_mask], 1)
    batch = {"input_ids": ids, "attention_mask": mask, "logits_to_keep": width}
    for name in ("mm_token_type_ids", "token_type_ids"):
        if name in prompt:
            batch[name] = torch.cat([torch.zeros_like(left), prompt[name], torch.zeros_like(completion)], 1)
    if images:
        batch.update(pixel_values=prompt["pixel_values"], num_images=[1] * rows)
        if "image_grid_thw" in prompt:
            batch["image_grid_thw"] = prompt["image_grid_thw"]
    return batch, width


def _pass(folder, batch, *, trim: bool):
    model = _model(folder)
    trainer = _trainer(model)
    counters = enable_padding_trim(trainer) if trim else None
    b = dict(batch)
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
        model, b.pop("input_ids"), b.pop("attention_mask"), b.pop("logits_to_keep"), compute_entropy=True, **b)
    mask = batch["attention_mask"][:, -logps.shape[1]:]
    (logps * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logps.detach(), entropies.detach(), grads, counters, trainer


def _assert_same(a, b, mask):
    logps_a, ent_a, grads_a = a[:3]
    logps_b, ent_b, grads_b = b[:3]
    assert logps_a.shape == logps_b.shape and ent_a.shape == ent_b.shape
    m = mask.bool()
    assert torch.allclose(logps_a[m], logps_b[m], atol=1e-5, rtol=1e-5)
    assert torch.allclose(ent_a[m], ent_b[m], atol=1e-5, rtol=1e-5)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("arch", sorted(LEFT_TRIM_FAMILIES))
def test_left_and_right_padding_trimmed_with_the_same_log_probs_entropies_and_gradients(folders, arch):
    batch, width = _batch(folders[arch])
    full = _pass(folders[arch], batch, trim=False)
    trimmed = _pass(folders[arch], batch, trim=True)
    _assert_same(full, trimmed, batch["attention_mask"][:, -width:])
    assert (trimmed[0][:, max(COMPLETIONS):] == 0).all()  # padded back with zeros where dropped
    counters = trimmed[3]
    rows, columns = batch["input_ids"].shape
    assert counters.left and counters.calls == 1
    assert counters.positions_untrimmed == rows * columns
    assert counters.positions == rows * (columns - EXTRA_LEFT - EXTRA_RIGHT)
    assert counters.padding == int((batch["attention_mask"] == 0).sum())
    share = (EXTRA_LEFT + EXTRA_RIGHT) / columns
    assert trimmed[4]._metrics["eval"][METRIC] == [pytest.approx(share)]  # from_pretrained: eval mode
    assert counters.as_dict()["trimmed_share"] == round(share, 4)


@pytest.mark.parametrize("arch", sorted(LEFT_TRIM_FAMILIES))
def test_left_padding_columns_do_not_change_the_kept_logits(folders, arch):
    """The allow-list's claim itself, on the model alone: without the all-padding left columns the kept tokens'
    logits are the same (Qwen on the image path: positions from the mask; otherwise a uniform shift of column
    positions, which rotary embeddings do not see)."""
    batch, _ = _batch(folders[arch])
    model = _model(folders[arch])
    kw = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids", "token_type_ids") if k in batch}
    with torch.no_grad():
        full = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **kw).logits
        kw.update({k: kw[k][:, EXTRA_LEFT:] for k in PER_COLUMN if k in kw})
        cut = model(input_ids=batch["input_ids"][:, EXTRA_LEFT:], attention_mask=batch["attention_mask"][:, EXTRA_LEFT:],
                    **kw).logits
    real = batch["attention_mask"][:, EXTRA_LEFT:].bool()
    assert torch.allclose(full[:, EXTRA_LEFT:][real], cut[real], atol=1e-5)


@pytest.mark.parametrize("arch", ["gemma3", "idefics3"])
def test_column_positions_matter_but_a_uniform_shift_does_not(folders, arch):
    """Not vacuous for the column-position families: positions change their logits, a common offset does not."""
    batch, _ = _batch(folders[arch])
    model = _model(folders[arch])
    kw = {k: batch[k] for k in ("pixel_values", "token_type_ids") if k in batch}
    ids, mask = batch["input_ids"], batch["attention_mask"]
    positions = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    with torch.no_grad():
        logits = {name: model(input_ids=ids, attention_mask=mask, position_ids=p, **kw).logits[mask.bool()]
                  for name, p in (("columns", positions), ("shifted", positions + 7), ("doubled", positions * 2))}
    assert torch.allclose(logits["columns"], logits["shifted"], atol=1e-5)
    assert not torch.allclose(logits["columns"], logits["doubled"], atol=1e-3)


def test_text_only_call_trims_both_sides_with_the_same_numbers(folders):
    """Without an image Qwen3-VL positions tokens by column: the uniform shift case."""
    batch, width = _batch(folders["qwen3_vl"], images=False)
    untrimmed, trimmed = _pass(folders["qwen3_vl"], batch, trim=False), _pass(folders["qwen3_vl"], batch, trim=True)
    _assert_same(untrimmed, trimmed, batch["attention_mask"][:, -width:])
    rows, columns = batch["input_ids"].shape
    assert trimmed[3].positions == rows * (columns - EXTRA_LEFT - EXTRA_RIGHT)


class _Spy:
    def __init__(self):
        self.calls = []

    def __call__(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        self.calls.append((input_ids, attention_mask, logits_to_keep, kwargs))
        rows = input_ids.shape[0]
        return torch.ones(rows, logits_to_keep), torch.ones(rows, logits_to_keep), None


def _spied(model_type: str = "qwen3_vl"):
    spy = _Spy()
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type=model_type), training=True)
    trainer = types.SimpleNamespace(model=model, _get_per_token_logps_and_entropies=spy,
                                    _metrics={"train": defaultdict(list), "eval": defaultdict(list)})
    return trainer, spy, enable_padding_trim(trainer)


def test_no_padding_calls_the_original_with_the_very_same_tensors():
    trainer, spy, counters = _spied()
    ids, mask, mm = torch.ones(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long), torch.zeros(2, 8)
    grid = torch.ones(2, 3)
    logps, _, _ = trainer._get_per_token_logps_and_entropies(None, ids, mask, 3, image_grid_thw=grid,
                                                             mm_token_type_ids=mm)
    (got_ids, got_mask, keep, kwargs), = spy.calls
    assert got_ids is ids and got_mask is mask and keep == 3 and kwargs["mm_token_type_ids"] is mm
    assert logps.shape == (2, 3) and counters.positions == counters.positions_untrimmed == 16


def test_a_family_off_the_list_keeps_its_left_padding():
    trainer, spy, counters = _spied("llava")
    ids = torch.arange(16).view(2, 8)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 0]])
    logps, _, _ = trainer._get_per_token_logps_and_entropies(None, ids, mask, 3)
    (got_ids, _, keep, _), = spy.calls
    assert not counters.left and got_ids.tolist() == ids[:, :7].tolist() and keep == 2 and logps.shape == (2, 3)


def test_a_per_column_tensor_of_another_width_is_not_trimmed():
    trainer, spy, counters = _spied()
    ids = torch.ones(2, 8, dtype=torch.long)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 0]])
    odd = torch.zeros(2, 7)
    trainer._get_per_token_logps_and_entropies(None, ids, mask, 3, image_grid_thw=torch.ones(2, 3),
                                               mm_token_type_ids=odd)
    (got_ids, got_mask, keep, kwargs), = spy.calls
    assert got_ids is ids and got_mask is mask and keep == 3 and kwargs["mm_token_type_ids"] is odd
    assert counters.calls == 0


def test_padding_trimmed_and_padded_back_to_the_callers_width():
    trainer, spy, counters = _spied()
    ids = torch.arange(16).view(2, 8)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 0]])
    mm = torch.arange(16).view(2, 8) + 100
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
        None, ids, mask, 3, image_grid_thw=torch.ones(2, 3), mm_token_type_ids=mm)
    (got_ids, got_mask, keep, kwargs), = spy.calls
    assert got_ids.tolist() == ids[:, 1:7].tolist() and got_mask.tolist() == mask[:, 1:7].tolist()
    assert kwargs["mm_token_type_ids"].tolist() == mm[:, 1:7].tolist() and keep == 2
    assert logps.tolist() == [[1, 1, 0], [1, 1, 0]] and entropies.shape == (2, 3)
    assert (counters.positions, counters.positions_untrimmed, counters.padding) == (12, 16, 6)
    assert trainer._metrics["train"][METRIC] == [0.25]
