"""Stage 8, merged exports: the adapter folded into the base weights, saved, reloaded from disk and compared with
base + adapter on held-out items (logits and greedy tokens), with the observed difference and the tolerance.

Routes and why each tolerance is what it is (all recorded in `export.json`):
  - `merged-16bit/` from a 16-bit base: W + scale*BA computed once; only the summation order changes, so in
    float32 the logits agree to `LOGITS_ATOL` (1e-3) and the greedy tokens are identical. In bf16/fp16
    one rounding is allowed: 2^-7 x the largest |logit| (two bf16 units) and >= 90% greedy-token agreement.
  - `merged-16bit/` from an nf4 base: the nf4 weights are dequantized (code x absmax) and the adapter merged
    into them. The reference (bitsandbytes' nf4 forward) computes at 16-bit precision (measured on the CPU:
    it dequantizes to bf16, logits off by ~4e-3 relative), so the 16-bit tolerances apply, whatever the dtype.
  - `merged-4bit/`: `merged-16bit/` re-quantized to nf4. nf4 has 16 levels per block of 64, and most of a LoRA
    delta is below one level, so logits move by design: the gate is next-token (argmax) agreement >= 90% at the
    probe's positions and >= 90% greedy-token agreement; the max logit difference is recorded, not gated.
Left out: GPTQ/AWQ/other quantizers; the merged model with a trainable vision tower is merged like any other.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlmrl.config.schema import Config
from vlmrl.data.items import open_record_images

GREEDY_TOKENS = 16  # per held-out item: long enough to leave the prompt's influence, short enough for a CPU
# Largest |logit| difference between two float32 computations of the same function in another summation order
# (a reloaded adapter, a merge); the adapter reload check (vlmrl.export.stage) uses it as well.
LOGITS_ATOL = 1e-3


@dataclass
class Reference:
    """What base + adapter produced on the probe items: logits of the first, greedy tokens of each."""

    logits: torch.Tensor
    tokens: list[list[int]]


@dataclass(frozen=True)
class Tolerance:
    logits_atol: float | None  # None: recorded, not gated
    relative: float  # the gate is max(logits_atol, relative x the reference's largest |logit|)
    argmax_agreement: float  # fraction of probe positions whose next-token argmax must agree (with a logit
    # gate: of the positions whose reference top-2 gap exceeds twice that gate)
    token_agreement: float  # fraction of greedy tokens (over all items) that must agree

    def describe(self) -> str:
        gate = "logit diff recorded" if self.logits_atol is None else f"max |logit diff| <= {self.logits_atol}" + (
            f" or {self.relative:g} x max |reference logit|" if self.relative else "")
        return f"{gate}, argmax agreement >= {self.argmax_agreement}, greedy-token agreement >= {self.token_agreement}"


def merged_tolerance(dtype: torch.dtype) -> Tolerance:
    """A merge changes only the summation order (float32) or adds one rounding of the weight (16-bit).

    >>> merged_tolerance(torch.float32).token_agreement
    1.0
    >>> merged_tolerance(torch.bfloat16).relative == 2**-7
    True
    """
    if dtype == torch.float32:
        return Tolerance(LOGITS_ATOL, 0.0, 1.0, 1.0)
    # bf16 keeps 8 significant bits: a rounding moves a value by up to 2^-8 of itself, so allow two such units of
    # the largest logit (relative, since logits of a trained model run to tens and an absolute bound misfits)
    return Tolerance(LOGITS_ATOL, 2**-7, 1.0, 0.9)


NF4_TOLERANCE = Tolerance(None, 0.0, 0.9, 0.9)


@torch.inference_mode()
def reference_outputs(loaded: Any, run_dir: Path, items: list[dict], first_logits: torch.Tensor | None = None
                      ) -> Reference:
    """base+adapter's logits on the first item (`first_logits` when the caller has them) and greedy tokens."""
    first = first_logits if first_logits is not None else logits(loaded, run_dir, items[0])
    return Reference(first, [_greedy(loaded, run_dir, item) for item in items])


def compare(loaded: Any, run_dir: Path, items: list[dict], reference: Reference, tolerance: Tolerance) -> dict:
    """Observed differences of `loaded` against the reference, and whether they are within `tolerance`."""
    got = logits(loaded, run_dir, items[0])
    diff = (reference.logits - got).abs().max().item()
    agree = reference.logits.argmax(-1) == got.argmax(-1)
    scale = reference.logits.abs().max().item()
    gate = None if tolerance.logits_atol is None else max(tolerance.logits_atol, tolerance.relative * scale)
    if gate is not None:
        # Within the logit tolerance a near tie may flip (random-weight models are full of them); where the
        # reference's top-2 gap exceeds twice the tolerance, a within-tolerance difference cannot flip it.
        top2 = reference.logits.topk(2, dim=-1).values
        agree = agree[(top2[..., 0] - top2[..., 1]) > 2 * gate]
    argmax = agree.float().mean().item() if agree.numel() else 1.0
    same = total = 0
    for item, expected in zip(items, reference.tokens):
        got = _greedy(loaded, run_dir, item)
        total += max(len(expected), len(got))
        same += sum(a == b for a, b in zip(expected, got))
    token_agreement = same / total if total else 1.0
    passed = ((gate is None or diff <= gate)
              and argmax >= tolerance.argmax_agreement and token_agreement >= tolerance.token_agreement)
    return {"passed": passed, "max_logit_diff": diff, "logit_gate": gate, "max_reference_logit": scale, "argmax_agreement": argmax, "argmax_positions": agree.numel(),
            "greedy_token_agreement": token_agreement, "items": len(items), "tolerance": tolerance.describe()}


def write_merged_16bit(config: Config, run_dir: Path, trained: Any, adapter_dir: Path, out: Path) -> torch.dtype:
    """Merge the adapter into 16/32-bit weights and save `out` as a plain transformers model. An nf4 base is
    reloaded and dequantized first (merging into nf4 would round the delta away)."""
    from peft import PeftModel

    from vlmrl.models.loading import load_model

    if config.model.load_in_4bit:
        base = load_model(config.model, run_dir, seed=config.run.seed).model
        base = base.dequantize()  # transformers' bnb dequantization: Linear4bit -> Linear in the compute dtype
        model = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    else:
        model = trained.model.merge_and_unload()
    _fresh(out)
    model.save_pretrained(str(out))
    dtype = next(model.parameters()).dtype
    del model
    return dtype


def write_merged_4bit(source: Path, out: Path) -> None:
    """Quantize `merged-16bit/` to the project's nf4 layout and save it (bitsandbytes, CUDA or CPU)."""
    from transformers import AutoModelForImageTextToText

    from vlmrl.models.loading import nf4_config, resolve_dtype

    dtype = resolve_dtype("auto")
    model = AutoModelForImageTextToText.from_pretrained(
        str(source), quantization_config=nf4_config(dtype), dtype=dtype, device_map=_device_map())
    _fresh(out)
    model.save_pretrained(str(out))
    del model


def load_plain(folder: Path) -> Any:
    """A merged folder as a user loads it: plain transformers, nothing from vlmrl's config."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmrl.models.loading import LoadedModel, detect_family

    model = AutoModelForImageTextToText.from_pretrained(str(folder), device_map=_device_map()).eval()
    processor = AutoProcessor.from_pretrained(str(folder))
    processor.tokenizer.padding_side = "left"
    return LoadedModel(model=model, processor=processor, backend="transformers", family=detect_family(str(folder)),
                       source=str(folder))


def _device_map() -> Any:
    return {"": torch.cuda.current_device()} if torch.cuda.is_available() else "cpu"


def _fresh(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)


@torch.inference_mode()
def logits(loaded: Any, run_dir: Path, item: dict) -> torch.Tensor:
    from vlmrl.engine.rollout.generation import encode_batch

    batch = encode_batch(loaded.processor, [item["prompt"]], [open_record_images(run_dir, item)], loaded.device)
    return loaded.model(**batch).logits.float().cpu()


@torch.inference_mode()
def _greedy(loaded: Any, run_dir: Path, item: dict) -> list[int]:
    from vlmrl.engine.rollout.generation import encode_batch
    from vlmrl.models.loading import multimodal_token_ids

    batch = encode_batch(loaded.processor, [item["prompt"]], [open_record_images(run_dir, item)], loaded.device)
    tokenizer = loaded.processor.tokenizer
    # a stray image placeholder would make the next step look for an image (see multimodal_token_ids)
    out = loaded.model.generate(**batch, max_new_tokens=GREEDY_TOKENS, do_sample=False, temperature=None,
                                top_p=None, top_k=None, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                                suppress_tokens=multimodal_token_ids(loaded.model.config) or None)
    return out[0, batch["input_ids"].shape[1]:].tolist()
