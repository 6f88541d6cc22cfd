"""Length-grouped micro-batches (vlmrl.engine.loss.loss_pass.enable_length_grouping): the same optimizer step, more padding
columns for the trim to drop.

The gradient tests run a real `GRPOTrainer` over a tiny Qwen3-VL on the CPU: its `_generate_and_score_completions`
is replaced by a fixed generation batch of mixed completion lengths (with images), and TRL's own `_prepare_inputs`
and `compute_loss` run `steps_per_generation` micro-batches, once through TRL's class method (its random grouping)
and once through the instance's grouped wrapper, with the same seed. The gradients summed over the generation
batch must match; with bnpo (which the grouping refuses) they must not, so the comparison can fail. The model runs
in float64: in float32 the random-weight vision tower's gradients cancel so far that two of TRL's own random
groupings (two seeds) already differ by 0.6% of their largest entry; in float64 by 1e-7 (the fused head's float32).
"""

from __future__ import annotations

import types

import pytest
import torch
import trl.trainer.utils as trl_utils
from datasets import Dataset
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
from trl import GRPOConfig, GRPOTrainer
from trl.trainer import grpo_trainer

from vlmrl.engine.loss.loss_pass import (
    LengthGrouping,
    enable_length_grouping,
    enable_loss_pass,
    enable_padding_trim,
    grouping_problem,
)
from vlmrl.models.tiny import build_tiny_model

STEPS, ROWS = 4, 2  # micro-batches per generation batch (= gradient accumulation), rows per micro-batch
COMPLETIONS = [1, 11, 2, 12, 3, 10, 2, 9]  # mixed lengths, as a policy samples them
MAX_COMPLETION = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_model("qwen3_vl", tmp_path_factory.mktemp("group") / "m")


def _reward(completions, **kwargs):
    return [0.0] * len(completions)


def _trainer(folder, tmp_path, **overrides) -> GRPOTrainer:
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float64)
    processor = AutoProcessor.from_pretrained(str(folder))
    processor.tokenizer.padding_side = "left"
    settings = {"per_device_train_batch_size": ROWS, "gradient_accumulation_steps": STEPS, "num_generations": 2,
                "max_completion_length": MAX_COMPLETION, "beta": 0.0, "use_cpu": True, "report_to": "none",
                "save_strategy": "no", "seed": 0, "loss_type": "dr_grpo", **overrides}
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **settings)
    dataset = Dataset.from_dict({"prompt": ["how many squares"] * 8})
    return GRPOTrainer(model=model, reward_funcs=[_reward], args=args, train_dataset=dataset,
                       processing_class=processor)


def _generation_batch(folder) -> dict:
    """What `_generate_and_score_completions` returns: prompts left-padded (with an image each), completions
    right-padded to the longest of the generation batch, advantages, num_items_in_batch (0-dim)."""
    processor = AutoProcessor.from_pretrained(str(folder))
    processor.tokenizer.padding_side = "left"
    rows = len(COMPLETIONS)
    texts = [f"{processor.image_token} how many squares" + " are there" * (i % 3) for i in range(rows)]
    images = [[Image.new("RGB", (64, 64), (30 * i, 0, 0))] for i in range(rows)]
    prompt = processor(text=texts, images=images, padding=True, return_tensors="pt")
    g = torch.Generator().manual_seed(1)
    width = max(COMPLETIONS)
    completion_mask = (torch.arange(width)[None] < torch.tensor(COMPLETIONS)[:, None]).long()
    completion_ids = torch.randint(10, 200, (rows, width), generator=g).masked_fill(completion_mask == 0,
                                                                                    processor.tokenizer.pad_token_id)
    mm = torch.cat([prompt["mm_token_type_ids"], torch.zeros_like(completion_ids)], 1)
    return {"prompt_ids": prompt["input_ids"], "prompt_mask": prompt["attention_mask"],
            "completion_ids": completion_ids, "completion_mask": completion_mask,
            "advantages": torch.randn(rows, generator=g), "num_items_in_batch": completion_mask.sum(),
            "pixel_values": prompt["pixel_values"].double(), "image_grid_thw": prompt["image_grid_thw"],
            "mm_token_type_ids": mm, "num_images": [1] * rows}


def _accumulate(trainer, prepare, batch: dict) -> list[tuple[dict, list[list[int]], list[float]]]:
    """Each optimizer step's accumulated gradient over a generation batch, as TRL's loop forms them, with the
    completion lengths of its micro-batches and its rows' advantages (which name the rows)."""
    trainer._generate_and_score_completions = lambda _: dict(batch)
    trainer._buffered_inputs, trainer._step = None, 0
    accumulation = trainer.args.gradient_accumulation_steps
    trainer.current_gradient_accumulation_steps = accumulation  # set by transformers' loop per accumulation window
    trainer.model.train()
    torch.manual_seed(7)
    steps = []
    for _ in range(trainer.args.steps_per_generation // accumulation):
        trainer.model.zero_grad(set_to_none=True)
        lengths, rows = [], []
        for _ in range(accumulation):
            inputs = prepare(batch)
            trainer.compute_loss(trainer.model, inputs).backward()
            lengths.append(inputs["completion_mask"].sum(1).tolist())
            rows += inputs["advantages"].tolist()
            trainer._step += 1
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        steps.append((grads, lengths, sorted(rows)))
    return steps


def _trl_grouping(trainer):
    return lambda batch: GRPOTrainer._prepare_inputs(trainer, batch)  # the class method: TRL's random grouping


def _same(a: dict, b: dict) -> bool:
    assert a.keys() == b.keys() and any(g.abs().sum() > 0 for g in a.values())
    return all(torch.allclose(a[n], b[n], rtol=1e-5, atol=1e-6 * float(a[n].abs().max())) for n in a)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["dr_grpo", "grpo", "dapo"])
def test_grouped_micro_batches_give_the_same_step_and_trim_more(folder, tmp_path, loss_type):
    trainer = _trainer(folder, tmp_path, loss_type=loss_type)
    trim = enable_padding_trim(trainer)
    grouping = enable_length_grouping(trainer)
    assert grouping.grouped and grouping.why_not is None
    batch = _generation_batch(folder)
    [(random_grads, random_lengths, _)] = _accumulate(trainer, _trl_grouping(trainer), batch)
    random_trim = (trim.positions, trim.positions_untrimmed)
    [(grouped_grads, grouped_lengths, _)] = _accumulate(trainer, trainer._prepare_inputs, batch)
    grouped_trim = (trim.positions - random_trim[0], trim.positions_untrimmed - random_trim[1])
    flat = [n for micro in grouped_lengths for n in micro]
    assert flat == sorted(COMPLETIONS) and [n for m in random_lengths for n in m] != flat  # not vacuous
    assert grouping.generation_batches == 1
    assert _same(random_grads, grouped_grads)
    assert random_trim[1] == grouped_trim[1]  # the same positions untrimmed: widths are the generation batch's
    assert grouped_trim[0] < random_trim[0]  # the trim runs fewer of them


@pytest.mark.slow
def test_bnpo_would_change_the_step_which_is_why_it_is_not_grouped(folder, tmp_path):
    trainer = _trainer(folder, tmp_path, loss_type="bnpo")
    grouping = enable_length_grouping(trainer)
    assert not grouping.grouped and "bnpo" in grouping.why_not and "_prepare_inputs" not in vars(trainer)
    forced = _trainer(folder, tmp_path, loss_type="dr_grpo")
    assert enable_length_grouping(forced).grouped
    forced.loss_type = "bnpo"  # grouped anyway: the per-micro-batch token count changes the weights
    batch = _generation_batch(folder)
    [(random_grads, _, _)] = _accumulate(forced, _trl_grouping(forced), batch)
    [(grouped_grads, _, _)] = _accumulate(forced, forced._prepare_inputs, batch)
    assert not _same(random_grads, grouped_grads)


@pytest.mark.slow
def test_a_generation_batch_of_two_optimizer_steps_gives_each_step_its_own_rows_grouped(folder, tmp_path):
    """steps_per_generation = 2 x accumulation: each step's share of TRL's draw is grouped on its own, so both
    steps train on the rows TRL gives them, with the same gradients."""
    trainer = _trainer(folder, tmp_path, gradient_accumulation_steps=2, steps_per_generation=4)
    grouping = enable_length_grouping(trainer)
    assert grouping.grouped and grouping.windows == 2
    batch = _generation_batch(folder)
    random = _accumulate(trainer, _trl_grouping(trainer), batch)
    grouped = _accumulate(trainer, trainer._prepare_inputs, batch)
    assert len(random) == len(grouped) == 2
    for (random_grads, random_lengths, random_rows), (grads, lengths, rows) in zip(random, grouped, strict=True):
        assert rows == random_rows  # the same rows in this optimizer step as TRL's
        flat = [n for micro in lengths for n in micro]
        assert flat == sorted(flat) and sorted(flat) == sorted(n for m in random_lengths for n in m)
        assert _same(random_grads, grads)
    assert [n for _, lengths, _ in grouped for m in lengths for n in m] != sorted(COMPLETIONS)  # not one sort


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "words"), [
    ({"steps_per_generation": 6}, "steps_per_generation=6 is not a multiple of gradient_accumulation_steps=4"),
    ({"top_entropy_quantile": 0.5}, "quantile over each micro-batch"),
])
def test_settings_that_depend_on_the_grouping_keep_trls_shuffle(folder, tmp_path, overrides, words):
    trainer = _trainer(folder, tmp_path, **overrides)
    grouping = enable_length_grouping(trainer)
    assert not grouping.grouped and words in grouping.why_not
    assert "_prepare_inputs" not in vars(trainer)  # TRL's method, untouched
    assert grouping.as_dict()["group_by_length_why_not"] == grouping.why_not


def test_entropy_bonus_and_router_loss_are_refused():
    base = {"loss_type": "grpo", "steps_per_generation": 2, "accumulation_steps": 2, "top_entropy_quantile": 1.0}
    assert grouping_problem(**base, entropy_bonus=False, aux_loss=False) is None
    assert "entropy bonus" in grouping_problem(**base, entropy_bonus=True, aux_loss=False)
    assert "auxiliary loss" in grouping_problem(**base, entropy_bonus=False, aux_loss=True)


def _rows(completions: list[int], prompts: list[int]) -> dict:
    """A split generation batch whose every field names its row, in each of TRL's value kinds."""
    n, width = len(completions), max(completions)
    row = torch.arange(n)
    return {
        "prompt_mask": (torch.arange(8)[None] >= 8 - torch.tensor(prompts)[:, None]).long(),
        "completion_mask": (torch.arange(width)[None] < torch.tensor(completions)[:, None]).long(),
        "completion_ids": row[:, None].expand(n, width) * 10,
        "advantages": row.float(),
        "pixel_values": [torch.full((4, 3), float(i)) for i in range(n)],  # split_pixel_values_by_grid's list
        "image_grid_thw": [torch.tensor([[1, 2, 2]]) * (i + 1) for i in range(n)],
        "num_images": list(range(100, 100 + n)),
        "num_items_in_batch": torch.tensor(sum(completions)),
        "old_per_token_logps": None,
    }


def _grouping(steps: int) -> LengthGrouping:
    return LengthGrouping(True, steps=steps)


def test_grouped_order_sorts_by_length_and_moves_every_field_together():
    completions, prompts = [5, 1, 5, 3, 1, 3], [2, 2, 1, 4, 3, 4]
    batch = _rows(completions, prompts)
    out = _grouping(3).shuffle(batch)
    order = out["advantages"].long().tolist()
    assert sorted(order) == list(range(6))
    keys = [(completions[i], prompts[i]) for i in order]
    assert keys == sorted(keys)
    assert out["completion_ids"][:, 0].tolist() == [10 * i for i in order]
    assert out["completion_mask"].sum(1).tolist() == [completions[i] for i in order]
    assert out["prompt_mask"].sum(1).tolist() == [prompts[i] for i in order]
    assert [int(p[0, 0]) for p in out["pixel_values"]] == order
    assert [int(g[0, 0]) - 1 for g in out["image_grid_thw"]] == order
    assert out["num_images"] == [100 + i for i in order]
    assert out["num_items_in_batch"] is batch["num_items_in_batch"] and out["old_per_token_logps"] is None


def test_equal_lengths_give_trls_own_shuffle_and_the_same_random_stream():
    batch = _rows([4] * 6, [3] * 6)
    torch.manual_seed(11)
    ours = _grouping(2).shuffle(batch)
    after_ours = torch.rand(3)
    torch.manual_seed(11)
    theirs = trl_utils.shuffle_sequence_dict(batch)
    after_theirs = torch.rand(3)
    assert torch.equal(ours["advantages"], theirs["advantages"]) and ours["num_images"] == theirs["num_images"]
    assert torch.equal(after_ours, after_theirs)  # one randperm drawn, as TRL draws it


def test_rows_that_do_not_split_evenly_keep_trls_order():
    batch = _rows([5, 1, 5, 3, 1], [2, 2, 1, 4, 3])
    grouping = _grouping(2)
    torch.manual_seed(3)
    ours = grouping.shuffle(batch)
    torch.manual_seed(3)
    theirs = trl_utils.shuffle_sequence_dict(batch)
    assert torch.equal(ours["advantages"], theirs["advantages"])
    assert (grouping.kept_shuffled, grouping.generation_batches) == (1, 0)


def test_the_dispatcher_groups_only_inside_a_grouped_trainers_prepare_inputs():
    seen = []

    def prepare(generation_batch):  # stands in for TRL's _prepare_inputs: calls the module global, as TRL does
        seen.append(grpo_trainer.shuffle_sequence_dict(generation_batch))
        return seen[-1]

    trainer = types.SimpleNamespace(
        args=types.SimpleNamespace(steps_per_generation=3, gradient_accumulation_steps=3), loss_type="dr_grpo",
        top_entropy_quantile=1.0, _entropy_bonus_enabled=False, aux_loss_enabled=False, _prepare_inputs=prepare)
    grouping = enable_length_grouping(trainer)
    batch = _rows([5, 1, 5, 3, 1, 3], [2, 2, 1, 4, 3, 4])
    grouped = trainer._prepare_inputs(batch)["completion_mask"].sum(1).tolist()
    assert grouped == [1, 1, 3, 3, 5, 5] and grouping.generation_batches == 1
    torch.manual_seed(5)
    outside = grpo_trainer.shuffle_sequence_dict(batch)  # another trainer, or none: TRL's function
    torch.manual_seed(5)
    assert torch.equal(outside["advantages"], trl_utils.shuffle_sequence_dict(batch)["advantages"])
    assert grouping.generation_batches == 1
    enable_length_grouping(types.SimpleNamespace(**{**vars(trainer), "_prepare_inputs": prepare}))  # installed once
    assert getattr(grpo_trainer.shuffle_sequence_dict, "vlmrl_dispatch", False)


def _stand_in(steps: int):
    return types.SimpleNamespace(
        args=types.SimpleNamespace(steps_per_generation=steps, gradient_accumulation_steps=steps), loss_type="dr_grpo",
        top_entropy_quantile=1.0, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _prepare_inputs=lambda batch: batch, _get_per_token_logps_and_entropies=lambda *a, **k: None,
        model=types.SimpleNamespace(config=types.SimpleNamespace(model_type="qwen3_vl")))


@pytest.mark.parametrize(("steps", "why"), [(4, None), (1, "one micro-batch per optimizer step: nothing to group")])
def test_the_record_says_whether_and_why_not_micro_batches_were_grouped(steps, why):
    trainer = _stand_in(steps)
    record = enable_loss_pass(trainer).as_dict()
    assert record["trim_padding"] is True and record["group_by_length"] is (why is None)
    assert record["group_by_length_why_not"] == why
    assert (trainer._prepare_inputs.__name__ == "grouped") is (why is None)  # wrapped only where grouped
