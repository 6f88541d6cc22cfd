"""The optimizer state waits on the host during rollouts (`vlmrl.engine.rollout.offload`): it comes back bit for bit, into
the optimizer the trainer steps, also when the rollout raises; the device tensors are let go meanwhile."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
import torch

from vlmrl.engine.rollout import offload
from vlmrl.engine.rollout.offload import OptimizerStateOffload


def _stepped_adam():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(3))]
    optimizer = torch.optim.AdamW(params, lr=0.1)
    sum(p.square().sum() for p in params).backward()
    optimizer.step()
    return params, optimizer


@pytest.fixture
def device_state(monkeypatch):
    """On the CPU every tensor is host memory already: treat the state's as device memory to move."""
    monkeypatch.setattr(offload, "_offloadable", lambda v: isinstance(v, torch.Tensor) and v.numel() > 1)


def test_the_state_is_on_the_host_inside_and_back_unchanged_after(device_state):
    params, optimizer = _stepped_adam()
    trainer = SimpleNamespace(optimizer=SimpleNamespace(optimizer=optimizer))  # accelerate's wrapper shape
    before = {(id(p), k): v.clone() for p, s in optimizer.state.items() for k, v in s.items()}
    originals = [weakref.ref(v) for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    mover = OptimizerStateOffload(trainer)
    with mover.active():
        assert all(ref() is None for ref in originals), "the device tensors must be let go during the rollout"
        assert mover.moved_bytes == sum(p.numel() * 4 * 2 for p in params)  # two float32 moments each
        inside = {(id(p), k): v for p, s in optimizer.state.items() for k, v in s.items() if k != "step"}
        assert all(v is mover.host[key] for key, v in inside.items())
    after = {(id(p), k): v for p, s in optimizer.state.items() for k, v in s.items()}
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert all(after[k] is not mover.host[k] for k in mover.host), "back in (device) tensors of their own"
    optimizer.step()  # the optimizer steps on the restored state as before
    buffers = dict(mover.host)
    with mover.active():
        pass
    assert all(mover.host[k] is buffers[k] for k in buffers), "host buffers are reused"


def test_the_state_comes_back_when_the_rollout_raises(device_state):
    _, optimizer = _stepped_adam()
    before = {(id(p), k): v.clone() for p, s in optimizer.state.items() for k, v in s.items()}
    mover = OptimizerStateOffload(SimpleNamespace(optimizer=optimizer))
    with pytest.raises(RuntimeError, match="rollout"), mover.active():
        raise RuntimeError("the rollout failed")
    after = {(id(p), k): v for p, s in optimizer.state.items() for k, v in s.items()}
    assert all(torch.equal(after[k], before[k]) and after[k] is not mover.host[k]
               for k in before if k in mover.host)


def test_nothing_moves_without_an_optimizer_or_state_and_host_tensors_stay():
    for trainer in (SimpleNamespace(), SimpleNamespace(optimizer=None),
                    SimpleNamespace(optimizer=torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]))):
        mover = OptimizerStateOffload(trainer)
        with mover.active():
            assert mover.moved_bytes == 0
    params, optimizer = _stepped_adam()
    state = {k: v for k, v in optimizer.state[params[0]].items()}
    with OptimizerStateOffload(SimpleNamespace(optimizer=optimizer)).active():  # real predicate: CPU tensors stay
        assert all(optimizer.state[params[0]][k] is v for k, v in state.items())
