"""The gap between the rollout engine and the loss pass, measured at every step and corrected when asked.

The rollout samples tokens from its own numerics (compiled decode graphs, Triton kernels, a 4-bit base's
inference kernels, bf16 over a static cache); GRPO / GSPO assume the loss pass's distribution. With the
sampler's log-probs of every token (`vlmrl.engine.rollout.sampling`, TRL's `sampling_per_token_logps`) and the
loss pass's, `enable_rollout_mismatch` logs per optimizer step, into TRL's metrics (so `train/metrics.jsonl`,
the trackers and the report carry them):

  mismatch/logp_diff_mean     mean per-token |log p_loss - log p_rollout| over the step's completion tokens
  mismatch/logp_diff_max      the largest one
  mismatch/sequence_kl        KL(rollout || loss pass) per completion: Schulman's k3 estimator (r - 1 - log r,
                              r = p_loss / p_rollout) summed over the completion's tokens, mean over completions
  mismatch/ratio_outside_cap  fraction of tokens whose ratio p_loss / p_rollout leaves [1/c, c], c the TIS cap

The loss pass's log-probs: where generation and optimisation are aligned (vlmrl's default: one generation batch
per optimizer step, one iteration) TRL computes none before the loss, and its own `per_token_logps` (detached)
play `old_per_token_logps`' role, so they are read off the loss pass's forward as it returns: no extra forward.
Where they are misaligned TRL computes `old_per_token_logps` (the policy at generation time), and those are used.

`tis`: truncated importance sampling with TRL's semantics for vLLM (`vllm_importance_sampling_mode`
`token_truncate` for GRPO, `sequence_truncate` for GSPO; cap `vllm_importance_sampling_clip_max`, 3.0 unless
overridden through train.trl_overrides): the per-token loss is multiplied by min(exp(log p_loss - log p_rollout),
c), per token, or once per completion with the log-ratios summed. TRL's own `_compute_loss` does that
multiplication for vLLM only (`self.use_vllm and self.vllm_importance_sampling_correction`, read nowhere else in
it); the factor is put where TRL reads it (`inputs["importance_sampling_ratio"]`) and those two flags are raised
for the duration of that call only, so the loss is TRL's own code. Why and when: docs/rollouts.md.

Left out: TRL's `compute_liger_loss` path (`use_liger_kernel`; it reads no ratio), the masking modes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

LOGP_DIFF_MEAN = "mismatch/logp_diff_mean"
LOGP_DIFF_MAX = "mismatch/logp_diff_max"
SEQUENCE_KL = "mismatch/sequence_kl"
OUTSIDE_CAP = "mismatch/ratio_outside_cap"
COLUMNS = (LOGP_DIFF_MEAN, LOGP_DIFF_MAX, SEQUENCE_KL, OUTSIDE_CAP)


def tis_factor(reference: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor, *, level: str,
               cap: float | None, floor: float | None = None) -> torch.Tensor:
    """TRL's truncated importance-sampling factor: [B, T] for `token`, [B, 1] for `sequence` (log-ratios summed
    over the completion), clipped to [floor, cap]. Tokens without a sampler log-prob (NaN) count as ratio 1.

    >>> ref, rollout, mask = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -0.5]]), torch.tensor([[1, 1]])
    >>> [round(x, 4) for x in tis_factor(ref, rollout, mask, level="token", cap=3.0)[0].tolist()]
    [1.6487, 0.2231]
    >>> round(tis_factor(ref, rollout, mask, level="sequence", cap=3.0).item(), 4)  # exp(0.5 - 1.5)
    0.3679
    """
    diff = torch.nan_to_num((reference - sampled) * mask, nan=0.0)  # [B, T]
    if level == "sequence":
        diff = diff.sum(dim=-1, keepdim=True)  # [B, 1]
    ratio = torch.exp(diff)
    return ratio if cap is None and floor is None else torch.clamp(ratio, min=floor, max=cap)


def micro_batch_stats(reference: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """[|Δ| sum, tokens, |Δ| max, k3 sum, completions, tokens outside [1/cap, cap]] over one micro-batch, on its
    device (Δ = log p_loss - log p_rollout; tokens without a sampler log-prob are left out).

    >>> ref, rollout = torch.tensor([[-1.0, -2.0, 0.0]]), torch.tensor([[-1.5, -0.5, 9.0]])
    >>> [round(x, 4) for x in micro_batch_stats(ref, rollout, torch.tensor([[1, 1, 0]]), cap=3.0).tolist()]
    [2.0, 2.0, 1.5, 0.8719, 1.0, 1.0]
    """
    valid = mask.bool() & torch.isfinite(sampled)
    delta = torch.where(valid, reference.float() - sampled.float(), 0.0)  # [B, T]
    size = delta.abs()
    k3 = torch.expm1(delta.clamp(max=30.0)) - delta  # r - 1 - log r >= 0; exactly 0 where masked
    outside = valid & (size > math.log(cap))
    return torch.stack([size.sum(), valid.sum(), size.max() if size.numel() else size.new_zeros(()), k3.sum(),
                        valid.any(dim=-1).sum(), outside.sum()]).float()


@dataclass
class RolloutMismatch:
    """What one trainer measures and corrects, and how (train/summary.json's `rollout_correction`)."""

    sampler: str  # where the rollout's log-probs come from
    correction: str  # "tis", "none", or "trl" (vLLM: TRL's own)
    reason: str  # why that correction
    level: str  # "token" (grpo) or "sequence" (gspo)
    cap: float | None
    reference: str  # where the loss pass's log-probs come from
    measured_micro_batches: int = 0  # on this process
    steps_logged: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def resolve_correction(setting: str, trainer: Any, *, fast: bool) -> tuple[str, str]:
    """`train.rollout_correction` as a decision and its reason: `auto` is tis where the rollout's numerics differ
    from the loss pass's, none where they are the same computation (float32, no fast path)."""
    if getattr(trainer, "use_vllm", False):  # TRL corrects vLLM's rollouts itself; vlmrl measures only
        return "trl", ("vLLM: TRL's own correction (vllm_importance_sampling_correction="
                       f"{getattr(trainer, 'vllm_importance_sampling_correction', None)}, mode "
                       f"{getattr(trainer, 'vllm_importance_sampling_mode', None)})")
    if setting != "auto":
        return setting, f"train.rollout_correction={setting}"
    differs = numerics_differ(trainer, fast=fast)
    if differs:
        return "tis", f"auto: the rollout's numerics differ from the loss pass's ({differs})"
    return "none", "auto: the rollout runs the loss pass's numerics (float32, no fast path)"


def numerics_differ(trainer: Any, *, fast: bool) -> str | None:
    """Why `trainer`'s rollouts compute other numbers than its loss pass, or None."""
    reasons = []
    if fast:
        reasons.append("the fast rollout engine")
    model = trainer.model
    if getattr(model, "hf_quantizer", None) is not None or getattr(model, "is_loaded_in_4bit", False):
        reasons.append("a quantized base")
    args = trainer.args
    if getattr(args, "bf16", False) or getattr(args, "fp16", False) or any(
            p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters()):
        reasons.append("16-bit weights or autocast")
    return ", ".join(reasons) or None


def enable_rollout_mismatch(trainer: Any, *, correction: str = "auto", fast: bool = False) -> RolloutMismatch:
    """Sampler log-probs from every rollout, the mismatch logged every optimizer step, and the correction that
    `correction` (`auto` | `none` | `tis`) resolves to. Install after the fast path and the loss pass (it wraps
    their wrappers: the loss pass's log-probs are read at full width)."""
    from vlmrl.engine.rollout.sampling import enable_sampler_logprobs

    sampler = enable_sampler_logprobs(trainer)
    mode, reason = resolve_correction(correction, trainer, fast=fast)
    args = trainer.args
    aligned = (args.gradient_accumulation_steps % (args.steps_per_generation * trainer.num_iterations) == 0
               and not getattr(trainer, "use_vllm", False))
    record = RolloutMismatch(
        sampler=sampler, correction=mode, reason=reason, level=trainer.importance_sampling_level,
        cap=trainer.vllm_importance_sampling_clip_max,
        reference=("the loss pass's own log-probs (generation and optimisation aligned: no extra forward)" if aligned
                   else "TRL's old_per_token_logps (the policy at generation time)"))
    _install(trainer, record, floor=trainer.vllm_importance_sampling_clip_min)
    log.info("rollout mismatch: sampler %s; measured against %s; correction %s (%s)", sampler, record.reference,
             mode, reason)
    return record


def _install(trainer: Any, record: RolloutMismatch, *, floor: float | None) -> None:
    """Wrap `_compute_loss` (measure, set the factor, flush at each optimizer step) and
    `_get_per_token_logps_and_entropies` (hand the aligned case the loss pass's log-probs as it returns)."""
    inner_loss, inner_logps = trainer._compute_loss, trainer._get_per_token_logps_and_entropies
    window: list[torch.Tensor] = []  # stats of this optimizer step's micro-batches
    waiting: list[dict] = []  # the inputs whose loss-pass log-probs are about to be computed
    cap = record.cap if record.cap is not None else math.inf

    def observe(reference: torch.Tensor, inputs: dict) -> None:
        sampled = inputs["sampling_per_token_logps"]
        mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
        window.append(micro_batch_stats(reference, sampled, mask, cap))
        record.measured_micro_batches += 1
        if record.correction == "tis":
            inputs["importance_sampling_ratio"] = tis_factor(reference, sampled, mask, level=record.level,
                                                             cap=record.cap, floor=floor)

    def logps(*args: Any, **kwargs: Any) -> Any:
        out = inner_logps(*args, **kwargs)
        if waiting:
            observe(out[0].detach(), waiting.pop())
        return out

    def compute_loss(model: Any, inputs: dict) -> Any:
        if inputs.get("sampling_per_token_logps") is None or not trainer.model.training:
            return inner_loss(model, inputs)
        if inputs.get("old_per_token_logps") is not None:
            observe(inputs["old_per_token_logps"], inputs)
        else:
            waiting.append(inputs)
        try:
            with _trl_multiplies(trainer) if record.correction == "tis" else contextlib.nullcontext():
                loss = inner_loss(model, inputs)
        finally:
            waiting.clear()
        if trainer.accelerator.sync_gradients and window:
            _flush(trainer, window)
            record.steps_logged += 1
        return loss

    trainer._get_per_token_logps_and_entropies = logps
    trainer._compute_loss = compute_loss


def _flush(trainer: Any, window: list[torch.Tensor]) -> None:
    """One optimizer step's four numbers over every process (one gather, one host sync), into TRL's metrics."""
    stats = torch.stack(window)  # [micro-batches, 6]
    window.clear()
    local = stats.sum(dim=0)
    local[2] = stats[:, 2].max()
    gathered = trainer.accelerator.gather(local[None]).reshape(-1, 6)  # [processes, 6]
    size, tokens, _, k3, sequences, outside = gathered.sum(dim=0).tolist()
    largest = gathered[:, 2].max().item()
    metrics = trainer._metrics["train"]
    metrics[LOGP_DIFF_MEAN].append(size / tokens if tokens else math.nan)
    metrics[LOGP_DIFF_MAX].append(largest if tokens else math.nan)
    metrics[SEQUENCE_KL].append(k3 / sequences if sequences else math.nan)
    metrics[OUTSIDE_CAP].append(outside / tokens if tokens else math.nan)


@contextlib.contextmanager
def _trl_multiplies(trainer: Any) -> Iterator[None]:
    """For one `_compute_loss` call, the two flags under which TRL multiplies the per-token loss by
    `inputs["importance_sampling_ratio"]` (tests/test_rollout_mismatch.py checks they gate nothing else there)."""
    saved = trainer.use_vllm, trainer.vllm_importance_sampling_correction
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    try:
        yield
    finally:
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = saved


def step_rows(log_history: list[dict]) -> list[dict]:
    """The mismatch columns of each logged step (a trainer's `state.log_history`, or metrics.jsonl rows).

    >>> step_rows([{"step": 1, "loss": 0.1, LOGP_DIFF_MEAN: 0.02}, {"step": 2, "train_runtime": 9.0}])
    [{'step': 1, 'mismatch/logp_diff_mean': 0.02}]
    """
    return [{"step": row.get("step"), **{k: row[k] for k in COLUMNS if k in row}}
            for row in log_history if any(k in row for k in COLUMNS)]


class MismatchWatch:
    """When the per-step mismatch is worth a warning: a jump (a step's mean |Δ log p| over JUMP times the median
    of the steps before it), a drift (the median of the last WINDOW steps over DRIFT times that of the first),
    or the cap truncating (more than OUTSIDE of the tokens outside [1/c, c]). Means below FLOOR nats per token
    never warn (float32 agrees to 1e-6; 4-bit rollouts measured 0.03: docs/rollouts.md). A drift or
    truncation warns when it starts, and again only after it has ended.

    >>> watch = MismatchWatch()
    >>> [watch.check({LOGP_DIFF_MEAN: m}) for m in (0.01, 0.012, 0.011)]
    [[], [], []]
    >>> watch.check({LOGP_DIFF_MEAN: 0.08})[0][:48]
    'rollout mismatch jumped: mean |Δ log p| 0.0800 n'
    """

    JUMP, DRIFT, WINDOW, FLOOR, OUTSIDE = 4.0, 2.0, 10, 0.01, 0.01

    def __init__(self) -> None:
        self.means: list[float] = []
        self._drifting = self._truncating = False

    def check(self, logs: dict) -> list[str]:
        mean, outside = logs.get(LOGP_DIFF_MEAN), logs.get(OUTSIDE_CAP)
        if mean is None:
            return []
        if not math.isfinite(mean):
            return [f"rollout mismatch is {mean}: the rollout's or the loss pass's log-probs are not finite"]
        warnings = []
        before = _median(self.means[-20:])
        if len(self.means) >= 3 and mean > self.FLOOR and mean > self.JUMP * before:
            warnings.append(f"rollout mismatch jumped: mean |Δ log p| {mean:.4f} nats/token, "
                            f"{mean / max(before, 1e-12):.1f}x the median of the steps before "
                            f"({before:.4f}); the rollout engine no longer computes what the loss pass does")
        self.means.append(mean)
        if len(self.means) >= 2 * self.WINDOW:
            first, last = _median(self.means[: self.WINDOW]), _median(self.means[-self.WINDOW:])
            drifting = last > self.FLOOR and last > self.DRIFT * first
            if drifting and not self._drifting:
                warnings.append(f"rollout mismatch drifts: median of the last {self.WINDOW} steps {last:.4f} "
                                f"nats/token, {last / max(first, 1e-12):.1f}x that of the first {self.WINDOW}")
            self._drifting = drifting
        truncating = outside is not None and outside > self.OUTSIDE
        if truncating and not self._truncating:
            warnings.append(f"{outside:.1%} of the tokens' rollout/loss-pass ratios are outside the TIS cap's range: "
                            "the correction is truncating, the rollout samples far from the trained policy")
        self._truncating = truncating
        return warnings


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0
