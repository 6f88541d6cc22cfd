"""The sampler's own log-probability of every token a rollout samples, handed to TRL the way vLLM's are.

TRL's `_generate_single_turn` returns `(completion_ids, logprobs)`; its transformers path returns None for the
second, its vLLM path the log-probs vLLM sampled with, which `_generate_and_score_completions` turns into
`sampling_per_token_logps` ([B, T], beside `completion_mask`). `enable_sampler_logprobs` fills that channel for
the transformers path, fast (`vlmrl.engine.rollout.fast`) or plain: each rollout's `generate` call gets one more
logits processor, `SamplerLogprobs`, which keeps one step's log_softmax of the temperature-scaled logits and, at the
next step, gathers the token that was sampled from them. So every sampled token's log-probability is read, at
the cost of one log_softmax over the vocabulary (one kernel; a division before it where the temperature is not 1)
and one gather per step; no [steps, B, V] logits are stored. Processors run outside the compiled forward, so
compiled decoding (CUDA graphs included) is unchanged.

What is measured is TRL's definition for vLLM: log_softmax(logits / temperature) of the logits the sampler
saw, after transformers' own processors (`suppress_tokens`, `min_new_tokens`: what the tokens were really drawn
from) and before top-k / top-p truncation (transformers applies those after the processors passed to `generate`).
The loss pass computes log_softmax(logits / temperature) too; the difference between the two is the mismatch
`vlmrl.engine.rollout.mismatch` measures and corrects.

`appended_processor(model, make, finish)` is how a processor joins each `generate` call of a block (the recorder
here; the bench's forced lengths and profiler window too).

Left out: vLLM (it returns its own log-probs), continuous batching (no processors), beam search.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vlmrl.engine.patch import replaced


class SamplerLogprobs:
    """A logits processor recording log p(sampled token) at every step of one `generate` call.

    >>> p = SamplerLogprobs(temperature=2.0)
    >>> ids = torch.tensor([[7]])                       # a one-token prompt
    >>> _ = p(ids, torch.tensor([[0.0, 2.0]]))          # step 0: logits / 2 = [0, 1]
    >>> _ = p(torch.tensor([[7, 1]]), torch.tensor([[4.0, 0.0]]))  # token 1 was sampled at step 0
    >>> steps = p.finish(torch.tensor([[7, 1, 0]]))    # token 0 at step 1
    >>> [round(x, 4) for x in steps[0].tolist()]        # log_softmax([0, 1])[1], log_softmax([2, 0])[0]
    [-0.3133, -0.1269]
    """

    def __init__(self, temperature: float = 1.0):
        self.temperature = float(temperature or 1.0)
        self.prompt_length: int | None = None
        self.steps: list[torch.Tensor] = []  # [B] per step: log p of the token sampled at that step
        self._logp: torch.Tensor | None = None  # [B, V] the last step's log_softmax(logits / temperature)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prompt_length is None:
            self.prompt_length = input_ids.shape[1]
        elif self._logp is not None:  # input_ids now ends with the token sampled from the last step's scores
            self.steps.append(self._gather(input_ids[:, -1]))
        scaled = scores.float() if self.temperature == 1.0 else scores.float() / self.temperature
        self._logp = torch.log_softmax(scaled, dim=-1)  # a new tensor: later processors cannot change it
        return scores

    def _gather(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._logp.gather(-1, tokens[:, None].to(self._logp.device)).squeeze(-1)

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """[B, completion tokens] log-probs, given `generate`'s output. The last step's token is gathered here; a
        step `generate` ran and then undid (the deferred stop check) is dropped."""
        generated = sequences.shape[1] - (self.prompt_length or sequences.shape[1])
        if len(self.steps) < generated and self._logp is not None:
            self.steps.append(self._gather(sequences[:, self.prompt_length + len(self.steps)]))
        self._logp = None
        if not self.steps:
            return torch.zeros(sequences.shape[0], 0)
        return torch.stack(self.steps[:generated], dim=1)


def enable_sampler_logprobs(trainer: Any) -> str:
    """Make `trainer`'s transformers rollouts return the sampler's log-probs (TRL's `logprobs`); says what it did.

    Wraps `trainer._generate_single_turn`, outside any wrapper already there (the fast path's contexts), so it
    works with the fast path on or off; install it after them."""
    if getattr(trainer, "use_vllm", False):
        return "vLLM's own (TRL's vLLM path returns them)"
    if getattr(trainer, "use_transformers_continuous_batching", False):
        return "none: continuous batching takes no logits processor"
    if getattr(trainer._generate_single_turn, "_vlmrl_sampler_logprobs", False):
        return "the sampler's (already installed)"
    inner = trainer._generate_single_turn

    def generate(*args: Any, **kwargs: Any) -> tuple[list[list[int]], Any]:
        recorder = SamplerLogprobs(trainer.temperature)
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        with _with_processor(model, recorder) as seen:
            completion_ids, logprobs = inner(*args, **kwargs)
        if logprobs is None and seen:  # [B, steps] -> one list per completion, cut where TRL cut it (first EOS)
            rows = seen[0].cpu().tolist()
            logprobs = [row[: len(ids)] for row, ids in zip(rows, completion_ids, strict=True)]
        return completion_ids, logprobs

    generate._vlmrl_sampler_logprobs = True  # type: ignore[attr-defined]
    trainer._generate_single_turn = generate
    return "the sampler's: log_softmax(logits / temperature) of each sampled token, gathered during generate"


@contextlib.contextmanager
def appended_processor(model: Any, make: Callable[[tuple, dict], Any],
                       finish: Callable[[Any, Any], None] | None = None) -> Iterator[None]:
    """For the block, each `model.generate` call also runs the logits processor `make(args, kwargs)` returns for
    that call, after any processors it is given, and `finish(processor, output)` once the call returns. Someone's
    own wrapper on the instance is put back as it was."""
    from transformers import LogitsProcessorList

    original = model.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        processors = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
        processor = make(args, kwargs)
        processors.append(processor)
        out = original(*args, logits_processor=processors, **kwargs)
        if finish is not None:
            finish(processor, out)
        return out

    with replaced(model, "generate", generate):
        yield


@contextlib.contextmanager
def _with_processor(model: Any, recorder: SamplerLogprobs) -> Iterator[list[torch.Tensor]]:
    """For the block, `model.generate` also runs `recorder` (after any processors it is given) and appends the
    log-probs of what it generated to the yielded list."""
    seen: list[torch.Tensor] = []

    def finish(processor: SamplerLogprobs, out: Any) -> None:
        seen.append(processor.finish(out if isinstance(out, torch.Tensor) else out.sequences))

    with appended_processor(model, lambda args, kwargs: recorder, finish):
        yield seen
