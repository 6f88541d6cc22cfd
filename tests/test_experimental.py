"""`vlmrl.engine.experimental`: it warns when imported, stable code never imports it (an import-linter contract that
covers every other module), and `apply` adds its variants among a trainer's rollout contexts in the right order.
The variants themselves: tests/test_merge.py, test_attend_filled.py, test_guards_once.py."""

from __future__ import annotations

import contextlib
import functools
import importlib
import tomllib
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.test_merge import _lora
from vlmrl.engine.lora_layers import lora_layers
from vlmrl.engine.rollout.fast import FastGeneration, wrap_rollouts

ROOT = Path(__file__).resolve().parents[1]


def test_importing_it_warns_unless_silenced(monkeypatch):
    from vlmrl.engine import experimental

    monkeypatch.delenv("VLMRL_EXPERIMENTAL_SILENCE", raising=False)
    with pytest.warns(UserWarning, match="vlmrl.engine.experimental is unsupported"):
        importlib.reload(experimental)
    monkeypatch.setenv("VLMRL_EXPERIMENTAL_SILENCE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.reload(experimental)


def test_the_contract_keeps_every_other_module_from_importing_it():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    contract = next(c for c in contracts if c.get("forbidden_modules") == ["vlmrl.engine.experimental"])
    sources = set(contract["source_modules"])
    src = ROOT / "src" / "vlmrl"
    top = {f"vlmrl.{p.stem}" for p in src.iterdir() if p.suffix == ".py" and p.stem != "__init__"}
    top |= {f"vlmrl.{p.name}" for p in src.iterdir() if (p / "__init__.py").is_file() and p.name != "engine"}
    engine = {f"vlmrl.engine.{p.stem}" for p in (src / "engine").iterdir()
              if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert top | engine - {"vlmrl.engine.experimental"} <= sources


def _trainer(model, seen: list) -> SimpleNamespace:
    """A trainer as `enable_fast_generation` leaves it: named rollout contexts that record when they are entered."""
    trainer = SimpleNamespace(model=model, _generate_single_turn=lambda: seen.append(
        ("rollout", all(layer.merged for layer in lora_layers(model)))))

    @contextlib.contextmanager
    def context(name):
        seen.append(name)
        yield

    names = ("attention", "decode_kernel", "offload", "stacked", "autocast", "stop_check", "compile_over_4bit")
    wrap_rollouts(trainer, [(name, functools.partial(context, name)) for name in names])
    return trainer


def test_apply_puts_each_variant_in_its_place_and_records_it():
    from vlmrl.engine.experimental.rollout import apply

    seen: list = []
    model = _lora(torch.bfloat16)
    before = [layer.get_base_layer().weight.clone() for layer in lora_layers(model)]
    trainer = _trainer(model, seen)
    fast = FastGeneration(True, "static KV cache + torch.compile", cache_read="the whole static cache",
                          adapters="stacked by shared input")
    done = apply(trainer, fast, merge=True, filled_window=64, guards_once=True)
    assert [name for name, _ in trainer.vlmrl_rollout_contexts] == [
        "attention", "filled_window", "decode_kernel", "merge", "autocast", "stop_check", "guards_once",
        "compile_over_4bit"]  # the stacked projections and the state's offload serve the unmerged adapter only
    assert done.merge.startswith("merged for rollouts") and done.guards == "first step"
    assert done.cache_read == "filled positions, rounded up to 64" and done.adapters.startswith("merged")
    seen.clear()
    trainer.vlmrl_rollout_contexts = [c for c in trainer.vlmrl_rollout_contexts
                                      if c[0] not in ("filled_window", "guards_once")]  # need a real model
    wrap_rollouts(trainer, trainer.vlmrl_rollout_contexts)
    trainer._generate_single_turn()
    assert seen == ["attention", "decode_kernel", "autocast", "stop_check", "compile_over_4bit", ("rollout", True)]
    after = [layer.get_base_layer().weight for layer in lora_layers(model)]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))  # restored bit for bit
    assert apply(trainer, FastGeneration(False, "vLLM"), merge=True) == FastGeneration(False, "vLLM")
