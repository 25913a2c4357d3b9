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


def _fp32_beside_an_fp16_model(tmp_path, *, passed=None, steps=8):
    """A plain fp32 MLP (no scaler) monitored, its gradients x 1e5 at step 3 (a real explosion), trained beside
    a second, unmonitored model under float16 autocast with its own GradScaler (a GAN's other half, a teacher);
    ``passed``: given as ``scaler=``. The debugger (closed)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    other = nn.Linear(4, 1)
    other_optimizer = torch.optim.SGD(other.parameters(), lr=0.01)
    other_scaler = torch.amp.GradScaler("cpu")
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), log_level="error"))
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        x = torch.randn(16, 4, generator=generator)
        with torch.autocast("cpu", dtype=torch.float16):
            other_loss = other(x).float().mean()
        other_scaler.scale(other_loss).backward()
        other_scaler.step(other_optimizer)
        other_scaler.update()
        other_optimizer.zero_grad()
        loss = ((model(x) - torch.sin(x).sum(1, keepdim=True)) ** 2).mean()
        loss.backward()
        if step == 3:
            for p in model.parameters():
                p.grad.mul_(1e5)
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, scaler=passed)
        optimizer.step()
        optimizer.zero_grad()
    tdbg.close()
    return tdbg


def test_another_models_grad_scaler_is_not_taken_for_a_plain_fp32_model(tmp_path):
    # before: the other model's GradScaler, the one in use in the calling code, was taken for this fp32 model at
    # step 3 (its explosion read 65536x too small) and used for the whole run: step 3's explosion hidden, and step
    # 4's and 7's (the weights thrown far) too. Now it is tried at step 3 only: the next step finds that it did
    # not step this optimizer (scaler.step(optimizer) never ran) and drops it, with a warning that tells step 3's
    # norm as read
    tdbg = _fp32_beside_an_fp16_model(tmp_path / "found")
    plain = sorted((a.kind, a.step, a.severity) for a in tdbg.report().anomalies if a.kind == "gradient_explosion")
    assert plain == [("gradient_explosion", 4, "warning"), ("gradient_explosion", 7, "warning")]
    notes = [
        (a.step, a.severity, a.details.get("dropped"))
        for a in tdbg.report().anomalies
        if a.kind == "grad_scaler_not_given"
    ]
    assert notes == [(3, "info", None), (3, "warning", True)]
    (dropped,) = [a for a in tdbg.report().anomalies if a.details.get("dropped")]
    d = dropped.details
    assert d["grad_norm"] > 1e5 and d["grad_norm"] == pytest.approx(d["scale"] * d["grad_norm_unscaled"], rel=1e-6)
    assert dropped.message == (
        f"At step 3: the GradScaler found in the calling code (scale {d['scale']:g}) did not step this optimizer "
        f"(scaler.step(optimizer) did not run): dropped from the next step on; step 3's gradient norm read "
        f"{d['grad_norm']:.4g} (read as {d['grad_norm_unscaled']:.4g} at that step). If this model's loss is "
        "scaled, pass its GradScaler as monitor_training_step(..., scaler=scaler)."
    )
    # a disabled scaler passed as scaler= is the user's answer: nothing is looked for, step 3 told as it is
    tdbg = _fp32_beside_an_fp16_model(tmp_path / "passed", passed=torch.amp.GradScaler("cpu", enabled=False))
    assert [a.kind for a in tdbg.report().anomalies if a.kind == "grad_scaler_not_given"] == []
    assert [a.step for a in tdbg.report().anomalies if a.kind == "gradient_explosion"] == [3, 4, 7]


def _loop_keeping_a_batch(tmp_path, gone):
    """Four steps, each with a 4 MB local (a batch) deleted by the loop after its monitor call; step 0's gradients
    x 1e6 (the scaler search runs, and finds none). ``gone``: called at each step after the delete."""
    import weakref

    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")  # not in use (no loss scaled): not taken
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), log_level="error"))
    for step in range(4):
        batch = torch.randn(1_000_000)
        ref = weakref.ref(batch)
        loss = (model(batch[:64].view(16, 4)) ** 2).mean()
        loss.backward()
        if step == 0:
            for p in model.parameters():
                p.grad.mul_(1e6)
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        optimizer.step()
        optimizer.zero_grad()
        del batch, loss
        gone(step, ref)
    tdbg.close()
    del scaler


def test_the_search_keeps_no_local_of_the_calling_code_alive(tmp_path):
    # before (Python 3.11/3.12): reading frame.f_locals stored a snapshot of the loop's locals on its frame, so the
    # batch of the step searched stayed alive after the loop deleted it, until the loop returned
    import gc

    alive = []

    def gone(step, ref):
        gc.collect()
        alive.append(ref() is not None)

    _loop_keeping_a_batch(tmp_path, gone)
    assert alive == [False, False, False, False]
