"""train.dynamic_sampling (vlmrl.train.dynamic_sampling): groups whose rewards agree never reach the loss, the
fill respects the cap and says so, a resumed run draws what the first one drew, and two ranks keep equal batches.

Most tests drive the wrapper around a fake trainer with TRL's interface (a batch dict per call, rewards gathered
over ranks, `_logs`, `_metrics`); two ranks are two threads whose gathers meet at a barrier. One small training of
the tiny model checks the whole path: records, metrics, the summary, a resume and the report's time plots.
"""

from __future__ import annotations

import shutil
import threading
from collections import defaultdict, deque
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vlmrl.train import dynamic_sampling as ds
from vlmrl.train.dynamic_sampling import (
    AGREE,
    FILLER,
    KEPT,
    OUT_OF_RANGE,
    SURPLUS,
    concat_rows,
    draw_prompts,
    enable_dynamic_sampling,
    group_verdicts,
    more_rounds,
    plan_batch,
)

GROUP, ROWS = 4, 8  # two groups per rank per round
_CTX = threading.local()  # this thread's fake world and rank


class World:
    """Fake processes: each thread's gather waits for every rank's value, then all get them in rank order."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots: list = [None] * size

    def gather(self, value):
        if self.size == 1:
            return [value]
        self.slots[_CTX.rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


def _gather_object(obj: list) -> list:
    return [x for part in _CTX.world.gather(obj) for x in part]


@pytest.fixture(autouse=True)
def fake_gather_object(monkeypatch):
    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, "gather_object", _gather_object)
    _CTX.world, _CTX.rank = World(1), 0


def item_index(item_id: str) -> int:
    return int(item_id.split("-")[1])


class FakeTrainer:
    """TRL's GRPOTrainer as the wrapper sees it. An item in `tied` earns 1.0 for every completion (its group
    agrees); any other earns 0, 1, 0, 1 over its group. Each row's prompt tokens and pixel values are its item's
    index + 1, so a test can tell which item every row of the joined batch came from."""

    def __init__(self, dataset, tied: set[int], *, world: World | None = None, rank: int = 0, step: int = 0):
        world = world or World(1)
        self.world, self.rank, self.tied = world, rank, tied
        self.num_generations = GROUP
        self.reward_func_names = ["correctness_reward"]
        self.reward_weights = torch.tensor([1.0])
        self.train_dataset = dataset
        self.args = SimpleNamespace(generation_batch_size=ROWS * world.size)
        self.model = SimpleNamespace(training=True)
        self.state = SimpleNamespace(global_step=step)
        self.accelerator = SimpleNamespace(process_index=rank, num_processes=world.size, gather=self._gather)
        self._tokenizer = SimpleNamespace(pad_token_id=0)
        size = self.args.generation_batch_size
        self._logs = {"images": deque(maxlen=size), "prompt": deque(maxlen=size), "completion": deque(maxlen=size),
                      "rewards": defaultdict(lambda: deque(maxlen=size)), "advantages": deque(maxlen=size),
                      "extra": defaultdict(lambda: deque(maxlen=size))}
        self._metrics = {"train": defaultdict(list)}
        self.calls: list[list[str]] = []  # the item ids of each call's groups

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self.world.gather(tensor)
        return torch.cat([p.reshape(1) if p.ndim == 0 else p for p in parts])

    def _calculate_rewards(self, inputs):
        local = torch.tensor([[1.0 if item_index(x["id"]) in self.tied else float(j % 2)] for j, x in enumerate(inputs)])
        return self._gather(local)

    def _generate_and_score_completions(self, inputs):
        self.calls.append([x["id"] for x in inputs[::GROUP]])
        n, width = len(inputs), 2 + len(self.calls)  # a wider prompt and completion each round: the join pads
        rewards = self._calculate_rewards(inputs)
        grouped = rewards.nansum(1).view(-1, GROUP)
        advantages = (grouped - grouped.mean(1, keepdim=True)).view(-1)[self.rank * n : (self.rank + 1) * n]
        index = torch.tensor([item_index(x["id"]) + 1 for x in inputs])
        lengths = torch.tensor([1 + j % width for j in range(n)])
        completion_mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        for key, values in (("prompt", [x["id"] for x in inputs]), ("completion", ["c"] * n)):
            self._logs[key].extend(_gather_object(values))
        self._logs["rewards"]["correctness_reward"].extend(rewards[:, 0].tolist())
        self._logs["advantages"].extend(self._gather(advantages).tolist())
        self._metrics["train"]["reward"].append(rewards.mean().item())
        return {"prompt_ids": index[:, None].repeat(1, width), "prompt_mask": torch.ones(n, width, dtype=torch.long),
                "completion_ids": index[:, None] * completion_mask, "completion_mask": completion_mask,
                "sampling_per_token_logps": -completion_mask.float(), "advantages": advantages,
                "num_items_in_batch": torch.tensor(-1), "pixel_values": index.repeat_interleave(4)[:, None].float(),
                "image_grid_thw": torch.tensor([[1, 2, 2]] * n), "num_images": [1] * n}


def dataset(n: int = 16):
    import datasets

    return datasets.Dataset.from_dict({"id": [f"item-{i}" for i in range(n)], "prompt": [f"q{i}" for i in range(n)]})


def step_inputs(data, items: list[int]) -> list[dict]:
    return [dict(data[i]) for i in items for _ in range(GROUP)]


def settings(max_rounds: int = 2, accuracy_range=None, accuracy_reward: str = "correctness_reward"):
    return SimpleNamespace(enabled=True, max_rounds=max_rounds, accuracy_range=accuracy_range,
                           accuracy_reward=accuracy_reward)


def batch_items(batch: dict) -> list[int]:
    """The item index of each row of a joined batch, checked to agree across its tensors."""
    items = (batch["prompt_ids"].max(dim=1).values - 1).tolist()
    assert (batch["pixel_values"].view(-1, 4)[:, 0] - 1).tolist() == items  # pixel rows stayed with their row
    assert (batch["completion_ids"].max(dim=1).values - 1).tolist() == items
    assert torch.equal(batch["sampling_per_token_logps"], -batch["completion_mask"].float())  # the sampler's log-probs too
    return items


def run_step(trainer: FakeTrainer, items: list[int], *, seed: int = 0, **kwargs) -> dict:
    enable_dynamic_sampling(trainer, settings(**kwargs), seed=seed)
    return trainer._generate_and_score_completions(step_inputs(trainer.train_dataset, items))


# ---- the pure pieces ------------------------------------------------------------------------------------------


def test_verdicts_follow_trl_ties_and_the_accuracy_range():
    nan = float("nan")
    rewards = torch.tensor([
        [1.0, 0.0], [1.0, 1.0],      # format differs, correctness ties: the weighted totals differ -> kept
        [2.0, nan], [2.0, nan],      # a None reward is left out of the total, as TRL does: agree
        [nan, nan], [1.0, 0.0],      # one scored completion: no spread -> agree
        [0.0, 2.0], [0.0, 0.0],      # differ, correctness mean 1.0
    ])
    weights = torch.tensor([0.3, 1.0])
    assert group_verdicts(rewards, weights, 2) == [None, AGREE, AGREE, None]
    assert group_verdicts(rewards, weights, 2, range_column=1, accuracy_range=(0.25, 0.75)) == [None, AGREE, AGREE,
                                                                                               OUT_OF_RANGE]
    assert group_verdicts(rewards, torch.tensor([0.0, 1.0]), 2)[0] is None  # 0 vs 1 with format unweighted


def test_plan_fills_kept_groups_first_then_zero_advantage_fillers_agreeing_first():
    picks, labels = plan_batch([[None, AGREE, OUT_OF_RANGE], [None, None, AGREE]], need=2)
    assert [(p.round, p.group, p.filler) for p in picks] == [(0, 0, False), (1, 0, False)]
    assert labels == [[KEPT, AGREE, OUT_OF_RANGE], [KEPT, SURPLUS, AGREE]]
    picks, labels = plan_batch([[OUT_OF_RANGE, AGREE, None]], need=3)
    assert [(p.group, p.filler) for p in picks] == [(2, False), (1, True), (0, True)]
    assert labels == [[FILLER, FILLER, KEPT]]
    assert more_rounds([3, 1], need=3, done=1, max_rounds=2) and not more_rounds([3, 1], 3, 2, 2)


def test_draws_are_deterministic_disjoint_across_ranks_and_avoid_the_steps_prompts():
    draws = [draw_prompts(20, 3, seed=7, step=5, round_=1, rank=k, world=2, exclude={0, 1, 2}) for k in (0, 1)]
    assert draws == [draw_prompts(20, 3, seed=7, step=5, round_=1, rank=k, world=2, exclude={0, 1, 2}) for k in (0, 1)]
    assert len(set(draws[0] + draws[1])) == 6 and not set(draws[0] + draws[1]) & {0, 1, 2}
    assert draws[0] != draw_prompts(20, 3, seed=7, step=6, round_=1, rank=0, world=2, exclude={0, 1, 2})
    assert draws[0] != draw_prompts(20, 3, seed=8, step=5, round_=1, rank=0, world=2, exclude={0, 1, 2})
    assert sorted(draw_prompts(2, 2, seed=0, step=0, round_=1, rank=0, world=2)) in ([0, 1], [0, 0], [1, 1])


def test_join_pads_prompts_left_completions_right_and_token_types_on_both_sides():
    a = {"prompt_ids": torch.tensor([[5, 6]]), "completion_ids": torch.tensor([[7]]),
         "token_type_ids": torch.tensor([[1, 1, 0]]), "advantages": torch.tensor([0.5]), "n": torch.tensor(3)}
    b = {"prompt_ids": torch.tensor([[8]]), "completion_ids": torch.tensor([[9, 9]]),
         "token_type_ids": torch.tensor([[1, 0, 0]]), "advantages": torch.tensor([-0.5]), "n": torch.tensor(3)}
    joined = concat_rows([a, b], pad_token_id=0)
    assert joined["prompt_ids"].tolist() == [[5, 6], [0, 8]]
    assert joined["completion_ids"].tolist() == [[7, 0], [9, 9]]
    assert joined["token_type_ids"].tolist() == [[1, 1, 0, 0], [0, 1, 0, 0]]
    assert joined["advantages"].tolist() == [0.5, -0.5] and joined["n"].item() == 3


# ---- the wrapper on a fake trainer ----------------------------------------------------------------------------


def test_groups_whose_rewards_agree_never_reach_the_loss():
    data = dataset()
    trainer = FakeTrainer(data, tied={i for i in range(16) if i % 2 == 0})
    batch = run_step(trainer, [0, 1])  # item 0 ties: dropped, and one more round fills its place
    items = batch_items(batch)
    assert len(items) == ROWS and len(trainer.calls) == 2
    for start in range(0, ROWS, GROUP):
        group = items[start : start + GROUP]
        assert len(set(group)) == 1 and group[0] % 2 == 1  # only groups whose rewards differ
        assert batch["advantages"][start : start + GROUP].abs().sum() > 0
    assert 0 not in items
    assert batch["num_items_in_batch"].item() == batch["completion_mask"].sum().item()  # counted again
    assert batch["pixel_values"].shape == (ROWS * 4, 1) and batch["image_grid_thw"].shape == (ROWS, 3)  # unsplit
    metrics = {k: v for k, v in trainer._metrics["train"].items() if k.startswith(ds.PREFIX)}
    assert metrics[ds.GENERATED] == [4.0] and metrics[ds.KEPT_GROUPS] == [2.0] and metrics[ds.CAP_HIT] == [0.0]
    assert metrics[ds.DROPPED_AGREE][0] >= 1 and metrics[ds.ROUNDS] == [1.0]
    labels = list(trainer._logs["extra"][ds.LABEL_COLUMN])
    assert len(labels) == len(trainer._logs["prompt"]) == 16  # every generated row is recorded, with its fate
    assert labels[:GROUP] == [AGREE] * GROUP and labels[GROUP : 2 * GROUP] == [KEPT] * GROUP
    assert list(trainer._logs["extra"][ds.ROUND_COLUMN]) == [0] * 8 + [1] * 8


def test_the_cap_fills_with_zero_advantage_groups_and_the_metrics_say_so():
    data = dataset()
    everything_ties = FakeTrainer(data, tied=set(range(16)))
    batch = run_step(everything_ties, [0, 1], max_rounds=1)
    assert len(everything_ties.calls) == 2  # the step's round and one extra: the cap
    assert len(batch_items(batch)) == ROWS and batch["advantages"].abs().sum() == 0  # fillers add nothing
    metrics = everything_ties._metrics["train"]
    assert metrics[ds.CAP_HIT] == [1.0] and metrics[ds.FILLERS] == [2.0] and metrics[ds.KEPT_GROUPS] == [0.0]
    assert metrics[ds.ROUNDS] == [1.0] and metrics[ds.DROPPED_AGREE] == [4.0]
    labels = list(everything_ties._logs["extra"][ds.LABEL_COLUMN])
    assert labels.count(FILLER) == ROWS and labels.count(AGREE) == ROWS

    # an out-of-range group used as a filler trains with zero advantage, though its rewards differ
    ranged = FakeTrainer(data, tied={0})
    batch = run_step(ranged, [0, 1], max_rounds=0, accuracy_range=(0.9, 1.0))  # item 1's mean is 0.5: out
    assert len(ranged.calls) == 1 and batch["advantages"].abs().sum() == 0
    assert ranged._metrics["train"][ds.DROPPED_RANGE] == [1.0] and ranged._metrics["train"][ds.CAP_HIT] == [1.0]
    logged = list(ranged._logs["advantages"])
    assert logged == [0.0] * ROWS  # the record shows the zero it trained with

    # a kept group the batch no longer needs is recorded as surplus, and not trained
    plenty = FakeTrainer(data, tied={0})
    batch = run_step(plenty, [0, 1], max_rounds=1)  # the extra round's two groups both differ: one is left over
    labels = list(plenty._logs["extra"][ds.LABEL_COLUMN])
    assert labels.count(KEPT) == ROWS and labels.count(SURPLUS) == GROUP and labels.count(AGREE) == GROUP
    assert 0 not in batch_items(batch) and plenty._metrics["train"][ds.CAP_HIT] == [0.0]


def test_a_resumed_run_makes_the_same_choices():
    data = dataset(32)
    tied = {i for i in range(32) if i % 3}
    first = FakeTrainer(data, tied)
    enable_dynamic_sampling(first, settings(), seed=11)
    first._generate_and_score_completions(step_inputs(data, [1, 2]))  # step 0: state a resume would not have
    first.state.global_step = 5
    expected = first._generate_and_score_completions(step_inputs(data, [4, 5]))
    resumed = FakeTrainer(data, tied, step=5)  # a fresh process resumed at step 5
    got = run_step(resumed, [4, 5], seed=11)
    assert resumed.calls == first.calls[-len(resumed.calls):] and len(resumed.calls) > 1
    assert batch_items(got) == batch_items(expected)
    assert list(resumed._logs["extra"][ds.LABEL_COLUMN]) == list(first._logs["extra"][ds.LABEL_COLUMN])
    other_seed = FakeTrainer(data, tied, step=5)
    run_step(other_seed, [4, 5], seed=12)
    assert other_seed.calls[1:] != resumed.calls[1:]


def test_two_ranks_generate_the_same_rounds_and_keep_equal_batch_sizes():
    data = dataset(32)
    tied = {i for i in range(32) if i % 2 == 0}
    world = World(2)
    trainers = [FakeTrainer(data, tied, world=world, rank=k, step=3) for k in (0, 1)]
    steps = {0: [0, 2], 1: [1, 3]}  # rank 0's groups all tie, rank 1's all differ
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def rank(k: int) -> None:
        _CTX.world, _CTX.rank = world, k
        try:
            results[k] = run_step(trainers[k], steps[k], max_rounds=2)
        except BaseException as exc:  # noqa: BLE001  re-raised below, in the test's thread
            errors.append(exc)
            world.barrier.abort()

    threads = [threading.Thread(target=rank, args=(k,)) for k in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    sizes = [len(batch_items(results[k])) for k in (0, 1)]
    assert sizes == [ROWS, ROWS]
    assert len(trainers[0].calls) == len(trainers[1].calls) >= 2  # rank 1 had enough, and generated along
    assert batch_items(results[1])[:ROWS] == [1] * GROUP + [3] * GROUP  # its own step's groups, kept first
    drawn = [set(ids) for t in trainers for ids in t.calls[1:]]
    assert not drawn[0] & drawn[len(drawn) // 2]  # the ranks' extra prompts differ
    assert trainers[0]._metrics["train"] == trainers[1]._metrics["train"]  # counted over both ranks, alike
    assert list(trainers[0]._logs["extra"][ds.LABEL_COLUMN]) == list(trainers[1]._logs["extra"][ds.LABEL_COLUMN])
    for k in (0, 1):
        items = batch_items(results[k])
        for start in range(0, ROWS, GROUP):
            advantages = results[k]["advantages"][start : start + GROUP]
            assert items[start] % 2 == 1 or advantages.abs().sum() == 0  # a tied group is only ever a filler


def test_settings_are_refused_in_one_line():
    from vlmrl.config.schema import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"accuracy_range: \[0.9, 0.1\] is empty"):
        load_config("demo", ["train.dynamic_sampling.accuracy_range=[0.9, 0.1]"])
    with pytest.raises(ConfigError, match="max_rounds"):
        load_config("demo", ["train.dynamic_sampling.max_rounds=-1"])
    with pytest.raises(ValueError, match="names no configured reward; the rewards are correctness_reward"):
        enable_dynamic_sampling(FakeTrainer(dataset(), set()), settings(accuracy_range=(0.1, 0.9),
                                                                          accuracy_reward="accuracy_reward"), seed=0)
    from vlmrl.train.args import validation_problems

    config = load_config("demo", ["train.dynamic_sampling.enabled=true", "train.dynamic_sampling.accuracy_range=[0, 1]",
                                  "train.dynamic_sampling.accuracy_reward=accuracy"])
    assert [p for p in validation_problems(config) if "dynamic_sampling" in p] == [(
        "train.dynamic_sampling.accuracy_reward='accuracy' names no configured reward; the rewards are format_reward, "
        "correctness_reward")]  # `vlmrl config validate` says it, before any training
    assert not load_config("demo").train.dynamic_sampling.enabled  # off by default


# ---- one small training -----------------------------------------------------------------------------------------


def half_tied(completions, id, **kwargs) -> list[float]:
    """correctness_reward's stand-in: an item with an even number ties (1.0 for every completion); any other
    scores by completion length, so its group rarely ties."""
    from vlmrl.contract import completion_text

    return [1.0 if int("".join(c for c in i if c.isdigit()) or 0) % 2 == 0 else (len(completion_text(c) or "") % 5) / 2
            for c, i in zip(completions, id)]


half_tied.__name__ = "correctness_reward"


@pytest.mark.timeout(600)
def test_a_small_training_records_the_filter_and_resumes_with_the_same_choices(tmp_path: Path, monkeypatch):
    from vlmrl.common.io import read_json, read_jsonl
    from vlmrl.config.schema import load_config
    from vlmrl.pipeline import prepare_with_budget
    from vlmrl.report import write_report
    from vlmrl.train.stage import train

    monkeypatch.setattr("vlmrl.grading.rewards.correctness_reward", half_tied)
    config = load_config("demo", [
        "model.name=tiny:qwen3_vl", f"run.output_dir={tmp_path}", "data.num_synthetic=40", "data.holdout_size=6",
        "train.max_completion_length=12", "train.max_steps=2", f"train.per_device_train_batch_size={ROWS}",
        "train.save_steps=1", "rewards=[{name: correctness, weight: 1.0}]", "train.dynamic_sampling.enabled=true",
        "train.dynamic_sampling.max_rounds=1", "train.eval_every_steps=1", "train.eval_subset=2",
        "train.rollout_correction=tis",  # the sampler's log-probs travel with their rows into TIS
        "eval.max_new_tokens=8"])
    run_dir = config.run_dir
    prepare_with_budget(config, run_dir)
    summary = train(config, run_dir).summary
    record = summary["dynamic_sampling"]
    assert record["generation_batches"] == 2 and record["max_rounds"] == 1
    assert record["groups"]["generated"] == 2 * 2 + 2 * record["extra_rounds"]

    metrics = [r for r in read_jsonl(run_dir / "train" / "metrics.jsonl") if "train_runtime" not in r]
    assert [r["step"] for r in metrics] == [1, 2]
    for row in metrics:
        assert set(ds.METRICS) <= set(row)
        assert row[ds.KEPT_GROUPS] + row[ds.FILLERS] == ROWS // GROUP  # every batch filled to its size
    assert 0 < metrics[0]["elapsed_s"] < metrics[1]["elapsed_s"]
    assert 0 < metrics[0]["rollout_tokens"] < metrics[1]["rollout_tokens"]

    rollouts = read_jsonl(run_dir / "train" / "rollouts.jsonl")
    assert sum(r["length"] for r in rollouts) == metrics[1]["rollout_tokens"]  # every round's tokens counted
    for start in range(0, len(rollouts), GROUP):
        group = rollouts[start : start + GROUP]
        labels = {r["sampling"] for r in group}
        totals = {r["rewards"]["correctness_reward"] for r in group}
        assert len(labels) == 1 and len({r["id"] for r in group}) == 1
        if labels == {AGREE} or labels == {FILLER}:
            assert len(totals) == 1 or labels == {FILLER}
        if labels == {FILLER}:
            assert all(r["advantage"] == 0 for r in group)
        if labels == {KEPT}:
            assert len(totals) > 1  # what trained had a spread
    assert sum(r["sampling"] in (KEPT, FILLER) for r in rollouts) == 2 * ROWS

    # killed after step 2 was logged but before its checkpoint: the redone step 2 makes the same choices
    before = [(r["id"], r["sampling"], r["sampling_round"], r["completion"]) for r in rollouts if r["step"] == 2]
    shutil.rmtree(run_dir / "train" / "checkpoints" / "checkpoint-2")
    assert train(config, run_dir).summary["resumed_from_step"] == 1
    again = read_jsonl(run_dir / "train" / "rollouts.jsonl")
    assert [(r["id"], r["sampling"], r["sampling_round"], r["completion"]) for r in again if r["step"] == 2] == before
    resumed = [r for r in read_jsonl(run_dir / "train" / "metrics.jsonl") if "train_runtime" not in r]
    assert resumed[0] == metrics[0] and resumed[1]["rollout_tokens"] == metrics[1]["rollout_tokens"]
    assert resumed[1]["elapsed_s"] > metrics[0]["elapsed_s"]  # the clock continued from step 1's
    assert read_json(run_dir / "train" / "summary.json")["dynamic_sampling"]["generation_batches"] == 1

    write_report(run_dir)
    html = (run_dir / "report.html").read_text()
    for key in ("reward@elapsed_s", "reward@rollout_tokens", "accuracy@elapsed_s", "total_reward@rollout_tokens",
                "dynamic_sampling/groups_*", "dynamic_sampling/cap_hit"):
        assert f'data-key="{key}"' in html, key
