"""A plain fp16 loop (autocast, a real ``torch.amp.GradScaler``) that does not pass ``scaler=``
(``training.measure.unnamed_scaler``): the scaler the calling code holds is found at the first step whose
gradients look scaled, and the run reads as the same run with ``scaler=`` passed; several held: one warning
that names the fix."""

import pytest
import torch
from torch import nn

from diffusion_debug import DebugConfig, TrainingDebugger


def _fp16_loop(tmp_path, *, given, spare=False, steps=6):
    """SGD on an MLP under float16 autocast with a GradScaler at its default scale (65536), an inf planted in
    a gradient at step 3 (the scaler skips that step) and a real explosion (the gradients x 1e5) at step 5;
    ``given``: the scaler passed as ``scaler=``; ``spare``: the loop holds a second scaler in use. The
    debugger (closed) and the gradient norm each step returned."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    if spare:
        other = torch.amp.GradScaler("cpu")  # a second model's, say: in use too
        other.scale(torch.ones(()))
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), log_level="error"))
    generator, norms = torch.Generator().manual_seed(0), []
    for step in range(steps):
        x = torch.randn(16, 4, generator=generator)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ((model(x).float() - torch.sin(x).sum(1, keepdim=True)) ** 2).mean()
        scaler.scale(loss).backward()
        if step == 3:
            model[2].weight.grad[0, 1] = float("inf")
        if step == 5:
            for p in model.parameters():
                p.grad.mul_(1e5)
        info = tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, scaler=scaler if given else None)
        norms.append(info["grad_norm"])
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    tdbg.close()
    return tdbg, norms


def _seen(tdbg):
    return sorted(
        (a.kind, a.step, a.severity, a.parameter or "")
        for a in tdbg.report().anomalies
        if a.kind != "grad_scaler_not_given"
    )


def test_a_grad_scaler_not_passed_is_found_in_the_calling_code_and_the_run_reads_as_with_it_passed(tmp_path):
    # before: every step's norm was 65536x the true one (gradient_explosion at each step), the skipped step's
    # inf an error, and no skipped_step; now the run reads as the one that passes scaler=
    given, given_norms = _fp16_loop(tmp_path / "given", given=True)
    found, found_norms = _fp16_loop(tmp_path / "found", given=False)
    # step 1 overflows in fp16 at the first scale (65536) as well: the scaler skips it, as step 3's planted inf
    assert (
        _seen(found)
        == _seen(given)
        == [
            ("gradient_explosion", 5, "warning", ""),
            ("lr_spike", 5, "warning", ""),  # SGD: lr x gradient / weight, the real explosion's
            ("nonfinite", 1, "info", "2.weight"),
            ("nonfinite", 3, "info", "2.weight"),
            ("skipped_step", 1, "info", ""),
            ("skipped_step", 3, "info", ""),
        ]
    )
    kept = [0, 2, 4, 5]  # steps 1 and 3: inf in both
    assert [found_norms[i] for i in kept] == pytest.approx([given_norms[i] for i in kept], rel=1e-5)
    assert [found.report().steps[i]["grad_norm"] for i in kept] == pytest.approx(
        [given.report().steps[i]["grad_norm"] for i in kept], rel=1e-5
    )
    assert found.get_summary()["skipped_steps"] == given.get_summary()["skipped_steps"] == 2
    (note,) = [a for a in found.report().anomalies if a.kind == "grad_scaler_not_given"]
    d = note.details
    assert (note.step, note.severity, d["scale"], d["already_unscaled"]) == (0, "info", 65536.0, False)
    assert d["grad_norm"] == pytest.approx(given_norms[0], rel=1e-5)
    assert d["grad_norm_read"] == pytest.approx(65536.0 * given_norms[0], rel=1e-5)
    assert note.message == (
        "At step 0: the gradients are scaled by a GradScaler (scale 65536) that was not passed to "
        "monitor_training_step; found in the calling code, it is used from this step on (the gradient norm read "
        f"{d['grad_norm_read']:.4g}, {d['grad_norm']:.4g} unscaled): pass it as "
        "monitor_training_step(..., scaler=scaler)."
    )


def test_two_grad_scalers_in_the_calling_code_get_one_warning_that_names_the_fix(tmp_path):
    tdbg, norms = _fp16_loop(tmp_path, given=False, spare=True)
    (warning,) = [a for a in tdbg.report().anomalies if a.kind == "grad_scaler_not_given"]
    assert (warning.step, warning.severity, warning.details["scalers"]) == (0, "warning", 2)
    assert warning.message == (
        f"At step 0: the gradient norm read {norms[0]:.4g} with no GradScaler given, and the calling code holds 2 "
        "GradScalers in use: the gradients are read as they are, scaled by the one that scales this loss (an "
        "explosion or NaN that is not one); pass that one as monitor_training_step(..., scaler=scaler)."
    )
    assert norms[0] > 1e3  # read as it is: the scaled norm
