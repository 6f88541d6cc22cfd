"""Dynamic sampling (`train.dynamic_sampling`, DAPO's; verl's `algorithm.filter_groups`, EasyR1's
`online_filtering`): train on the groups whose rewards disagree, drawing more prompts when too many agree.

GRPO's advantage is a completion's reward minus its group's mean: a group whose completions all earn the same
total reward has zero advantages, rollout time spent for no gradient. With dynamic sampling on, each generation
batch is generated and scored as TRL does; every group whose rewards all agree (and, with `accuracy_range`, every
group whose mean of `accuracy_reward` lies outside the range) is dropped; up to `max_rounds` more rounds of
prompts, drawn from the training set, are generated and scored; and the batch is filled, in round order, with
the groups kept. Where the cap leaves a rank short, the batch is filled with dropped groups whose advantages are
set to exactly zero (`plan_batch` says why that and not repeats), and the metrics say so.

Public names:
  group_verdicts(rewards, weights, group_size, ...)   each group: kept (None), AGREE or OUT_OF_RANGE
  plan_batch(verdicts_by_round, need)                  which groups fill one rank's batch, and every group's label
  more_rounds(kept_per_rank, need, done, max_rounds)   whether another round is generated (every rank alike)
  draw_prompts(n_items, count, seed=, step=, ...)      the training-set rows of an extra round
  take_rows(batch, rows) / concat_rows(parts, pad)     TRL's per-row batch dict: a selection, and parts joined
  enable_dynamic_sampling(trainer, settings, seed=)    installs it on a GRPOTrainer; returns the run's record
  METRICS                                              the per-step metric names (train/metrics.jsonl, trackers)

Deterministic: the extra prompts depend only on `run.seed`, the optimizer step about to be taken and the round,
never on state carried between steps, so a resumed run draws what the first one drew. Several processes: each
rank filters its own groups (a group never straddles ranks: the config requires whole groups per device); the
rewards TRL gathers give every rank every rank's verdicts, so all ranks run the same number of rounds (TRL's
collectives stay in step) and each fills to the same per-device size. Extra rounds are drawn over all ranks at
once, without repeating a prompt of the step or of an earlier round while the training set has others.

Left out, and limits: the reference and old log-prob forwards (beta > 0, or generation not aligned with the
optimizer step) run for every generated row, dropped ones too; `scale_rewards: batch` and
`multi_objective_aggregation: normalize_then_sum` normalise each round over that round's batch; an extra round
generates a whole per-device batch of prompts even when a rank lacks only one group; multi-image SmolVLM items
whose image counts differ between rounds cannot be joined (one line says so). Off by default until measured.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict, deque
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

AGREE, OUT_OF_RANGE = "dropped_agree", "dropped_out_of_range"  # why a group is dropped
KEPT, SURPLUS, FILLER = "kept", "surplus", "filler"  # what became of it: trained, not needed, zero-advantage fill
PREFIX = "dynamic_sampling/"
GENERATED, KEPT_GROUPS, DROPPED_AGREE, DROPPED_RANGE, FILLERS, ROUNDS, CAP_HIT = (
    f"{PREFIX}groups_generated", f"{PREFIX}groups_kept", f"{PREFIX}groups_dropped_agree",
    f"{PREFIX}groups_dropped_out_of_range", f"{PREFIX}groups_filler", f"{PREFIX}rounds", f"{PREFIX}cap_hit")
METRICS = (GENERATED, KEPT_GROUPS, DROPPED_AGREE, DROPPED_RANGE, FILLERS, ROUNDS, CAP_HIT)
# per-row columns of train/rollouts.jsonl (through TRL's `_logs["extra"]`)
LABEL_COLUMN, ROUND_COLUMN = "sampling", "sampling_round"

# Row tensors left-padded (prompt side) and the value they are padded with (None: the tokenizer's pad id).
LEFT_PADDED = {"prompt_ids": None, "prompt_mask": 0}
# Row tensors over prompt + completion: the prompt part is left-padded, the completion part right-padded.
PROMPT_AND_COMPLETION = ("token_type_ids", "mm_token_type_ids")
# Right-padding values other than 0 (None: the tokenizer's pad id).
RIGHT_PAD = {"completion_ids": None, "tool_mask": 1}


# ---- the pure logic --------------------------------------------------------------------------------------------


def group_verdicts(rewards: torch.Tensor, weights: torch.Tensor, group_size: int, *,
                   range_column: int | None = None, accuracy_range: tuple[float, float] | None = None) -> list[str | None]:
    """Each group's verdict: None (kept), AGREE (every scored completion has the same weighted total, or fewer
    than two are scored: TRL's advantages are then all zero) or OUT_OF_RANGE (the mean of reward `range_column`
    over the group's scored completions is outside `accuracy_range`, or no completion has a value).
    `rewards` is [rows, rewards] as TRL gathers it (NaN where a reward returned None); consecutive `group_size`
    rows are one prompt's group.

    >>> r = torch.tensor([[1.0], [1.0], [0.0], [2.0], [1.0], [1.0], [0.0], [1.0]])
    >>> group_verdicts(r, torch.tensor([1.0]), 2)
    ['dropped_agree', None, 'dropped_agree', None]
    >>> group_verdicts(r, torch.tensor([1.0]), 2, range_column=0, accuracy_range=(0.6, 2.0))
    ['dropped_agree', None, 'dropped_agree', 'dropped_out_of_range']
    """
    rewards = rewards.detach().float().cpu()
    totals = (rewards * weights.detach().float().cpu()[None, :]).nansum(dim=1)
    totals[torch.isnan(rewards).all(dim=1)] = math.nan  # unscorable: TRL leaves it out of the group's statistics
    verdicts: list[str | None] = []
    for start in range(0, totals.numel(), group_size):
        values = [v for v in totals[start : start + group_size].tolist() if math.isfinite(v)]
        if len(values) < 2 or max(values) == min(values):
            verdicts.append(AGREE)
            continue
        if accuracy_range is not None and range_column is not None:
            scored = [v for v in rewards[start : start + group_size, range_column].tolist() if math.isfinite(v)]
            mean = sum(scored) / len(scored) if scored else math.nan
            if not (math.isfinite(mean) and accuracy_range[0] <= mean <= accuracy_range[1]):
                verdicts.append(OUT_OF_RANGE)
                continue
        verdicts.append(None)
    return verdicts


@dataclass(frozen=True)
class Pick:
    """A group that goes into the batch: its round, its index among this rank's groups of that round, and
    whether it is a filler (a dropped group whose advantages are set to zero)."""

    round: int
    group: int
    filler: bool = False


def plan_batch(verdicts_by_round: list[list[str | None]], need: int) -> tuple[list[Pick], list[list[str]]]:
    """One rank's batch of `need` groups from its groups' verdicts, round by round (round 0: the step's own
    prompts): the kept groups in round order, then, when the cap left too few, dropped groups as fillers (those
    whose rewards agree first: their advantages are zero already). Returns the picks and every group's label
    (KEPT, SURPLUS: kept but not needed, FILLER, or the reason it was dropped).

    Why fill with zero-advantage groups rather than repeat kept ones: a repeated group counts twice, an arbitrary
    reweighting toward whichever groups happened to be repeated (and the same sample's noise twice); a group with
    zero advantages adds nothing to the policy gradient (its loss rows are -min(r A, clip(r) A) = 0; only a KL term,
    with beta > 0, as plain GRPO has for every group), so a capped step is the step plain GRPO would have taken
    with the same kept groups, never a distorted one.

    >>> picks, labels = plan_batch([[None, "dropped_agree"], ["dropped_out_of_range", None]], need=2)
    >>> [(p.round, p.group, p.filler) for p in picks], labels
    ([(0, 0, False), (1, 1, False)], [['kept', 'dropped_agree'], ['dropped_out_of_range', 'kept']])
    >>> picks, labels = plan_batch([["dropped_out_of_range", "dropped_agree"]], need=2)
    >>> [(p.round, p.group, p.filler) for p in picks], labels
    ([(0, 1, True), (0, 0, True)], [['filler', 'filler']])
    """
    labels = [[verdict or KEPT for verdict in verdicts] for verdicts in verdicts_by_round]
    kept = [Pick(r, g) for r, verdicts in enumerate(verdicts_by_round) for g, v in enumerate(verdicts) if v is None]
    picks = kept[:need]
    for pick in kept[need:]:
        labels[pick.round][pick.group] = SURPLUS
    for reason in (AGREE, OUT_OF_RANGE):
        for r, verdicts in enumerate(verdicts_by_round):
            for g, verdict in enumerate(verdicts):
                if len(picks) < need and verdict == reason:
                    picks.append(Pick(r, g, filler=True))
                    labels[r][g] = FILLER
    return picks, labels


def more_rounds(kept_per_rank: list[int], need: int, done: int, max_rounds: int) -> bool:
    """Whether every rank generates another round: some rank has fewer than `need` kept groups and fewer than
    `max_rounds` extra rounds were generated. Every rank computes it from the same gathered rewards.

    >>> more_rounds([4, 2], need=4, done=0, max_rounds=2), more_rounds([4, 4], 4, 0, 2), more_rounds([0], 4, 2, 2)
    (True, False, False)
    """
    return min(kept_per_rank) < need and done < max_rounds


def draw_prompts(n_items: int, count: int, *, seed: int, step: int, round_: int, rank: int, world: int,
                 exclude: set[int] = frozenset()) -> list[int]:
    """The training-set rows rank `rank` generates in extra round `round_` of optimizer step `step`: `count` of
    them. One permutation per (seed, step, round), the same on every rank, is dealt out rank by rank, rows in
    `exclude` (the step's prompts, earlier rounds') last, so no prompt repeats while there are others.

    >>> draw_prompts(10, 2, seed=0, step=3, round_=1, rank=0, world=2)
    [0, 9]
    >>> draw_prompts(10, 2, seed=0, step=3, round_=1, rank=1, world=2)
    [7, 3]
    >>> draw_prompts(10, 2, seed=0, step=3, round_=1, rank=0, world=2, exclude={0})
    [9, 7]
    """
    import numpy as np

    order = np.random.default_rng([seed, step, round_]).permutation(n_items).tolist()
    fresh = [i for i in order if i not in exclude]
    order = fresh + [i for i in order if i in exclude]
    total = count * world
    order = (order * (total // max(len(order), 1) + 1))[:total]  # a training set smaller than a round: repeats
    return order[rank * count : (rank + 1) * count]


def _rows(batch: dict) -> int:
    return int(batch["prompt_ids"].shape[0])


def take_rows(batch: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    """The rows `rows` of a TRL batch dict whose pixel values are split per row (TRL's
    `split_pixel_values_by_grid`): row tensors and lists are indexed, scalars (num_items_in_batch) kept."""
    n = _rows(batch)
    index = torch.tensor(rows, dtype=torch.long)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            out[key] = value
        elif isinstance(value, torch.Tensor) and value.shape[0] == n:
            out[key] = value[index.to(value.device)]
        elif isinstance(value, list | tuple) and len(value) == n:
            out[key] = [value[i] for i in rows]
        else:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else f"{type(value).__name__} of {len(value)}"
            raise ValueError(f"train.dynamic_sampling cannot select rows of {key!r} ({shape}, {n} rows in the batch): "
                             "this model's inputs are not one entry per row; turn dynamic sampling off for it")
    return out


def _pad(tensor: torch.Tensor, width: int, value: float, *, left: bool, dim: int = 1) -> torch.Tensor:
    missing = max(0, width - tensor.shape[dim])
    after_dim = [0, 0] * (tensor.ndim - 1 - dim)  # F.pad's pairs run from the last dimension back
    return torch.nn.functional.pad(tensor, (*after_dim, *((missing, 0) if left else (0, missing))), value=value)


def _pad_all(tensor: torch.Tensor, shape: list[int], value: float) -> torch.Tensor:
    for dim in range(1, tensor.ndim):
        tensor = _pad(tensor, shape[dim], value, left=False, dim=dim)
    return tensor


def concat_rows(parts: list[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """TRL batch dicts (from `take_rows`) joined row-wise: prompt tensors left-padded to the widest, completion
    tensors right-padded, prompt + completion tensors (token_type_ids) padded on each side of their prompt width."""
    parts = [p for p in parts if _rows(p)]
    out: dict[str, Any] = {}
    for key in parts[0]:
        values = [p.get(key) for p in parts]
        first = values[0]
        if first is None or (isinstance(first, torch.Tensor) and first.ndim == 0):
            out[key] = first
        elif isinstance(first, list | tuple):
            out[key] = [x for v in values for x in v]
        elif key in LEFT_PADDED:
            width = max(v.shape[1] for v in values)
            fill = pad_token_id if LEFT_PADDED[key] is None else LEFT_PADDED[key]
            out[key] = torch.cat([_pad(v, width, fill, left=True) for v in values])
        elif key in PROMPT_AND_COMPLETION:
            prompt_widths = [p["prompt_ids"].shape[1] for p in parts]
            prompt = [v[:, :w] for v, w in zip(values, prompt_widths)]
            completion = [v[:, w:] for v, w in zip(values, prompt_widths)]
            pw, cw = max(v.shape[1] for v in prompt), max(v.shape[1] for v in completion)
            out[key] = torch.cat([torch.cat([_pad(a, pw, 0, left=True), _pad(b, cw, 0, left=False)], dim=1)
                                  for a, b in zip(prompt, completion)])
        else:
            fill = RIGHT_PAD.get(key, 0)
            fill = pad_token_id if fill is None else fill
            shape = [max(v.shape[d] for v in values) for d in range(first.ndim)]
            if any(v.ndim != first.ndim for v in values):
                raise ValueError(f"train.dynamic_sampling cannot join {key!r}: its rank differs between rounds")
            out[key] = torch.cat([_pad_all(v, shape, fill) for v in values])
    return out


# ---- the trainer side ------------------------------------------------------------------------------------------


@dataclass
class DynamicSampling:
    """What dynamic sampling did over this process's training (train/summary.json's `dynamic_sampling`)."""

    max_rounds: int
    accuracy_range: list[float] | None
    accuracy_reward: str | None
    generation_batches: int = 0
    extra_rounds: int = 0
    capped_batches: int = 0  # batches filled with zero-advantage groups because the cap was hit
    groups: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("generated", KEPT, SURPLUS, AGREE, OUT_OF_RANGE, FILLER), 0))

    def as_dict(self) -> dict:
        return asdict(self)


def settings_problem(settings: Any, reward_names: list[str]) -> str | None:
    """Why these settings cannot run with these rewards (one line), or None.

    >>> class S: enabled, accuracy_range, accuracy_reward = True, [0.1, 0.9], "accuracy_reward"
    >>> settings_problem(S(), ["format_reward", "correctness_reward"])[:80]
    "train.dynamic_sampling.accuracy_reward='accuracy_reward' names no configured rew"
    """
    if not settings.enabled or settings.accuracy_range is None or settings.accuracy_reward in reward_names:
        return None
    return (f"train.dynamic_sampling.accuracy_reward={settings.accuracy_reward!r} names no configured reward; "
            f"the rewards are {', '.join(reward_names)}")


def enable_dynamic_sampling(trainer: Any, settings: Any, *, seed: int) -> DynamicSampling:
    """Wrap `trainer._generate_and_score_completions` (training batches only) with dynamic sampling as
    `settings` (train.dynamic_sampling) says; extra prompts are drawn from `trainer.train_dataset` by `seed`."""
    from accelerate.utils import gather_object
    from trl.trainer.utils import split_pixel_values_by_grid, unsplit_pixel_values_by_grid

    names = list(trainer.reward_func_names)
    if problem := settings_problem(settings, names):
        raise ValueError(problem)
    window = list(settings.accuracy_range) if settings.accuracy_range is not None else None
    record = DynamicSampling(max_rounds=settings.max_rounds, accuracy_range=window,
                             accuracy_reward=settings.accuracy_reward if window else None)
    range_column = names.index(settings.accuracy_reward) if window else None
    original, score = trainer._generate_and_score_completions, trainer._calculate_rewards
    dataset = trainer.train_dataset
    ids = list(dataset["id"]) if "id" in dataset.column_names else None
    index_of = {item_id: i for i, item_id in enumerate(ids)} if ids is not None else {}
    _widen_logs(trainer, trainer.args.generation_batch_size * (1 + settings.max_rounds))
    scored: list[torch.Tensor] = []

    def calculate_rewards(*args: Any, **kwargs: Any) -> torch.Tensor:
        rewards = score(*args, **kwargs)
        scored.append(rewards)  # gathered over every process: [processes x rows, rewards]
        return rewards

    def generate_and_score(inputs: list[dict]) -> dict[str, Any]:
        if not trainer.model.training:
            return original(inputs)
        accelerator, group = trainer.accelerator, trainer.num_generations
        rank, world = accelerator.process_index, accelerator.num_processes
        rows, need = len(inputs), len(inputs) // group
        step = trainer.state.global_step
        _clear_logs(trainer)  # the logs hold this batch's rounds, all of them (RolloutRecorder writes them)
        weights = trainer.reward_weights
        used = {index_of[i] for i in gather_object([x.get("id") for x in inputs[::group]]) if i in index_of}
        outputs, verdicts = [], []  # per round: this rank's batch; every rank's verdicts
        batch = inputs
        while True:
            scored.clear()
            outputs.append(original(batch))
            rewards = scored[-1]
            everyone = group_verdicts(rewards, weights, group, range_column=range_column, accuracy_range=window)
            verdicts.append([everyone[k * need : (k + 1) * need] for k in range(world)])
            kept = [sum(v is None for r in verdicts for v in r[k]) for k in range(world)]
            if not more_rounds(kept, need, len(verdicts) - 1, settings.max_rounds):
                break
            drawn = draw_prompts(len(dataset), need * world, seed=seed, step=step, round_=len(verdicts),
                                 rank=0, world=1, exclude=used)
            used.update(drawn)
            mine = drawn[rank * need : (rank + 1) * need]
            batch = [dict(row) for row in (dataset[i] for i in mine) for _ in range(group)]
        plans = [plan_batch([v[k] for v in verdicts], need) for k in range(world)]
        result = _assemble(trainer, outputs, plans[rank][0], group, rows, split_pixel_values_by_grid,
                           unsplit_pixel_values_by_grid)
        _label_logs(trainer, [labels for _, labels in plans], [[p for p in picks if p.filler] for picks, _ in plans],
                    rounds=len(verdicts), need=need, group=group)
        _count(trainer, record, verdicts, plans, extra=len(verdicts) - 1)
        return result

    trainer._calculate_rewards = calculate_rewards
    trainer._generate_and_score_completions = generate_and_score
    log.info("dynamic sampling: up to %d extra rounds per generation batch%s", settings.max_rounds,
             f", groups kept when mean {settings.accuracy_reward} is in {window}" if window else "")
    return record


def _assemble(trainer: Any, outputs: list[dict], picks: list[Pick], group: int, rows: int, split: Any,
              unsplit: Any) -> dict[str, Any]:
    """This rank's batch from its picks: each round's rows taken, fillers' advantages zeroed, the rounds joined,
    `num_items_in_batch` counted again over every process (TRL's loss normalisers read it)."""
    parts = []
    for r, output in enumerate(outputs):
        mine = [p for p in picks if p.round == r]
        if not mine:
            continue
        part = take_rows(split(output), [p.group * group + j for p in mine for j in range(group)])
        zero = torch.tensor([p.filler for p in mine for _ in range(group)], device=part["advantages"].device)
        part["advantages"] = torch.where(zero, torch.zeros_like(part["advantages"]), part["advantages"])
        parts.append(part)
    batch = parts[0] if len(parts) == 1 else concat_rows(parts, trainer._tokenizer.pad_token_id)
    assert _rows(batch) == rows, (_rows(batch), rows)
    mask = batch["completion_mask"] if batch.get("tool_mask") is None else batch["completion_mask"] * batch["tool_mask"]
    batch["num_items_in_batch"] = trainer.accelerator.gather(mask.sum()).sum()
    return unsplit(batch)


def _widen_logs(trainer: Any, size: int) -> None:
    """TRL keeps the last generation batch's rows in `trainer._logs` (deques of one batch); with extra rounds a
    batch has up to `size` rows, all of which train/rollouts.jsonl records."""
    def widened(value: Any) -> Any:
        if isinstance(value, defaultdict):
            out = defaultdict(lambda: deque(maxlen=size))
            out.update({k: deque(v, maxlen=size) for k, v in value.items()})
            return out
        return deque(value, maxlen=size) if isinstance(value, deque) else value

    trainer._logs = {key: widened(value) for key, value in trainer._logs.items()}


def _clear_logs(trainer: Any) -> None:
    for value in trainer._logs.values():
        for entry in value.values() if isinstance(value, dict) else [value]:
            entry.clear()


def _label_logs(trainer: Any, labels: list[list[list[str]]], fillers: list[list[Pick]], *, rounds: int,
                need: int, group: int) -> None:
    """Every logged row's fate (`sampling`) and round (`sampling_round`), in TRL's row order (round by round,
    rank by rank); a filler's logged advantage becomes the zero it trained with."""
    world = len(labels)
    label_column, round_column = [], []
    for r in range(rounds):
        for k in range(world):
            for g in range(need):
                label_column += [labels[k][r][g]] * group
                round_column += [r] * group
    trainer._logs["extra"][LABEL_COLUMN].extend(label_column)
    trainer._logs["extra"][ROUND_COLUMN].extend(round_column)
    advantages = list(trainer._logs["advantages"])
    if len(advantages) == len(label_column):
        for k, picks in enumerate(fillers):
            for p in picks:
                start = ((p.round * world + k) * need + p.group) * group
                advantages[start : start + group] = [0.0] * group
        trainer._logs["advantages"].clear()
        trainer._logs["advantages"].extend(advantages)


def _count(trainer: Any, record: DynamicSampling, verdicts: list[list[list]], plans: list, *, extra: int) -> None:
    """The step's metrics over every process into TRL's (so metrics.jsonl, the trackers and the report get them)."""
    every = [v for round_ in verdicts for rank in round_ for v in rank]
    fillers = sum(p.filler for picks, _ in plans for p in picks)
    counts = {"generated": len(every), KEPT: sum(not p.filler for picks, _ in plans for p in picks),
              SURPLUS: sum(label == SURPLUS for _, labels in plans for r in labels for label in r),
              AGREE: every.count(AGREE), OUT_OF_RANGE: every.count(OUT_OF_RANGE), FILLER: fillers}
    metrics = trainer._metrics["train"]
    for name, value in ((GENERATED, counts["generated"]), (KEPT_GROUPS, counts[KEPT]), (DROPPED_AGREE, counts[AGREE]),
                        (DROPPED_RANGE, counts[OUT_OF_RANGE]), (FILLERS, fillers), (ROUNDS, extra),
                        (CAP_HIT, float(fillers > 0))):
        metrics[name].append(float(value))
    record.generation_batches += 1
    record.extra_rounds += extra
    record.capped_batches += fillers > 0
    for key, value in counts.items():
        record.groups[key] += value
