"""An error leaving a watched model's training forward (``training.oom_watch``, the out-of-memory watch's hook):
recorded (``step_error``, at its block, step and rank), then left to the user's loop as it was. A loop that catches
it and goes on (``except Exception: continue``) skipped the step, and nothing else said so."""

import contextlib
import copy
import gc

import pytest
import torch

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.record import load_json, read_jsonl


def _caught_loop(tdbg, optimizer, block, forward, planted, steps, catch=Exception, **monitored):
    """A plain loop whose ``block`` raises ``planted[step]`` at the steps ``planted`` names, under
    ``except catch: continue``; ``forward()`` gives the step's loss, ``tdbg`` (None: unwatched) is given each
    finished step (``monitored``: more of its arguments). The steps whose loss was computed, the errors caught."""
    done, caught = [], []
    for step in range(steps):

        def fail(module, args, error=planted.get(step)):
            raise error

        try:
            with block.register_forward_pre_hook(fail) if step in planted else contextlib.nullcontext():
                loss = forward()
            loss.backward()
            if tdbg is not None:
                tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, **monitored)
            optimizer.step()
            optimizer.zero_grad()
            done.append(step)
        except catch as error:
            caught.append(error)
    return done, caught


def _unet_run(unet, tdbg, bad_step, steps=6):
    """A plain AdamW loop on one fixed batch of ``unet`` whose ``up_blocks.1`` raises at ``bad_step``, under
    ``except Exception: continue``; the steps whose loss was computed, and the error the loop caught."""
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(1, unet.config.in_channels, 8, 8, generator=generator)
    context = torch.randn(1, 4, unet.config.cross_attention_dim, generator=generator)
    noise = torch.randn(sample.shape, generator=generator)
    timesteps = torch.tensor([500])

    def forward():
        return ((unet(sample, timesteps, context).sample - noise) ** 2).mean()

    planted = {bad_step: ValueError("a bad batch")}
    return _caught_loop(tdbg, optimizer, unet.up_blocks[1], forward, planted, steps, timesteps=timesteps)


def test_a_forward_error_the_loop_catches_and_goes_on_from_is_named_at_its_block_and_step(_tiny_unet, tmp_path):
    """The tiny SD UNet's ``up_blocks.1`` raises at step 3 and the loop goes on: the run had six steps, five
    monitored, and the report was clean. The step's error is named, at its block and step; the loop ran as without
    the debugger (the same steps, the same error object caught, the same weights), under policy ``raise`` too."""
    plain = copy.deepcopy(_tiny_unet).train()
    plain_done, plain_caught = _unet_run(plain, None, bad_step=3)
    unet = copy.deepcopy(_tiny_unet).train()
    tdbg = TrainingDebugger(unet, config=DebugConfig(output_dir=str(tmp_path), policy="raise"))
    done, caught = _unet_run(unet, tdbg, bad_step=3)
    tdbg.close()
    assert done == plain_done == [0, 1, 2, 4, 5]
    assert [str(e) for e in caught] == [str(e) for e in plain_caught] == ["a bad batch"]
    assert all(torch.equal(a, b) for a, b in zip(unet.parameters(), plain.parameters()))
    report = tdbg.report()
    (found,) = report.anomalies
    assert (found.kind, found.severity, found.component, found.module, found.step, found.rank) == (
        "step_error",
        "warning",
        "model",
        "up_blocks.1",
        3,
        0,
    )
    assert (found.details["error"], found.details["phase"]) == ("ValueError: a bad batch", "forward")
    assert found.message == (
        "The training forward raised ValueError: a bad batch in up_blocks.1 at step 3: the forward did not finish "
        "(a loop that catches the error and goes on skips the step)."
    )
    run_dir = report.save(html=False)
    assert load_json(run_dir / "summary.json")["headline"]["where"] == "model up_blocks.1, step 3"


def test_an_error_not_caught_reaches_the_user_unchanged_and_is_in_the_events_file(mlp, tmp_path):
    """Not caught, the error ends the loop as it would (the same object); the run's events file names it already
    (a killed run's report is rebuilt from it)."""
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    planted = RuntimeError("shape mismatch")

    def bad_batch(module, args):
        raise planted

    with mlp[2].register_forward_pre_hook(bad_batch), pytest.raises(RuntimeError) as raised:
        mlp(torch.ones(2, 4))
    assert raised.value is planted
    events = [e for e in read_jsonl(tdbg.record.run_dir / "events.jsonl") if e.get("kind") == "step_error"]
    assert [(e["module"], e["step"], e["details"]["error"]) for e in events] == [
        ("2", 0, "RuntimeError: shape mismatch")
    ]
    tdbg.close()


def test_an_error_in_a_forward_without_grad_is_not_the_step_s(mlp, tmp_path):
    """Validation, sampling, a frozen model's call under ``no_grad``: not a training step, not recorded."""
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))

    def bad_batch(module, args):
        raise ValueError("a bad validation batch")

    with torch.no_grad(), mlp[2].register_forward_pre_hook(bad_batch), pytest.raises(ValueError):
        mlp(torch.ones(2, 4))
    tdbg.close()
    assert tdbg.report().anomalies == []


def _checkpoint_goes_on_after_a_forward_error(mlp) -> bool:
    """Whether an unwatched loop over a copy of ``mlp`` checkpointed (non-reentrant) goes on after its forward raised
    at step 2 and the loop caught it: torch 2.5's leaves that forward's saved-tensors hook pushed until its frame is
    collected, and the next backward raises ``CheckpointError``. The failed frames are dropped and collected before
    this returns (the hook popped), so that later tests do not run under it."""
    from torch.utils.checkpoint import CheckpointError, checkpoint

    plain, head = copy.deepcopy(mlp), torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(list(plain.parameters()) + list(head.parameters()), lr=1e-2)
    try:
        _caught_loop(
            None,
            optimizer,
            plain[2],
            lambda: head(checkpoint(plain, torch.randn(2, 4), use_reentrant=False)).pow(2).mean(),
            {2: ValueError("a bad batch")},
            4,
            catch=ValueError,
        )
    except CheckpointError:
        goes_on = False
    else:
        goes_on = True
    gc.collect()  # (out of the except: its traceback, which holds the failed frames, is gone)
    return goes_on


def test_a_checkpointed_model_s_recompute_in_backward_is_not_a_step_error(mlp, tmp_path):
    """Non-reentrant checkpointing over a watched model: backward re-runs its forward and stops it with an error of
    torch's (``_StopRecomputationError``) once it has what it needs, with gradients on, in training mode. Not the
    step's error: a clean run stays quiet; a real error in the checkpointed forward is still named, once."""
    from torch.utils.checkpoint import checkpoint

    if not _checkpoint_goes_on_after_a_forward_error(mlp):
        pytest.skip("this torch's checkpoint raises in the backward after a caught forward error, unwatched too")
    head = torch.nn.Linear(1, 1)
    tdbg = TrainingDebugger({"encoder": mlp, "head": head}, config=DebugConfig(output_dir=str(tmp_path)))
    optimizer = torch.optim.SGD(list(mlp.parameters()) + list(head.parameters()), lr=1e-2)

    def forward():
        return head(checkpoint(mlp, torch.randn(2, 4), use_reentrant=False)).pow(2).mean()

    _caught_loop(tdbg, optimizer, mlp[2], forward, {2: ValueError("a bad batch")}, 4, catch=ValueError)
    tdbg.close()
    assert [(a.kind, a.component, a.module, a.step, a.details["error"]) for a in tdbg.report().anomalies] == [
        ("step_error", "encoder", "2", 2, "ValueError: a bad batch")
    ]


def test_two_kinds_of_error_at_one_block_are_each_named(mlp, tmp_path):
    """A bad batch at step 1, a device assert at step 3, both at the same block: two anomalies, each with its own
    error and step (folded into the first, the second error was not shown anywhere); a repeat of one folds."""
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    optimizer = torch.optim.SGD(mlp.parameters(), lr=1e-2)
    planted = {1: ValueError("a bad batch"), 3: RuntimeError("device-side assert"), 4: ValueError("a bad batch")}
    _caught_loop(tdbg, optimizer, mlp[2], lambda: mlp(torch.randn(2, 4)).pow(2).mean(), planted, 5)
    tdbg.close()
    found = [(a.module, a.step, a.details["error"], a.details.get("count")) for a in tdbg.report().anomalies]
    assert found == [("2", 1, "ValueError: a bad batch", 2), ("2", 3, "RuntimeError: device-side assert", 1)]
