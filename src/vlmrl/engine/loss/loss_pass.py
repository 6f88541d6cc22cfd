"""The loss pass without its all-padding columns, on micro-batches grouped by length so that there are many.

TRL's `GRPOTrainer` pads a whole generation batch at once, prompts on the left to the longest prompt and
completions on the right to the longest completion, then splits it into `steps_per_generation` micro-batches.
A micro-batch therefore carries columns that are padding in every one of its rows, and
`GRPOTrainer._get_per_token_logps_and_entropies` runs the model over them anyway: forward, checkpoint recompute
and backward in the loss pass, the forward in the old / reference log-prob passes. `enable_padding_trim` wraps
that method on one trainer instance: it drops those columns, calls TRL's own method on what is left and pads the
per-token log-probs and entropies back to the caller's width (zeros where a column was dropped; the completion
mask is 0 there, so no loss term, metric or gradient reads them). TRL's loop, loss and masks are untouched.

Exactness:
- right side (completion columns after the last column any row attends to): exact for any causal LM, since no
  earlier position sees a later one; `logits_to_keep` shrinks by the columns dropped.
- left side (prompt columns before the first column any row attends to): exact where dropping them leaves every
  attention score unchanged, which depends on how the family positions its tokens. Qwen2.5-VL and Qwen3-VL, given
  an image, compute their M-RoPE index from the attention mask (`get_rope_index`): the kept tokens get the very
  same positions. Without an image they, and Gemma 3 and Idefics3 (SmolVLM) always, use column indices; dropping
  k columns that are padding in every row then shifts every kept token's position by the same k, and rotary
  embeddings see only differences of positions, so scores are unchanged up to the rounding of the rotation
  angles (measured on the tiny models: logits within 5e-7 in float32, the same order as reordering the sums).
  A family with absolute position embeddings, or positions that depend on the sequence length, would not be
  exact, so the left side is trimmed only for the families in `LEFT_TRIM_FAMILIES`, each checked on a tiny model
  (tests/test_loss_pass_trim.py); another model type keeps its left padding (Qwen2-VL too: the same rope code,
  but no tiny build to check it on).

Length-grouped micro-batches (`enable_length_grouping`): TRL shuffles a generation batch's rows at random before
the split (`shuffle_sequence_dict`), so each micro-batch mixes short and long completions and few of its columns are
padding in every row; grouped, many more are (the shares: `benchmarks/loss_pass_padding.py`, benchmarks/NOTES.md).
Grouping sorts the rows by completion
length, then prompt length, ties broken by TRL's own `torch.randperm` draw (the same random stream as before), so
each micro-batch's rows have similar lengths and the trim drops the rest. Where a generation batch feeds several
optimizer steps (steps_per_generation a multiple k of gradient_accumulation_steps), the draw is cut into k shares
first and each is sorted on its own, so every optimizer step trains on the very rows TRL would give it. Its gradient
then stays the same up to float summation order where micro-batches have equal row counts and nothing in TRL 1.16's
`_compute_loss` depends on which rows share one: true of grpo / sapo / luspo (per-sequence terms averaged over equal
micro-batches), dr_grpo (rows x max_completion_length), dapo / cispo / vespo (`num_items_in_batch`, counted over the
generation batch); not of bnpo (the micro-batch's own token count), `top_entropy_quantile < 1` (a quantile over the
micro-batch), the entropy bonus (a token mean over it) or a router auxiliary loss. `grouping_problem` names the
first that applies; TRL's shuffle is then kept and the reason logged and recorded. The hook is per trainer: a
dispatcher in place of `shuffle_sequence_dict` in grpo_trainer's globals groups only inside a grouped trainer's
`_prepare_inputs` (a context variable), and is TRL's function elsewhere. What changes is how TRL's per-micro-batch
metrics (entropy, clip ratios) average, and float summation order.

Left out: trimming per chunk inside one call (the old / reference passes run over the whole generation batch in
chunks of `batch_size` rows; they are trimmed to the columns the whole batch uses, not per chunk), a packed,
variable-length loss pass (it would also skip the padding of rows shorter than their micro-batch's longest), and
grouping where optimizer steps straddle generation batches (steps_per_generation not a multiple of the accumulation
steps: a step's share of a generation batch would be biased toward its short or long rows). The trim costs one host
sync per call (reading the bounds of the used columns), the grouping one per generation batch (the row lengths).
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

# model_type values whose kept tokens see the same attention scores without the left padding columns: positions
# from the attention mask, or column positions used only through rotary embeddings (see the docstring). Each is
# checked on a tiny model in tests/test_loss_pass_trim.py; any other family keeps its left padding.
LEFT_TRIM_FAMILIES = frozenset({"qwen2_5_vl", "qwen3_vl", "gemma3", "idefics3"})
# Keyword tensors of shape [B, T] aligned with input_ids: sliced with it.
PER_COLUMN = ("token_type_ids", "mm_token_type_ids")
METRIC = "loss_pass/padding_trimmed"  # share of the call's positions not run through the model


@dataclass
class PaddingTrim:
    """What the trim did on this process: positions run vs what the untrimmed calls would have run."""

    left: bool  # the model family allows trimming left padding
    calls: int = 0
    positions: int = 0  # rows x columns run through the model
    positions_untrimmed: int = 0  # rows x columns TRL would have run
    padding: int = 0  # positions whose attention_mask is 0, in the untrimmed calls

    def count(self, rows: int, kept: int, width: int, padding: int) -> float:
        self.calls += 1
        self.positions += rows * kept
        self.positions_untrimmed += rows * width
        self.padding += padding
        return 1.0 - kept / width if width else 0.0

    def as_dict(self) -> dict:
        total = self.positions_untrimmed
        return {"trim_padding": True, "left_padding_trimmed": self.left, "calls": self.calls,
                "positions": self.positions, "positions_untrimmed": total,
                "padding_share": round(self.padding / total, 4) if total else None,
                "trimmed_share": round(1 - self.positions / total, 4) if total else None}


def kept_columns(first: int, last: int, width: int, logits_to_keep: int, *, left: bool) -> tuple[int, int]:
    """The columns [start, end) to run, given the first and last column any row attends to.

    At least one prompt column (the first completion token's log-prob is read from the position before it) and
    one completion column are kept, so TRL's slicing by `logits_to_keep` stays valid.

    >>> kept_columns(3, 7, 10, 4, left=True)    # prompt = columns 0-5, completion 6-9; 0-2 and 8-9 unused
    (3, 8)
    >>> kept_columns(3, 7, 10, 4, left=False)   # a family not on the list: the left padding stays
    (0, 8)
    >>> kept_columns(0, 4, 10, 4, left=True)    # every completion column is padding: keep one
    (0, 7)
    >>> kept_columns(0, 9, 10, 4, left=True)    # nothing to drop
    (0, 10)
    """
    prompt = width - logits_to_keep
    start = min(first, prompt - 1) if left else 0
    end = max(last + 1, prompt + 1)
    return max(start, 0), min(end, width)


def enable_padding_trim(trainer: Any) -> PaddingTrim:
    """Wrap `trainer._get_per_token_logps_and_entropies` so it skips all-padding columns; returns the counters."""
    from vlmrl.engine.rollout.attention import base_model

    model_type = getattr(getattr(base_model(trainer.model), "config", None), "model_type", None)
    trim = PaddingTrim(left=model_type in LEFT_TRIM_FAMILIES)
    original = trainer._get_per_token_logps_and_entropies

    def trimmed(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        rows, width = input_ids.shape  # [B, T]
        columns = _used_columns(attention_mask, logits_to_keep, args, kwargs)
        if columns is None:
            return original(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        first, last, real = columns
        start, end = kept_columns(first, last, width, logits_to_keep, left=trim.left)
        share = trim.count(rows, end - start, width, rows * width - real)
        _log_metric(trainer, share)
        if (start, end) == (0, width):
            return original(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        for name in PER_COLUMN:
            if kwargs.get(name) is not None:
                kwargs[name] = kwargs[name][:, start:end]
        dropped = width - end  # [B, logits_to_keep - dropped] -> [B, logits_to_keep], zeros where dropped
        logps, entropies, aux = original(model, input_ids[:, start:end], attention_mask[:, start:end],
                                         logits_to_keep - dropped, *args, **kwargs)
        pad = (lambda t: torch.nn.functional.pad(t, (0, dropped)) if t is not None and dropped else t)
        return pad(logps), pad(entropies), aux

    trainer._get_per_token_logps_and_entropies = trimmed
    log.info("loss pass: all-padding columns skipped (right side; left side %s)",
             "too" if trim.left else f"kept: {model_type} is not in vlmrl.engine.loss.loss_pass.LEFT_TRIM_FAMILIES")
    return trim


def _used_columns(attention_mask: torch.Tensor, logits_to_keep: int, args: tuple,
                  kwargs: dict) -> tuple[int, int, int] | None:
    """(first, last, real positions) of the columns some row attends to, or None where trimming must not apply:
    an unexpected call shape, a per-column tensor of another width, or a mask with no real position."""
    if args or attention_mask.dim() != 2 or not 0 < logits_to_keep < attention_mask.shape[1]:
        return None
    rows, width = attention_mask.shape
    for name in PER_COLUMN:
        tensor = kwargs.get(name)
        if tensor is not None and (not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != (rows, width)):
            return None
    used = attention_mask.bool()
    columns = used.any(dim=0).nonzero()
    if columns.numel() == 0:
        return None
    first, last, real = torch.stack([columns[0, 0], columns[-1, 0], used.sum()]).tolist()  # one host sync
    return first, last, real


def _log_metric(trainer: Any, share: float) -> None:
    """Appended per call, as TRL appends its own; TRL's `log` averages the list over the logging interval."""
    metrics = getattr(trainer, "_metrics", None)
    if metrics is None:
        return
    mode = "train" if getattr(trainer.model, "training", True) else "eval"
    metrics[mode][METRIC].append(share)


# --- length-grouped micro-batches -------------------------------------------------------------------------------

# Loss types whose accumulated gradient over one generation batch does not depend on which rows share a
# micro-batch (TRL 1.16 `_compute_loss`), given micro-batches of equal row counts: grpo / sapo / luspo average
# per-sequence terms over the micro-batch's rows and divide by the accumulation steps; dr_grpo divides the token sum
# by rows x max_completion_length; dapo / cispo / vespo divide it by `num_items_in_batch`, counted over the whole
# generation batch. Not bnpo: it divides by the micro-batch's own token count, which grouping changes.
GROUPING_LOSS_TYPES = frozenset({"grpo", "sapo", "luspo", "dr_grpo", "dapo", "cispo", "vespo"})
_ACTIVE: ContextVar[LengthGrouping | None] = ContextVar("vlmrl_length_grouping", default=None)


@dataclass
class LengthGrouping:
    """Whether this trainer's generation batches are cut into micro-batches of similar lengths, and why not."""

    grouped: bool
    why_not: str | None = None
    steps: int = 0  # micro-batches per generation batch (steps_per_generation)
    windows: int = 1  # optimizer steps per generation batch: rows are grouped within each one's share
    generation_batches: int = 0  # generation batches grouped
    kept_shuffled: int = 0  # generation batches left in TRL's random order at run time (see `shuffle`)

    def as_dict(self) -> dict:
        return {"group_by_length": self.grouped, "group_by_length_why_not": self.why_not,
                "generation_batches_grouped": self.generation_batches,
                "generation_batches_kept_shuffled": self.kept_shuffled}

    def shuffle(self, seq_dict: dict[str, Any]) -> dict[str, Any]:
        """TRL's `shuffle_sequence_dict` for this trainer: the same `torch.randperm` draw; each optimizer step's
        share of it (`windows` consecutive slices) is then sorted by length, ties in the draw's order, so every
        optimizer step trains on the very rows TRL's draw gives it. Rows that do not split into equal micro-batches
        keep TRL's order (`split_tensor_dict` would drop the last rows: grouped, always the longest)."""
        rows = len(next(v for v in seq_dict.values() if v is not None))
        permutation = torch.randperm(rows)  # TRL's own draw: seeds and resumed runs consume the same RNG
        masks = seq_dict.get("completion_mask"), seq_dict.get("prompt_mask")
        if rows % self.steps or any(not isinstance(m, torch.Tensor) or m.dim() != 2 for m in masks):
            self.kept_shuffled += 1
            if self.kept_shuffled == 1:
                log.info("loss pass: a generation batch of %d rows kept in TRL's random order (not %d equal "
                         "micro-batches, or no 2-D prompt / completion masks)", rows, self.steps)
            order = permutation
        else:
            self.generation_batches += 1
            completion, prompt = (m.sum(1).cpu() for m in masks)  # what the loss pass's attention mask counts
            order = torch.cat([length_order(completion, prompt, share) for share in permutation.chunk(self.windows)])
        return {key: _permute(value, order) for key, value in seq_dict.items()}


def length_order(completion: torch.Tensor, prompt: torch.Tensor, permutation: torch.Tensor) -> torch.Tensor:
    """Row indices by completion length, then prompt length, ties in `permutation`'s order (a stable sort of the
    permuted rows; with all lengths equal the result is `permutation` itself).

    >>> length_order(torch.tensor([5, 2, 5, 2]), torch.tensor([1, 1, 0, 1]), torch.tensor([3, 2, 1, 0])).tolist()
    [3, 1, 2, 0]
    >>> length_order(torch.tensor([4, 4, 4]), torch.tensor([7, 7, 7]), torch.tensor([2, 0, 1])).tolist()
    [2, 0, 1]
    """
    key = completion.long() * (int(prompt.max()) + 1) + prompt.long()  # (completion, prompt), lexicographic
    return permutation[torch.sort(key[permutation], stable=True).indices]


def _permute(value: Any, order: torch.Tensor) -> Any:
    """TRL's `shuffle_sequence_dict.permute`: tensors with a batch dimension are indexed, 0-dim tensors (such as
    `num_items_in_batch`) and None pass through, any other sequence (per-row pixel_values after
    `split_pixel_values_by_grid`, num_images) is reordered as a list."""
    if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
        return value
    if isinstance(value, torch.Tensor):
        return value[order]
    return [value[i] for i in order]


def grouping_problem(*, loss_type: str, steps_per_generation: int, accumulation_steps: int,
                     top_entropy_quantile: float, entropy_bonus: bool, aux_loss: bool) -> str | None:
    """Why grouping rows by length could change an optimizer step's gradient under these settings; None if not.

    >>> grouping_problem(loss_type="dr_grpo", steps_per_generation=8, accumulation_steps=4,
    ...                  top_entropy_quantile=1.0, entropy_bonus=False, aux_loss=False) is None
    True
    >>> grouping_problem(loss_type="bnpo", steps_per_generation=4, accumulation_steps=4,
    ...                  top_entropy_quantile=1.0, entropy_bonus=False, aux_loss=False)
    "loss_type=bnpo divides each micro-batch's loss by that micro-batch's own token count"
    """
    if steps_per_generation % accumulation_steps:
        return (f"steps_per_generation={steps_per_generation} is not a multiple of gradient_accumulation_steps="
                f"{accumulation_steps}: optimizer steps straddle generation batches, so grouping one would bias "
                "steps toward its shortest or longest rows")
    if loss_type not in GROUPING_LOSS_TYPES:
        return f"loss_type={loss_type} divides each micro-batch's loss by that micro-batch's own token count"
    if top_entropy_quantile < 1.0:
        return f"top_entropy_quantile={top_entropy_quantile}: the entropy mask is a quantile over each micro-batch"
    if entropy_bonus:
        return "the entropy bonus is a token mean over each micro-batch"
    if aux_loss:
        return "the router's auxiliary loss is computed over each micro-batch"
    return None


def enable_length_grouping(trainer: Any) -> LengthGrouping:
    """Cut this trainer's generation batches into micro-batches of similar lengths, where that leaves every
    optimizer step's gradient the same (`grouping_problem`); otherwise keep TRL's shuffle and say why."""
    args = trainer.args
    problem = grouping_problem(
        loss_type=trainer.loss_type, steps_per_generation=args.steps_per_generation,
        accumulation_steps=args.gradient_accumulation_steps, top_entropy_quantile=trainer.top_entropy_quantile,
        entropy_bonus=trainer._entropy_bonus_enabled, aux_loss=trainer.aux_loss_enabled)
    if not problem and args.gradient_accumulation_steps == 1:  # each micro-batch is a step's whole share
        problem = "one micro-batch per optimizer step: nothing to group"
    if problem:
        log.info("loss pass: micro-batches keep TRL's random grouping: %s", problem)
        return LengthGrouping(False, why_not=problem)
    _install_dispatch()
    grouping = LengthGrouping(True, steps=args.steps_per_generation,
                              windows=args.steps_per_generation // args.gradient_accumulation_steps)
    original = trainer._prepare_inputs

    def grouped(generation_batch: dict[str, Any]) -> dict[str, Any]:
        token = _ACTIVE.set(grouping)  # TRL's shuffle, called inside, groups for this trainer only
        try:
            return original(generation_batch)
        finally:
            _ACTIVE.reset(token)

    trainer._prepare_inputs = grouped
    log.info("loss pass: micro-batches grouped by completion length (%d per generation batch)", grouping.steps)
    return grouping


def _install_dispatch() -> None:
    """Put a dispatcher in place of `shuffle_sequence_dict` in grpo_trainer's globals, where `_prepare_inputs`
    looks it up: inside a grouped trainer's `_prepare_inputs` it groups, anywhere else it is TRL's function."""
    from trl.trainer import grpo_trainer

    original = grpo_trainer.shuffle_sequence_dict
    if getattr(original, "vlmrl_dispatch", False):
        return

    def shuffle_sequence_dict(seq_dict: dict[str, Any]) -> dict[str, Any]:
        grouping = _ACTIVE.get()
        return original(seq_dict) if grouping is None else grouping.shuffle(seq_dict)

    shuffle_sequence_dict.vlmrl_dispatch = True  # type: ignore[attr-defined]
    grpo_trainer.shuffle_sequence_dict = shuffle_sequence_dict


@dataclass
class LossPass:
    """What vlmrl changed in one trainer's loss pass: the trim's counters, the micro-batch grouping, and how the LoRA
    layers treat their inputs under autocast (`vlmrl.engine.loss.adapter_inputs`)."""

    trim: PaddingTrim | None
    grouping: LengthGrouping
    adapter_inputs: str = "as PEFT does"
    kernels: str = "the modules' own"

    def as_dict(self) -> dict:
        return {**(self.trim.as_dict() if self.trim else {"trim_padding": False}), **self.grouping.as_dict(),
                "adapter_inputs": self.adapter_inputs, "kernels": self.kernels}


def enable_loss_pass(trainer: Any, *, kernels: bool = True) -> LossPass:
    """The trim (`enable_padding_trim`) and, with it, the length grouping (`enable_length_grouping`) on `trainer`;
    the LoRA layers' inputs kept in the autocast dtype (`vlmrl.engine.loss.adapter_inputs`); with `kernels`, Liger's
    fused kernels where they apply (`vlmrl.engine.loss.kernels`)."""
    from vlmrl.engine.loss import adapter_inputs
    from vlmrl.engine.loss import kernels as fused_kernels

    inputs = adapter_inputs.enable(trainer)
    fused = fused_kernels.enable(trainer, wanted=kernels)
    counters = enable_padding_trim(trainer)
    return LossPass(counters, enable_length_grouping(trainer), inputs, fused)
