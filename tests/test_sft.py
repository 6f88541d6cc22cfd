"""The supervised warm start: a prefetched run trains on the same batches as a plain one, and the cached
prompt-token counts are the ones the processor gives."""

from __future__ import annotations

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlmrl.data.synthetic import generate_items
from vlmrl.models.demo import _prompt, _target
from vlmrl.models.tiny import build_tiny_model
from vlmrl.models.warm_start import SftExample, sft_batch, sft_train


def _examples(n: int = 12) -> list[SftExample]:
    items = generate_items(n, seed=3, size=64, families=["count_squares", "bar_value"])
    return [SftExample(_prompt(i.question), i.image, _target(i.family, i.answer)) for i in items]


def test_prefetch_trains_on_the_same_batches(tmp_path):
    folder = build_tiny_model("qwen3_vl", tmp_path / "m", hidden_size=64, num_layers=1, image_size=64)
    processor = AutoProcessor.from_pretrained(folder)
    processor.tokenizer.padding_side = "left"
    runs = []
    for prefetch in (False, True):
        model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
        runs.append(sft_train(model, processor, _examples(), steps=3, batch_size=4, seed=1, prefetch=prefetch))
    assert runs[0] == runs[1] and len(runs[0]) == 3


def test_cached_prompt_lengths_match_a_fresh_count(tmp_path):
    folder = build_tiny_model("qwen3_vl", tmp_path / "m", hidden_size=64, num_layers=1, image_size=64)
    processor = AutoProcessor.from_pretrained(folder)
    processor.tokenizer.padding_side = "left"
    examples = _examples(6)
    cache: dict = {}
    first = sft_batch(processor, examples, torch.device("cpu"), cache)
    assert cache  # filled: the count of one prompt and image size
    again = sft_batch(processor, examples, torch.device("cpu"), cache)
    fresh = sft_batch(processor, examples, torch.device("cpu"))
    assert torch.equal(first["labels"], again["labels"]) and torch.equal(first["labels"], fresh["labels"])
    assert (first["labels"] != -100).any(dim=1).all()  # every row keeps its answer tokens


def test_on_step_returning_true_stops_training(tmp_path):
    folder = build_tiny_model("qwen3_vl", tmp_path / "m", hidden_size=64, num_layers=1, image_size=64)
    processor = AutoProcessor.from_pretrained(folder)
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    seen = []
    losses = sft_train(model, processor, _examples(), steps=5, batch_size=2, prefetch=True,
                       on_step=lambda step, loss: seen.append(step) or step == 2)
    assert seen == [1, 2] and len(losses) == 2


def test_reading_check_counts_right_answers_per_family(monkeypatch):
    """The warm start's check, per family: a fake generator answers bar values right and everything else wrong."""
    from vlmrl.engine.rollout import generation
    from vlmrl.models import demo

    items = list(generate_items(12, seed=4, size=32, families=["bar_value", "count_squares"]))

    def answers(model, processor, prompts, images, **kwargs):
        by_image = {id(i.image): i for i in items}  # questions repeat across items; their pictures do not
        shown = [by_image[id(pictures[0])] for pictures in images]
        return [[generation.Generation(_target(i.family, i.answer if i.family == "bar_value" else "-1"), tokens=9,
                                       truncated=False)] for i in shown]

    monkeypatch.setattr(generation, "generate_batch", answers)
    model = torch.nn.Linear(1, 1)
    result = demo.reading_check(model, None, items, batch=5)
    bars = sum(i.family == "bar_value" for i in items)
    assert 0 < bars < len(items)
    assert result == {"greedy_accuracy": bars / len(items), "format_rate": 1.0,  # every answer in the structure
                      "by_family": {"bar_value": 1.0, "count_squares": 0.0}}
    assert model.training


def test_a_warm_start_short_of_its_criterion_is_said_once_per_process(tmp_path, monkeypatch):
    """A run resolves its policy once per stage: the note that its warm start stopped short came once per stage
    (ten lines in one `vlmrl run`); it is said once, and not at all for a policy that reached its criterion."""
    import json

    from vlmrl.models import demo

    said: list[str] = []
    for reached, recipe in ((False, {"name": "short", "stop_accuracy": 0.45}), (True, {"name": "ok", "stop_accuracy": 0.45})):
        folder = tmp_path / recipe["name"]
        folder.mkdir()
        (folder / "demo_policy.json").write_text(json.dumps({
            "reached_criterion": reached, "sft_steps_run": 80, "recipe": recipe,
            "reading_checks": [{"step": 40, "greedy_accuracy": 0.125}]}))
        monkeypatch.setattr(demo, "demo_policy_dir", lambda recipe, folder=folder: folder)
        for _ in range(3):
            assert demo.ensure_demo_policy(recipe, say=said.append) == folder
    assert len(said) == 1 and "short of its reading criterion (0.45 greedy; best 0.125, kept)" in said[0]
