"""A GradScaler the script uses but does not pass to ``monitor_training_step`` (a plain loop, no Accelerate):
found at the optimizer's first step that looks scaled, confirmed by its ``scaler.step`` of that optimizer, then
read as if passed, with one ``scaler_not_passed`` warning (``training.step.found_scaler``). Before, the scaled
gradients read as they were: each overflow the scaler skips a ``nonfinite`` error (policy ``raise`` stopped a
healthy run at step 0), no skip counted. A scaler not confirmed (a stale one alive in the process, another
optimizer's) changes nothing but when the held step's verdict is given: at the next monitored step.

Each test freezes the objects alive before it (``only_the_tests_objects``): the scaler search walks the
garbage collector's list, which then holds the test's own scalers only."""

import math

import pytest
import torch

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.record import load_run
from diffusion_debug.record.run_dir import rebuild_summary

pytestmark = [
    pytest.mark.usefixtures("only_the_tests_objects"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning"),
]


def _model(seed: int = 0, width: int = 32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))


def _fp16_loop(config, pass_scaler: bool, steps: int = 10, watched: bool = True, applied: bool = False):
    """Autocast fp16 (on the CPU) and a GradScaler at 65536: its first steps overflow and are skipped while
    the scale falls. The step given: the call's index, or (``applied``) the count of optimizer steps the scaler
    applied, which stays while it skips (the first calls all step 0). Returns each step's monitored result, the
    scale at each step, the weights, the debugger."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0)
    tdbg = TrainingDebugger(model, config=config) if watched else None
    data = torch.Generator().manual_seed(1)
    results, scales, taken = [], [], 0
    for call in range(steps):
        x = torch.randn(16, 8, generator=data) * 4
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (model(x) - 3).square().mean()
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        if tdbg is not None:
            passed, step = scaler if pass_scaler else None, taken if applied else call
            results.append(tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, scaler=passed))
        scales.append(float(scaler.get_scale()))
        scaler.step(optimizer)
        scaler.update()
        taken += scaler.get_scale() >= scales[-1]  # a skip lowers the scale: the count stays
    if tdbg is not None:
        tdbg.close()
    return results, scales, [p.detach().clone() for p in model.parameters()], tdbg


def _read(anomalies) -> list[tuple[str, object, str]]:
    return sorted((a.kind, a.step, a.severity) for a in anomalies)


def test_a_scaler_not_passed_reads_as_passed_with_one_warning(tmp_path):
    """The loop's 3 skipped steps counted (the scale 65536 -> 8192), no ``nonfinite`` error, no explosion, no
    ``lr_spike``; every anomaly and every norm from step 1 on those of the run that passes its scaler, plus one
    ``scaler_not_passed`` at step 0, the headline. Weights bitwise those of the loop without the debugger.
    Before: 3 ``nonfinite`` errors, no skip counted."""
    *_, plain, _ = _fp16_loop(None, False, watched=False)
    passed, scales, _, passing = _fp16_loop(DebugConfig(output_dir=str(tmp_path / "passed")), True)
    found, _, weights, tdbg = _fp16_loop(DebugConfig(output_dir=str(tmp_path / "found")), False)
    assert all(torch.equal(a, b) for a, b in zip(weights, plain))
    skips = sum(after < before for before, after in zip(scales, scales[1:]))
    assert skips == 3
    anomalies = tdbg.report().anomalies
    assert [a for a in anomalies if a.severity == "error" or a.kind in ("gradient_explosion", "lr_spike")] == []
    assert _read(a for a in anomalies if a.kind != "scaler_not_passed") == _read(passing.report().anomalies)
    warned = [a for a in anomalies if a.kind == "scaler_not_passed"]
    assert [(a.step, a.severity, a.details["grad_scale"]) for a in warned] == [(0, "warning", 65536.0)]
    assert warned[0].message == (
        "A GradScaler (scale 6.554e+04) stepped the optimizer of step 0 but was not passed to "
        "monitor_training_step: its gradients were 6.554e+04x their size and each overflow it skips read as a NaN "
        "error; read unscaled from this step on. Pass it: monitor_training_step(loss, optimizer=optimizer, "
        "scaler=scaler)."
    )
    summary = tdbg.get_summary()
    assert tdbg.report().summary["headline"]["kind"] == "scaler_not_passed"
    assert summary["skipped_steps"] == passing.get_summary()["skipped_steps"] == skips
    assert [r["grad_norm"] for r in found[1:]] == [r["grad_norm"] for r in passed[1:]]


def test_policy_raise_does_not_stop_a_healthy_run_whose_scaler_was_not_passed(tmp_path):
    """Before: its step 0's overflow was a ``nonfinite`` error that policy ``raise`` raised at."""
    results, *_, tdbg = _fp16_loop(DebugConfig(output_dir=str(tmp_path), policy="raise"), False)
    assert len(results) == 10 and not tdbg.should_stop
    assert [a.kind for a in tdbg.report().anomalies if a.severity == "error"] == []


def _gan(config, pass_scaler: bool, iterations: int = 4):
    """A GAN in fp16 whose two optimizers one GradScaler steps (``scaler.update()`` once an iteration)."""
    generator, critic = _model(0, 16), _model(1, 16)
    generator[2] = torch.nn.Linear(16, 8)
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-4)
    opt_d = torch.optim.Adam(critic.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0)
    tdbg = TrainingDebugger({"generator": generator, "critic": critic}, config=config)
    data = torch.Generator().manual_seed(1)
    results = []
    for it in range(iterations):
        real, noise = torch.randn(16, 8, generator=data) + 2, torch.randn(16, 8, generator=data)
        passed = scaler if pass_scaler else None
        with torch.autocast("cpu", dtype=torch.float16):
            fake = generator(noise)
            loss_d = torch.nn.functional.softplus(-critic(real)).mean() + critic(fake.detach()).mean()
        opt_d.zero_grad()
        scaler.scale(loss_d).backward()
        results.append(tdbg.monitor_training_step(loss_d, optimizer=opt_d, step=2 * it, scaler=passed))
        scaler.step(opt_d)
        with torch.autocast("cpu", dtype=torch.float16):
            loss_g = torch.nn.functional.softplus(-critic(fake)).mean()
        opt_g.zero_grad()
        scaler.scale(loss_g).backward()
        results.append(tdbg.monitor_training_step(loss_g, optimizer=opt_g, step=2 * it + 1, scaler=passed))
        scaler.step(opt_g)
        scaler.update()
    tdbg.close()
    return results, tdbg


def test_a_gan_whose_one_scaler_steps_both_optimizers(tmp_path):
    """Each optimizer's scaler found and confirmed in turn (the critic's at step 0, the generator's at step 1):
    norms from step 2 on those of the run that passes it, one warning, no error or explosion, the one skipped
    update counted once (named at the critic's step 0, the first it skipped; a scaler passed names the step
    before the update, 1). Before: ``nonfinite`` errors at steps 0 and 1, no skip counted."""
    passed, passing = _gan(DebugConfig(output_dir=str(tmp_path / "passed")), True)
    found, tdbg = _gan(DebugConfig(output_dir=str(tmp_path / "found")), False)
    anomalies = tdbg.report().anomalies
    assert [(a.kind, a.step) for a in anomalies if a.kind == "scaler_not_passed"] == [("scaler_not_passed", 0)]
    assert [a for a in anomalies if a.severity == "error" or a.kind == "gradient_explosion"] == []
    expected = _read(passing.report().anomalies)
    assert _read(a for a in anomalies if a.kind != "scaler_not_passed") == sorted(
        (kind, 0 if kind == "skipped_step" else step, severity) for kind, step, severity in expected
    )
    assert tdbg.get_summary()["skipped_steps"] == passing.get_summary()["skipped_steps"] == 1
    assert [r["grad_norm"] for r in found[2:]] == [r["grad_norm"] for r in passed[2:]]


def test_a_critic_whose_unscaled_norm_explodes_is_still_named(tmp_path):
    """fp32 gradients scaled by 65536 (no overflow), a critic whose own norm passes the threshold at step 0: its
    ``gradient_explosion`` named at step 0 with the unscaled norm (the naive norm over the scale), after the
    warning; the later steps' norms unscaled. Before: every step an explosion of the scaled norm."""
    critic = _model(2)
    optimizer = torch.optim.SGD(critic.parameters(), lr=1e-9)
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0)
    tdbg = TrainingDebugger(critic, config=DebugConfig(output_dir=str(tmp_path)))
    data, naive, measured = torch.Generator().manual_seed(3), [], []
    for step in range(3):
        loss = critic(torch.randn(16, 8, generator=data)).mean() * (2e4 if step == 0 else 1.0)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        naive.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in critic.parameters()]))))
        measured.append(tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)["grad_norm"])
        scaler.step(optimizer)
        scaler.update()
    tdbg.close()
    anomalies = tdbg.report().anomalies
    assert sorted((a.kind, a.step) for a in anomalies) == [("gradient_explosion", 0), ("scaler_not_passed", 0)]
    anomalies = sorted(anomalies, key=lambda a: a.kind)
    assert anomalies[0].details["grad_norm"] == pytest.approx(naive[0] / 65536.0, rel=1e-6)
    assert anomalies[0].details["grad_norm"] > 1e3
    assert measured[1:] == pytest.approx([n / 65536.0 for n in naive[1:]], rel=1e-6)
    # the held step's recorded row unscaled once confirmed: the kept row and the streamed one (before: scaled)
    streamed = load_run(tdbg.report().save(html=False)).steps
    for row in (tdbg.report().steps[0], streamed[0]):
        assert (row["step"], row["grad_scale"]) == (0, 65536.0)
        assert row["grad_norm"] == pytest.approx(naive[0] / 65536.0, rel=1e-6)
    assert [r["grad_norm"] for r in streamed[1:]] == pytest.approx(measured[1:], rel=1e-12)


def test_the_held_steps_clipped_flag_is_read_from_its_unscaled_norm(tmp_path):
    """fp32 gradients scaled by 65536, ``max_grad_norm=100``: the script's own ``clip_grad_norm_`` (after
    ``unscale_``) does not clip step 0 (its norm ~8.9). The held row's ``grad_norm_clipped`` says so once its
    scaler is confirmed, in the kept row, the streamed one and a killed run's rebuilt summary (before: True, the
    flag of the scaled norm, and the rebuilt summary kept the scaled row)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0)
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path)))
    data, clipped, norms = torch.Generator().manual_seed(1), [], []
    for step in range(3):
        loss = (model(torch.randn(16, 8, generator=data)) - 3).square().mean()
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, max_grad_norm=100.0)
        scaler.unscale_(optimizer)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)))
        clipped.append(norms[-1] > 100.0)
        scaler.step(optimizer)
        scaler.update()
    assert clipped == [False, False, False] and 1.0 < norms[0] < 100.0
    run_dir = tdbg.report().save(html=False)
    tdbg.close()
    rebuilt = rebuild_summary(run_dir)["steps"]  # (from the events alone: as a killed run's is read)
    for rows in (tdbg.report().steps, load_run(run_dir).steps, rebuilt):
        assert [r["grad_norm_clipped"] for r in rows] == clipped
        assert rows[0]["grad_norm"] == pytest.approx(norms[0], rel=1e-6)
        assert rows[0]["grad_scale"] == 65536.0


def _fp32_run(config, explode_at: int | None = 3, nan_at: int = 5, steps: int = 8):
    """A plain fp32 loop (no scaler of its own) with a real explosion and a real NaN gradient: the monitor's
    results until the policy raised, and what it raised."""
    model = _model(4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    tdbg = TrainingDebugger(model, config=config)
    data, results = torch.Generator().manual_seed(5), []
    try:
        for step in range(steps):
            loss = (model(torch.randn(16, 8, generator=data)) - 1).square().mean()
            optimizer.zero_grad()
            loss.backward()
            if step == explode_at:
                model[0].weight.grad.mul_(1e6)
            if step == nan_at:
                model[2].weight.grad[0, 3] = math.nan
            results.append(tdbg.monitor_training_step(loss, optimizer=optimizer, step=step))
            optimizer.step()
    except Exception as error:
        return results, str(error).split(" (run directory")[0], tdbg
    finally:
        tdbg.close()
    return results, None, tdbg


def test_a_stale_scaler_alive_in_the_process_changes_no_verdict_of_an_fp32_run(tmp_path):
    """An earlier GradScaler, enabled and updated, still alive: the fp32 run's steps read clean before its
    explosion at step 3, so nothing is searched: the explosion named at step 3, the NaN at step 5 raised at step
    5 with main's error, no ``scaler_not_passed``. The same as the run with no scaler alive."""
    control, control_error, control_tdbg = _fp32_run(DebugConfig(output_dir=str(tmp_path / "c"), policy="raise"))
    earlier = _model(6)
    stale, old = torch.amp.GradScaler("cpu"), torch.optim.SGD(earlier.parameters(), lr=0.1)
    stale.scale(earlier(torch.ones(2, 8)).sum()).backward()
    stale.step(old)
    stale.update()
    results, error, tdbg = _fp32_run(DebugConfig(output_dir=str(tmp_path / "s"), policy="raise"))
    assert stale.is_enabled()  # alive until here
    assert len(results) == len(control) == 5 and control_error is not None
    assert error == control_error
    assert "step 5" in str(error)
    assert [r["grad_norm"] for r in results] == [r["grad_norm"] for r in control]
    assert _read(tdbg.report().anomalies) == _read(control_tdbg.report().anomalies)
    assert ("gradient_explosion", 3, "warning") in _read(tdbg.report().anomalies)
    assert "gradient_explosion" in results[3]["anomalies"]


def test_a_plain_optimizer_next_to_a_scaler_on_trial_for_another_is_read_as_it_is(tmp_path):
    """Two models: one in fp16 with a GradScaler not passed (on trial from its step 0), one plain fp32 whose
    real explosion comes at its step 0, monitored before the scaler steps: it is not searched while the other's
    trial stands, so its explosion is named at its own step, in its own result; the scaled one confirmed."""
    scaled, plain = _model(7), _model(8)
    opt_s, opt_p = torch.optim.SGD(scaled.parameters(), lr=1e-3), torch.optim.SGD(plain.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0)
    tdbg = TrainingDebugger({"scaled": scaled, "plain": plain}, config=DebugConfig(output_dir=str(tmp_path)))
    data, results = torch.Generator().manual_seed(9), []
    for it in range(3):
        x = torch.randn(16, 8, generator=data)
        with torch.autocast("cpu", dtype=torch.float16):
            loss_s = (scaled(x * 4) - 3).square().mean()
        loss_p = (plain(x) - 1).square().mean()
        opt_s.zero_grad()
        opt_p.zero_grad()
        scaler.scale(loss_s).backward()
        loss_p.backward()
        if it == 0:
            plain[0].weight.grad.mul_(1e6)
        results.append(tdbg.monitor_training_step(loss_s, optimizer=opt_s, step=2 * it))
        results.append(tdbg.monitor_training_step(loss_p, optimizer=opt_p, step=2 * it + 1))
        scaler.step(opt_s)
        opt_p.step()
        scaler.update()
    tdbg.close()
    assert "gradient_explosion" in results[1]["anomalies"]
    anomalies = tdbg.report().anomalies
    assert [(a.kind, a.step, a.component, a.module) for a in anomalies if a.kind == "gradient_explosion"] == [
        ("gradient_explosion", 1, "plain", "0")
    ]
    assert [(a.kind, a.step) for a in anomalies if a.kind == "scaler_not_passed"] == [("scaler_not_passed", 0)]
    assert [a for a in anomalies if a.severity == "error"] == []


def test_a_nan_at_the_first_suspicious_step_with_a_stale_scaler_is_raised_one_step_late(tmp_path):
    """The limit of the held verdict: a real NaN gradient at step 0, the optimizer's first, with a stale
    GradScaler alive: held while it is tried, dropped at the optimizer's next step (1), where the policy raises
    main's error, naming step 0. Main raises it at step 0, before ``optimizer.step()``; here that step applied
    the NaN first (its ``nonfinite_update`` follows)."""
    control, control_error, _ = _fp32_run(DebugConfig(output_dir=str(tmp_path / "c"), policy="raise"), None, 0)
    earlier = _model(6)
    stale, old = torch.amp.GradScaler("cpu"), torch.optim.SGD(earlier.parameters(), lr=0.1)
    stale.scale(earlier(torch.ones(2, 8)).sum()).backward()
    stale.step(old)
    stale.update()
    results, error, tdbg = _fp32_run(DebugConfig(output_dir=str(tmp_path / "s"), policy="raise"), None, 0)
    assert stale.is_enabled()
    assert (len(control), len(results)) == (0, 1)
    assert error == control_error and "step 0" in error
    assert results[0]["anomalies"] == []  # held
    errors = [(a.kind, a.step) for a in tdbg.report().anomalies if a.severity == "error"]
    assert errors[0] == ("nonfinite", 0) and ("nonfinite_update", 0) in errors


def test_a_held_step_released_at_a_step_with_anomalies_of_its_own_is_counted_as_its_own_step(tmp_path):
    """A real explosion at step 0 held while a stale GradScaler is tried, released (as read) at step 1, which has
    its own NaN gradient: two anomaly steps, one explosion, one NaN step, as the run with no scaler alive counts.
    Before: one anomaly step (the held step's anomalies counted with step 1's)."""
    config = DebugConfig(output_dir=str(tmp_path / "c"))
    *_, control = _fp32_run(config, explode_at=0, nan_at=1, steps=2)
    earlier = _model(6)
    stale, old = torch.amp.GradScaler("cpu"), torch.optim.SGD(earlier.parameters(), lr=0.1)
    stale.scale(earlier(torch.ones(2, 8)).sum()).backward()
    stale.step(old)
    stale.update()
    results, _, tdbg = _fp32_run(config.replace(output_dir=str(tmp_path / "s")), explode_at=0, nan_at=1, steps=2)
    assert stale.is_enabled()
    assert results[0]["anomalies"] == [] and "gradient_explosion" in results[1]["anomalies"]  # held, then released
    counts = ("anomaly_steps", "gradient_explosions", "nonfinite_steps", "skipped_steps")
    summary, expected = tdbg.get_summary(), control.get_summary()
    assert [summary[k] for k in counts] == [expected[k] for k in counts] == [2, 1, 1, 0]


def test_a_run_closed_right_after_its_first_scaled_step_decides_the_trial_at_close(tmp_path):
    """One step: the held step's verdict is decided at close (its scaler.step and update ran): the warning and
    the skip, no error."""
    *_, tdbg = _fp16_loop(DebugConfig(output_dir=str(tmp_path)), False, steps=1)
    assert _read(tdbg.report().anomalies) == [
        ("nonfinite", 0, "info"),
        ("scaler_not_passed", 0, "warning"),
        ("skipped_step", 0, "info"),
    ]
    assert tdbg.get_summary()["skipped_steps"] == 1


def test_under_an_installed_registry_nothing_is_walked(tmp_path, monkeypatch):
    """Where ``launch``'s LiveObjects is installed (its patched ``GradScaler.scale`` passes the scalers), the
    search walks no heap: a scaler not passed reads as main reads it (a guard, which main passes too)."""
    import gc

    from diffusion_debug.training.judges.live_objects import LiveObjects

    walks = []
    get_objects = gc.get_objects
    monkeypatch.setattr(gc, "get_objects", lambda *a: walks.append(1) or get_objects(*a))
    with LiveObjects().install():
        *_, tdbg = _fp16_loop(DebugConfig(output_dir=str(tmp_path)), False, steps=2)
    assert walks == []
    anomalies = tdbg.report().anomalies
    assert ("nonfinite", 0, "error") in _read(anomalies)
    assert "scaler_not_passed" not in [a.kind for a in anomalies]


def _crashing_fp16_step(config, report: bool):
    """One fp16 step at 65536 (it overflows) whose script fails between the monitor and ``scaler.step``
    (``report``: it saves a report there first); the debugger closed in the script's ``finally``."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0)
    tdbg = TrainingDebugger(model, config=config)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)) * 4
    reported = None
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (model(x) - 3).square().mean()
        scaler.scale(loss).backward()
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=0)
        if report:
            reported = _read(tdbg.report().anomalies)
        raise RuntimeError("the script's own bug")
    except RuntimeError:
        pass
    finally:
        tdbg.close()
    return tdbg, reported, scaler


def test_a_crash_before_scaler_step_reports_the_held_step_as_read_said_maybe_scaled(tmp_path):
    """Closed before the scaler was seen stepping the optimizer (the script failed in between, maybe for the NaN
    itself): the held step is reported as read, a real NaN never hidden, with one ``scaler_not_passed`` warning
    saying it may be scaled. (A first version reported only the warning: a stale scaler alive then turned a plain
    fp32 run's real NaN, the one that stopped the script, into a warning.)"""
    tdbg, _, scaler = _crashing_fp16_step(DebugConfig(output_dir=str(tmp_path)), report=False)
    anomalies = tdbg.report().anomalies
    assert sorted(_read(anomalies)) == [("nonfinite", 0, "error"), ("scaler_not_passed", 0, "warning")]
    (warning,) = [a for a in anomalies if a.kind == "scaler_not_passed"]
    assert warning.details["undecided"] == ["nonfinite"]
    assert warning.message == (
        "A GradScaler (scale 6.554e+04) alive but not passed to monitor_training_step was never seen stepping the "
        "optimizer of step 0 before the run closed: what that step read (nonfinite) is reported as read, though its "
        "gradients may have been 6.554e+04x their size. Pass the scaler: "
        "monitor_training_step(loss, optimizer=optimizer, scaler=scaler)."
    )
    summary = tdbg.get_summary()
    assert (summary["nonfinite_steps"], summary["skipped_steps"]) == (1, 0)
    assert float(scaler.get_scale()) == 65536.0  # the debugger stepped nothing


def test_a_report_before_scaler_step_leaves_the_trial_pending(tmp_path):
    """A report between the monitor and ``scaler.step`` lacks the held step (not yet decided) and does not
    decide it: the run's read is then the one without the report (the warning, the skips, no error). Before:
    the report read the held step as it was, a ``nonfinite`` error at step 0 and its skip lost."""
    *_, control = _fp16_loop(DebugConfig(output_dir=str(tmp_path / "c")), False, steps=4)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0)
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path / "r")))
    data, reported = torch.Generator().manual_seed(1), None
    for step in range(4):
        x = torch.randn(16, 8, generator=data) * 4
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (model(x) - 3).square().mean()
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        if step == 0:
            reported = _read(tdbg.report().anomalies)
        scaler.step(optimizer)
        scaler.update()
    tdbg.close()
    assert reported == []
    assert _read(tdbg.report().anomalies) == _read(control.report().anomalies)
    assert ("scaler_not_passed", 0, "warning") in _read(control.report().anomalies)
    assert tdbg.get_summary()["skipped_steps"] == control.get_summary()["skipped_steps"] == 3


@pytest.mark.parametrize("fault", ["explosion", "nan"])
def test_a_held_step_released_at_close_is_counted_as_a_step_is(tmp_path, fault):
    """A one-step fp32 run with a stale scaler alive: its held step, released at close as read, counts its
    explosion or NaN step as the run with no scaler alive does (before: only its anomaly step)."""
    explode_at, nan_at = (0, 99) if fault == "explosion" else (None, 0)
    *_, control = _fp32_run(DebugConfig(output_dir=str(tmp_path / "c")), explode_at, nan_at, steps=1)
    earlier = _model(6)
    stale, old = torch.amp.GradScaler("cpu"), torch.optim.SGD(earlier.parameters(), lr=0.1)
    stale.scale(earlier(torch.ones(2, 8)).sum()).backward()
    stale.step(old)
    stale.update()
    results, _, tdbg = _fp32_run(DebugConfig(output_dir=str(tmp_path / "s")), explode_at, nan_at, steps=1)
    assert results[0]["anomalies"] == []  # held
    keys = ("anomaly_steps", "gradient_explosions", "nonfinite_steps")
    counts = {k: tdbg.get_summary()[k] for k in keys}
    assert counts == {k: control.get_summary()[k] for k in keys}
    assert counts == (
        {**dict.fromkeys(keys, 1), "nonfinite_steps": 0}
        if fault == "explosion"
        else {**dict.fromkeys(keys, 1), "gradient_explosions": 0}
    )
    assert _read(tdbg.report().anomalies) == _read(control.report().anomalies)


def test_an_optimizer_not_weakly_referable_is_not_searched():
    """A ``__slots__`` optimizer without ``__weakref__``: read clean, searched, asked for its scaler, none
    raises (before: ``clean`` raised the WeakKeyDictionary's TypeError out of the monitored step)."""
    from diffusion_debug.training.step.found_scaler import FoundScalers

    class Slotted:
        __slots__ = ("param_groups",)

    scaler = torch.amp.GradScaler("cpu")  # an enabled scaler alive: hold would try it
    scaler.scale(torch.ones((), requires_grad=True))
    found, optimizer = FoundScalers(1e3, 1.0), Slotted()
    found.clean(optimizer)
    assert found.hold(optimizer, 0, []) is False and found.trial is None
    assert found.scaler_for(optimizer) is None


def test_a_stale_scaler_that_stepped_an_optimizer_at_a_reused_id_confirms_nothing(tmp_path):
    """A stale scaler whose state says it stepped the optimizer at this id (an earlier run stopped between
    ``scaler.step`` and ``update``; the id reused): not tried, so the fp32 run's real NaN at step 0 is raised
    at step 0 as with no scaler alive (before: confirmed, the NaN read as a scaler's overflow, an info)."""
    control, control_error, _ = _fp32_run(DebugConfig(output_dir=str(tmp_path / "c"), policy="raise"), None, 0)
    earlier = _model(6)
    stale, old = torch.amp.GradScaler("cpu"), torch.optim.SGD(earlier.parameters(), lr=0.1)
    stale.scale(earlier(torch.ones(2, 8)).sum()).backward()
    stale.step(old)  # no update(): its state for `old` says STEPPED
    model = _model(4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    stale._per_optimizer_states[id(optimizer)] = stale._per_optimizer_states[id(old)]  # as at a reused id
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path / "s"), policy="raise"))
    loss = (model(torch.randn(16, 8, generator=torch.Generator().manual_seed(5))) - 1).square().mean()
    loss.backward()
    model[2].weight.grad[0, 3] = math.nan
    with pytest.raises(Exception) as raised:
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=0)
    tdbg.close()
    assert str(raised.value).split(" (run directory")[0] == control_error
    assert "scaler_not_passed" not in [a.kind for a in tdbg.report().anomalies]


def test_a_report_after_the_optimizer_stepped_alone_reads_the_held_step_as_it_is(tmp_path):
    """A stale scaler alive, a plain fp32 NaN gradient at step 0, ``optimizer.step()`` run (no scaler stepped it:
    the step was unscaled), then a report with no monitored step after: the report has the NaN error as a run with
    no scaler alive has it (a first version left the trial pending there: a report and no close lost the error)."""
    reads = []
    for alive in (False, True):
        earlier = _model(6)
        stale, old = torch.amp.GradScaler("cpu"), torch.optim.SGD(earlier.parameters(), lr=0.1)
        if alive:
            stale.scale(earlier(torch.ones(2, 8)).sum()).backward()
            stale.step(old)
            stale.update()
        model = _model(4)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path / str(alive))))
        loss = (model(torch.randn(16, 8, generator=torch.Generator().manual_seed(5))) - 1).square().mean()
        loss.backward()
        model[2].weight.grad[0, 3] = math.nan
        held = tdbg.monitor_training_step(loss, optimizer=optimizer, step=0)["anomalies"]
        optimizer.step()
        reads.append((held, _read(tdbg.report().anomalies)))
        tdbg.close()
        assert stale.is_enabled()
    (plain_held, plain), (stale_held, with_stale) = reads
    assert (plain_held, stale_held) == (["nonfinite"], [])  # held where the stale scaler was alive
    assert with_stale == plain and ("nonfinite", 0, "error") in plain
