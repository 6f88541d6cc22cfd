"""The loss pass holds no full-vocabulary logits (issue 21, Deliver 2): TRL 1.16's GRPOTrainer already patches the
policy with a fused LM head (`trl.trainer.utils.add_fused_lm_head`, called in `GRPOTrainer.__init__`) whose
log-probs come from `trl.kernels.ChunkedLogProbFunction`: the head is applied per tile of tokens x vocabulary
with an online logsumexp, and the backward recomputes each tile. vlmrl's trainer is TRL's, so it gets this on
every path; vlmrl adds no chunked pass of its own. These tests pin that on a tiny Qwen3-VL on the CPU: the same
log-probs and gradients as the full-logits computation, and no tensor anywhere near [tokens, vocab] in size.
"""

from __future__ import annotations

import pytest
import torch
import trl.kernels.chunked_logprob as chunked
import trl.trainer.utils as trl_utils
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForImageTextToText

from vlmrl.models.tiny import build_tiny_model

VOCAB = 1024


class LargestTensor(TorchDispatchMode):
    """The largest tensor any op produces while active (numel)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = build_tiny_model("qwen3_vl", tmp_path_factory.mktemp("loss_pass") / "m", vocab_size=VOCAB)
    return folder


def _model(folder):
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32)
    assert model.config.get_text_config().vocab_size == VOCAB
    return model


def _batch(prompt: int = 6, completion: int = 40, batch: int = 4):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(10, VOCAB - 10, (batch, prompt + completion), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding on one prompt
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :prompt] = -100  # only the completion is scored, as TRL's loss pass does
    return ids, mask, labels


def _reference(model, ids, mask, labels):
    """What a loss pass without the fused head computes: the full [B, L, V] logits, then log_softmax."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    targets = labels[:, 1:]
    logps = torch.log_softmax(logits.float(), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return logps.masked_fill(targets == -100, 0)


def test_fused_head_gives_the_same_log_probs_and_gradients_without_full_logits(tiny, monkeypatch):
    # tiles small enough that the full logits (4 x 45 positions x 1024) stand out from any tile and from the weights
    monkeypatch.setattr(chunked, "TOKEN_CHUNK_SIZE", 8)
    monkeypatch.setattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 128)
    ids, mask, labels = _batch()
    plain = _model(tiny)
    with LargestTensor() as seen_plain:
        ref = _reference(plain, ids, mask, labels)
        ref.sum().backward()
    fused = _model(tiny)
    trl_utils.add_fused_lm_head(fused, outputs=("log_probs", "entropy"))  # as GRPOTrainer.__init__ does
    with LargestTensor() as seen_fused:
        out = fused(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        out.log_probs.sum().backward()
    assert torch.allclose(out.log_probs, ref, atol=1e-5)
    for (name, a), (_, b) in zip(plain.named_parameters(), fused.named_parameters(), strict=True):
        if a.grad is not None or b.grad is not None:
            assert torch.allclose(a.grad, b.grad, atol=1e-5), name
    full = ids.shape[0] * (ids.shape[1] - 1) * VOCAB
    assert seen_plain.largest >= full  # the reference holds the full logits...
    # ...the fused pass at most its largest non-vocabulary tensor (the embedding/head weights) or one tile
    hidden = plain.config.get_text_config().hidden_size
    assert seen_fused.largest <= max(VOCAB * hidden, 8 * 128) < full


def test_grpo_trainer_installs_the_fused_head():
    """The patch the test above relies on is TRL's own, applied by the trainer vlmrl builds (guards an upgrade)."""
    import inspect

    from trl import GRPOTrainer

    source = inspect.getsource(GRPOTrainer.__init__)
    assert "add_fused_lm_head(" in source
    source = inspect.getsource(GRPOTrainer._get_per_token_logps_and_entropies)
    assert "fused_lm_head=True" in source
