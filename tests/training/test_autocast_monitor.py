"""A training step monitored inside the user's ``with torch.autocast(...)`` (the whole loop under it, as some
scripts write it): the debugger's reductions run outside autocast, so a half dtype that is not autocast's own (an
fp16 parameter group under bf16 autocast) reads as outside it, and the step is measured, not a ``debugger_error``."""

from __future__ import annotations

import math
import tempfile

import torch

from diffusion_debug import DebugConfig, TrainingDebugger

VARYING = ("step_time_s", "samples_per_s", "memory")


def _three_steps(inside: bool) -> tuple[list[dict], list[tuple[str, str]], list[float]]:
    """Three steps of an MLP whose last layer is fp16 (its own param group) under CPU bf16 autocast, monitored
    inside the region (``inside``) or after it; each step's info (but times and memory), the anomalies, and each
    step's naive gradient norm (float64 over every gradient)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model[2].to(torch.float16)
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 1e-3}]
    optimizer = torch.optim.SGD(groups, lr=1e-2)
    dbg = TrainingDebugger(model, config=DebugConfig(output_dir=tempfile.mkdtemp(), log_level="error"))
    infos, naive = [], []
    for step in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(5, 8)).float().pow(2).mean()
            loss.backward()
            if inside:
                info = dbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        if not inside:
            info = dbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        naive.append(math.sqrt(sum(p.grad.float().norm().item() ** 2 for p in model.parameters())))
        infos.append({k: v for k, v in info.items() if k not in VARYING})
        optimizer.step()
        optimizer.zero_grad()
    anomalies = [(a.kind, a.message) for a in dbg.report().anomalies]
    dbg.close()
    return infos, anomalies, naive


def test_an_fp16_param_group_monitored_inside_bf16_autocast_is_measured_as_outside_it():
    """Monitored inside the region, step 0 was 'Rank 0 failed to measure step 0 (RuntimeError: Unexpected floating
    ScalarType in at::autocast::prioritize)': the applied-update sketch joined the fp16 weights' blocks with
    autocast's ``cat``, which takes float32 and bf16 only there. Every step's info now is bitwise the one of the
    same steps monitored after the region, and the gradient norm the naive one."""
    inside, found, naive = _three_steps(inside=True)
    outside, found_outside, _ = _three_steps(inside=False)
    assert found == found_outside == []
    assert inside == outside
    assert [info["gradients_read"] for info in inside] == [True, True, True]
    assert [info["grad_norm"] for info in inside] == naive
