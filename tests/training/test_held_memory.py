"""What the training debugger holds between steps: nothing the user's loop has let go of.

A reference of ours to a gradient, an activation, the loss graph or a parameter's storage keeps
that memory alive after the user's code frees it (``optimizer.zero_grad(set_to_none=True)``, the
default in torch 2.x; ``del loss``; ``model.to(...)``): a model's worth of memory that a fine-tune
which fits without the debugger may not have. Each test frees something as a loop does and
looks, through weak references, at whether it is gone, with the debugger and without it (the
same loop unwatched: what is gone there must be gone here).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from diffusion_debug import DebugConfig, TrainingDebugger


def _config(tmp_path):
    return DebugConfig(level="advanced", output_dir=str(tmp_path))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def _backward(model, batch, backward=torch.Tensor.backward):
    hidden = model[0](batch)
    loss = model[2](model[1](hidden)).square().mean()
    backward(loss)
    return loss, hidden


def _per_sample_backward(model, batch):
    hidden = model[0](batch)
    per_sample_loss = model[2](model[1](hidden)).square().reshape(-1)  # with its graph, as a script passes it
    loss = per_sample_loss.mean()
    loss.backward()
    return loss, per_sample_loss, hidden


def _alive(refs):
    gc.collect()
    return [i for i, ref in enumerate(refs) if ref() is not None]


@pytest.mark.parametrize("watched", [False, True], ids=["plain", "watched"])
@pytest.mark.parametrize("accumulation", [1, 2], ids=["every-step", "accumulate-2"])
def test_gradients_set_to_none_after_any_call_are_freed(tmp_path, watched, accumulation):
    # train18: a micro-step that measured nothing kept the .grad list it made for its swap check until
    # the next call (and for ever after the last one): zero_grad(set_to_none=True) freed nothing then
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tdbg = TrainingDebugger(model, config=_config(tmp_path)) if watched else None
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    for i, batch in enumerate(batches):  # five batches: the last accumulation is cut short (an epoch's end)
        loss, per_sample_loss, hidden = _per_sample_backward(model, batch)
        steps = (i + 1) % accumulation == 0
        if tdbg is not None:  # every argument that takes a tensor of the step (the closure holds the batch)
            tdbg.monitor_training_step(
                loss,
                optimizer=optimizer,
                step=i // accumulation,
                timesteps=torch.tensor([100, 900, 400, 10]),
                per_sample_loss=per_sample_loss,
                inputs={"pixels": batch},
                closure=lambda batch=batch: _backward(model, batch, backward=lambda loss: None)[0],
                accumulating=not steps,
            )
        if steps:
            optimizer.step()
        grads = [weakref.ref(p.grad) for p in model.parameters()]
        graph = [weakref.ref(loss), weakref.ref(per_sample_loss), weakref.ref(hidden)]
        del loss, per_sample_loss, hidden
        assert _alive(graph) == [], f"call {i}: the loss or an activation is still held"
        if steps or i == len(batches) - 1:  # a step, or the partial accumulation dropped
            optimizer.zero_grad(set_to_none=True)
            assert _alive(grads) == [], f"call {i}: gradients set to None are still held"
    if tdbg is not None:
        summary = tdbg.get_summary()
        assert summary["total_steps"] == 5 // accumulation
        assert summary["accumulating_micro_steps"] == 5 - 5 // accumulation
        tdbg.close()


def test_gradients_of_an_accelerate_micro_step_dropped_are_freed(tmp_path, fresh_accelerate_state):
    # Accelerate's micro-steps (sync_gradients False) are not measured either: the same list, the same hold
    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    tdbg = TrainingDebugger(model, accelerator=accelerator, config=_config(tmp_path))
    for step in range(3):
        with accelerator.accumulate(model):
            loss, _ = _backward(model, torch.randn(4, 8), accelerator.backward)
            tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
            optimizer.step()
            optimizer.zero_grad()
    assert tdbg.get_summary()["accumulating_micro_steps"] == 2  # calls 0 and 2 accumulated
    grads = [weakref.ref(p.grad) for p in model.parameters()]
    model.zero_grad(set_to_none=True)  # the partial accumulation dropped
    assert _alive(grads) == []
    tdbg.close()


def test_a_closed_debugger_holds_no_storage_the_model_let_go_of(tmp_path):
    # the update sketch's blocks are views into the weights: after close, a model moved (to the CPU,
    # to another dtype) must not keep its old storage alive through them
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with TrainingDebugger(model, config=_config(tmp_path)) as tdbg:
        for step in range(3):
            loss, _ = _backward(model, torch.ones(4, 8))
            tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
            optimizer.step()
            optimizer.zero_grad()
    tdbg.close()
    storages = [p.untyped_storage()._weak_ref() for p in model.parameters()]
    try:
        model.double()  # each parameter's storage replaced (``param.data = ...``)
        gc.collect()
        held = [i for i, handle in enumerate(storages) if not torch.UntypedStorage._expired(handle)]
    finally:
        for handle in storages:
            torch.UntypedStorage._free_weak_ref(handle)
    assert held == []
    assert tdbg.report().steps  # the report still reads the record
