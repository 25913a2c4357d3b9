import copy
import json
import math
import sys
import types
import warnings

import pytest
import torch
from torch import nn

from diffusion_debug import DebugConfig, DiffusionDebugError, TrainingDebugger
from diffusion_debug.errors import ConfigError
from diffusion_debug.record import KINDS, load_json, load_run, read_jsonl
from diffusion_debug.report.columns import TRAINING_STEP_COLUMNS


def _batch(generator, n=16):
    x = torch.randn(n, 4, generator=generator)
    return x, torch.sin(x).sum(1, keepdim=True)


def _train(model, tdbg, steps, *, lr=0.05, plant=None, optimizer=None, timesteps=False):
    """A plain loop; ``plant(step, model, optimizer)`` runs after backward (before monitoring)."""
    generator = torch.Generator().manual_seed(1)
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=lr)
    infos = []
    for step in range(steps):
        x, y = _batch(generator)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        if plant is not None:
            plant(step, model, optimizer)
        t = torch.randint(0, 1000, (x.shape[0],), generator=generator) if timesteps else None
        infos.append(tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, timesteps=t))
        optimizer.step()
        optimizer.zero_grad()
    return infos


def _nan_bias_grad(*steps, index=0):
    """A ``plant`` that writes NaN into the first layer's bias gradient at ``steps``."""

    def plant(step, model, optimizer):
        if step in steps:
            model[0].bias.grad[index] = float("nan")

    return plant


def _serious(report):
    return [a for a in report.anomalies if a.severity in ("warning", "error")]


def test_planted_nan_gradient_names_parameter_module_and_step(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    _train(mlp, tdbg, 8, plant=_nan_bias_grad(7, index=3))
    (first,) = [a for a in tdbg.report().anomalies if a.kind == "nonfinite"]
    assert (first.step, first.parameter, first.module, first.severity) == (7, "0.bias", "0", "error")
    assert first.details["parameters"] == ["0.bias"]
    assert first.component == "model" and first.rank == 0


def test_nonfinite_gradients_of_several_layers_name_the_last_in_forward_order(mlp, tmp_path):
    # NaN in both layers' gradients under a finite loss: a NaN made in a layer's backward reaches
    # every layer before it, so the message names the last in forward order ("2": where backward made
    # it), not the first ("0"), which a NaN made anywhere downstream reaches too.
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))

    def plant(step, model, optimizer):
        if step == 1:
            model[0].weight.grad[0, 0] = float("nan")
            model[2].weight.grad[0, 0] = float("inf")

    _train(mlp, tdbg, 2, plant=plant)
    (a,) = [a for a in tdbg.report().anomalies if a.kind == "nonfinite"]
    assert a.parameter == "2.weight" and a.details["order"] == "last_in_forward"
    assert sorted(a.details["parameters"]) == ["0.weight", "2.weight"]
    assert "made in backward at 2.weight in module 2, the last in forward order of those that hold" in a.message


def test_learning_rate_spike_flags_the_next_step(mlp, tmp_path):
    config = DebugConfig(output_dir=str(tmp_path), loss_spike_window=20, grad_explosion_threshold=100.0)
    tdbg = TrainingDebugger(mlp, config=config)

    def plant(step, model, optimizer):
        if step == 25:  # this step's optimizer.step() uses the huge rate; step 26 sees the result
            optimizer.param_groups[0]["lr"] = 500.0

    _train(mlp, tdbg, 28, plant=plant)
    anomalies = tdbg.report().anomalies
    spikes = sorted(a.step for a in anomalies if a.kind == "loss_spike")
    explosions = sorted(a.step for a in anomalies if a.kind == "gradient_explosion")
    assert spikes and spikes[0] == 26
    assert explosions and explosions[0] == 26
    # the cause has its own anomaly, at its own step, before the loss reacts
    (lr,) = [a for a in anomalies if a.kind == "lr_spike" and a.details["reason"] == "lr_jump"]
    assert (lr.step, lr.details["lr"]) == (25, 500.0)
    assert min(a.step for a in anomalies if a.kind == "lr_spike") == 25
    summary = tdbg.get_summary()
    assert summary["total_steps"] == 28
    # repeats on consecutive steps fold into one anomaly; the summary counts steps
    assert summary["loss_anomalies"] == sum(
        a.details["count"] for a in anomalies if a.kind in ("loss_spike", "nonfinite_loss")
    )
    assert summary["gradient_explosion_rate"] == summary["gradient_explosions"] / 28


def test_clean_run_of_50_steps_has_no_anomalies(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    _train(mlp, tdbg, 50, optimizer=torch.optim.Adam(mlp.parameters(), lr=1e-3), timesteps=True)
    report = tdbg.report()
    assert _serious(report) == []
    summary = tdbg.get_summary()
    assert summary["total_steps"] == 50
    assert summary["anomaly_steps"] == summary["loss_anomalies"] == summary["skipped_steps"] == 0
    assert summary["anomaly_rate"] == 0.0
    buckets = report.components["model"]["loss_by_timestep_bucket"]
    assert sum(b["count"] for b in buckets) == 50 * 16 and len(buckets) == 10


def test_the_old_summary_name_warns_and_answers_the_same(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    _train(mlp, tdbg, 3)
    with pytest.warns(DeprecationWarning, match=r"get_training_summary\(\) is now get_summary\(\)"):
        old = tdbg.get_training_summary()
    assert old == tdbg.get_summary() and old["total_steps"] == 3


def test_per_module_norms_equal_naive_reference(tmp_path):
    from diffusion_debug.testing import tiny_pipeline

    unet = tiny_pipeline("sd").unet.train()
    tdbg = TrainingDebugger(unet, config=DebugConfig(output_dir=str(tmp_path), level="advanced"))
    torch.manual_seed(0)
    sample = torch.randn(2, unet.config.in_channels, 16, 16)
    text = torch.randn(2, 4, unet.config.cross_attention_dim)
    out = unet(sample, torch.tensor([10, 500]), text).sample
    loss = out.pow(2).mean()
    loss.backward()
    info = tdbg.monitor_training_step(loss, step=0)
    squares: dict[str, float] = {}
    for name, p in unet.named_parameters():
        module = name.rpartition(".")[0]
        norm = torch.linalg.vector_norm(p.grad.double()).item() if p.grad is not None else 0.0
        squares[module] = squares.get(module, 0.0) + norm**2
    reference = {m: math.sqrt(v) for m, v in squares.items()}
    assert info["module_grad_norms"].keys() == reference.keys()
    for module, value in reference.items():
        assert info["module_grad_norms"][module] == pytest.approx(value, rel=1e-5, abs=1e-12)
    assert info["grad_norm"] == pytest.approx(math.sqrt(sum(squares.values())), rel=1e-5)
    assert info["loss"] == pytest.approx(loss.item())


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__()
        self.base = base
        self.lora_down = nn.Linear(base.in_features, rank, bias=False)
        self.lora_up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.lora_up.weight, std=0.01)

    def forward(self, x):
        return self.base(x) + self.lora_up(self.lora_down(x))


def test_lora_on_frozen_unet_reports_only_adapters(tmp_path):
    from diffusion_debug.testing import tiny_pipeline

    unet = tiny_pipeline("sd").unet.train()
    unet.requires_grad_(False)
    wrapped = []
    for name, module in list(unet.named_modules()):
        if name.endswith("attn1"):
            module.to_q = LoRALinear(module.to_q)
            wrapped.append(name)
    assert wrapped
    tdbg = TrainingDebugger(unet, config=DebugConfig(output_dir=str(tmp_path)))
    torch.manual_seed(0)
    out = unet(
        torch.randn(1, unet.config.in_channels, 16, 16),
        torch.tensor([3]),
        torch.randn(1, 4, unet.config.cross_attention_dim),
    ).sample
    loss = out.pow(2).mean()
    loss.backward()
    info = tdbg.monitor_training_step(loss, step=0)
    expected = {f"{n}.to_q.lora_{part}" for n in wrapped for part in ("down", "up")}
    assert set(info["module_grad_norms"]) == expected
    assert tdbg.report().components["model"]["trainable_tensors"] == 2 * len(wrapped)


def test_gradient_accumulation_reads_accumulated_gradients_once_per_4(mlp, tmp_path, fresh_accelerate_state):
    from accelerate import Accelerator

    reference = copy.deepcopy(mlp)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(mlp, optimizer)
    tdbg = TrainingDebugger(model, accelerator=accelerator, config=DebugConfig(output_dir=str(tmp_path)))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(3)
    batches = [_batch(generator, 8) for _ in range(8)]
    read, expected = [], []
    for i, (x, y) in enumerate(batches):
        with accelerator.accumulate(model):
            loss = ((model(x) - y) ** 2).mean()
            accelerator.backward(loss)
            info = tdbg.monitor_training_step(loss, optimizer=optimizer, step=i // 4)
            optimizer.step()
            optimizer.zero_grad()
        read.append(info["gradients_read"])
        if info["gradients_read"]:
            # naive reference: sum of loss/4 gradients over the 4 micro-batches, by hand
            ref_opt.zero_grad()
            micro = batches[i - 3 : i + 1]
            for xr, yr in micro:
                (((reference(xr) - yr) ** 2).mean() / 4).backward()
            ref_norms = {
                m: torch.linalg.vector_norm(
                    torch.cat(
                        [p.grad.reshape(-1) for n, p in reference.named_parameters() if n.rpartition(".")[0] == m]
                    )
                ).item()
                for m in ("0", "2")
            }
            expected.append(
                (
                    info["module_grad_norms"],
                    ref_norms,
                    info["loss"],
                    sum(((reference(xr) - yr) ** 2).mean().item() for xr, yr in micro) / 4,
                )
            )
            ref_opt.step()
    assert read == [False, False, False, True] * 2
    assert tdbg.get_summary()["total_steps"] == 2
    assert tdbg.get_summary()["micro_steps"] == 6
    # 8 calls: 2 that ended an optimizer step, 6 that only accumulated (the name says so)
    assert tdbg.get_summary()["accumulating_micro_steps"] == 6 == len(read) - read.count(True)
    for got, want, loss_got, loss_want in expected:
        for module in want:
            assert got[module] == pytest.approx(want[module], rel=1e-5)
        assert loss_got == pytest.approx(loss_want, rel=1e-5)


def test_gradscaler_overflow_is_a_skipped_step(mlp, tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.01)
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    generator = torch.Generator().manual_seed(0)
    norms = []
    for step in range(6):
        x, y = _batch(generator)
        loss = ((mlp(x) - y) ** 2).mean()
        scaler.scale(loss).backward()
        true_norm = (
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in mlp.parameters()])).item()
            / scaler.get_scale()
        )
        if step == 3:
            mlp[2].weight.grad[0, 1] = float("inf")
        info = tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, scaler=scaler)
        norms.append((info["grad_norm"], true_norm))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    anomalies = tdbg.report().anomalies
    skipped = [a for a in anomalies if a.kind == "skipped_step"]
    assert [a.step for a in skipped] == [3]
    assert skipped[0].details["scale_before"] == 1024.0 and skipped[0].details["scale_after"] == 512.0
    nonfinite = [a for a in anomalies if a.kind == "nonfinite"]
    assert [(a.step, a.severity, a.parameter) for a in nonfinite] == [(3, "info", "2.weight")]
    assert tdbg.get_summary()["skipped_steps"] == 1
    for step, (got, want) in enumerate(norms):
        if step != 3:
            assert got == pytest.approx(want, rel=1e-5)  # read unscaled, the scaler untouched


def test_a_step_the_grad_scaler_skipped_says_so_in_its_row_and_the_last_one_is_found_at_close(mlp, tmp_path):
    # a real GradScaler skips steps 2 and 5 (an inf planted in a gradient): it calls no optimizer.step, so no
    # step hook fires; its lowered scale shows at the next step, or for the last step when the debugger closes
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.01)
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    generator, fired, hook_ran = torch.Generator().manual_seed(0), [], []
    optimizer.register_step_post_hook(lambda *_: fired.append(True))
    for step in range(6):
        x, y = _batch(generator)
        loss = ((mlp(x) - y) ** 2).mean()
        scaler.scale(loss).backward()
        if step in (2, 5):
            mlp[2].weight.grad[0, 1] = float("inf")
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, scaler=scaler)
        before = len(fired)
        scaler.step(optimizer)
        scaler.update()
        hook_ran.append(len(fired) > before)
        optimizer.zero_grad()
    tdbg.close()
    assert hook_ran == [True, True, False, True, True, False]
    skipped = [a for a in tdbg.report().anomalies if a.kind == "skipped_step"]
    assert [(a.step, a.details["detected_at_step"], a.details["scale_after"]) for a in skipped] == [
        (2, 3, 512.0),
        (5, "close", 256.0),
    ]
    summary = tdbg.get_summary()
    assert (summary["skipped_steps"], summary["skipped_by_scaler"]) == (2, 2)
    run_dir = tdbg.report().save()
    rows = load_run(run_dir).rank_steps  # from the event file: each row as streamed, with what came after
    assert [(row["step"], row.get("skipped")) for row in rows] == [
        (0, None),
        (1, None),
        (2, "grad_scaler"),
        (3, None),
        (4, None),
        (5, "grad_scaler"),
    ]
    assert [row.get("skipped") for row in load_json(run_dir / "summary.json")["steps"]] == [
        None,
        None,
        "grad_scaler",
        None,
        None,
        "grad_scaler",
    ]


def _skips(tdbg):
    """(step, detected_at_step) of each ``skipped_step`` in the report, and the summary's skip counts."""
    report = tdbg.report()
    skipped = [(a.step, a.details["detected_at_step"]) for a in report.anomalies if a.kind == "skipped_step"]
    training = report.summary["training"]
    assert training == tdbg.get_summary() | {"anomaly_counts": training["anomaly_counts"]}
    return skipped, training["skipped_steps"], training["anomaly_counts"].get("skipped_step", 0)


def test_a_report_without_close_sees_the_last_step_s_skip_once_and_the_run_may_go_on(mlp, tmp_path):
    # a real GradScaler skips steps 1 and 3 (an inf planted): a report taken after step 1's optimizer step (the
    # README's loops save report() at the end, no close) sees its skip, before the next step shows it; a report
    # between a monitor and its optimizer step sees nothing of that step; the run goes on; nothing counted twice
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.01)
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    generator, seen = torch.Generator().manual_seed(0), []
    for step in range(4):
        x, y = _batch(generator)
        scaler.scale(((mlp(x) - y) ** 2).mean()).backward()
        if step in (1, 3):
            mlp[2].weight.grad[0, 1] = float("inf")
        tdbg.monitor_training_step(torch.tensor(1.0), optimizer=optimizer, step=step, scaler=scaler)
        seen.append(_skips(tdbg))  # before the optimizer step: this step is not judged
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        seen.append(_skips(tdbg))
    assert seen == [
        ([], 0, 0),
        ([], 0, 0),
        ([], 0, 0),
        ([(1, "report")], 1, 1),  # step 1's skip, seen by a report before step 2 reads it
        ([(1, "report")], 1, 1),  # step 2 read the lowered scale: not again
        ([(1, "report")], 1, 1),
        ([(1, "report")], 1, 1),
        ([(1, "report"), (3, "report")], 2, 2),  # the last step's: the report a script saves at its end
    ]
    tdbg.close()
    assert _skips(tdbg) == ([(1, "report"), (3, "report")], 2, 2)  # close finds it judged
    rows = load_run(tdbg.report().save()).rank_steps
    assert [(row["step"], row.get("skipped")) for row in rows] == [
        (0, None),
        (1, "grad_scaler"),
        (2, None),
        (3, "grad_scaler"),
    ]


def test_a_report_records_the_skip_as_the_next_detail_step_would_and_leaves_to_it_one_it_did_not_see(mlp, tmp_path):
    # one process standing in for rank 0 of two: the detail step of step 1 found rank 1's own gradients overflowed
    # (history.overflowed, as its exchange sets it): a report's skip of step 1 names rank 1 as the next step's would;
    # a report that saw no skip of step 3 leaves it to step 4, which finds it (another rank's skip it brings: here
    # the scale lowered after the report) and records it
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.01)
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    generator, seen = torch.Generator().manual_seed(0), []
    for step in range(5):
        x, y = _batch(generator)
        scaler.scale(((mlp(x) - y) ** 2).mean()).backward()
        if step == 1:
            mlp[2].weight.grad[0, 1] = float("inf")
        tdbg.monitor_training_step(torch.tensor(1.0), optimizer=optimizer, step=step, scaler=scaler)
        if step == 1:
            tdbg._steps.history.overflowed = (1, [1])
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        seen.append(_skips(tdbg))
        if step == 3:
            scaler.update(new_scale=scaler.get_scale() / 2)
    assert seen[1:] == [([(1, "report")], 1, 1)] * 3 + [([(1, "report"), (3, 4)], 2, 2)]
    skipped = [a for a in tdbg.report().anomalies if a.kind == "skipped_step"]
    assert [a.details.get("overflow_ranks") for a in skipped] == [[1], None]
    assert "rank 1's own gradients overflowed" in skipped[0].message
    tdbg.close()


def test_the_summary_asked_during_a_step_counts_the_last_step_s_skip_as_before_and_after_it(mlp, tmp_path):
    # the live server asks get_summary() from its own thread at any moment: during step 2 (asked here as its
    # judging starts, after its measurement) step 1's skip, counted before step 2 and after it, is counted too
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.01)
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    judge, during = tdbg._steps._judge, []

    def judging(*args):
        during.append(tdbg.get_summary()["skipped_steps"])
        return judge(*args)

    tdbg._steps._judge = judging
    generator, before, after = torch.Generator().manual_seed(0), [], []
    for step in range(4):
        x, y = _batch(generator)
        scaler.scale(((mlp(x) - y) ** 2).mean()).backward()
        if step == 1:
            mlp[2].weight.grad[0, 1] = float("inf")
        before.append(tdbg.get_summary()["skipped_steps"])
        tdbg.monitor_training_step(torch.tensor(1.0), optimizer=optimizer, step=step, scaler=scaler)
        after.append(tdbg.get_summary()["skipped_steps"])
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    assert (before, during, after) == ([0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1])
    tdbg.close()


def test_fp16_accelerate_a_last_step_whose_optimizer_step_never_ran_is_not_skipped_by_the_stale_flag(
    mlp, tmp_path, fresh_accelerate_state
):
    # Accelerate's step_was_skipped is set at its optimizer step and kept until the next: a run that stops (a
    # policy, an error) between step 2's monitor and its optimizer step leaves step 1's True (a real skip, an inf
    # planted); the last step is judged only once its optimizer step ran (the GradScaler's update)
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    accelerator.native_amp, accelerator.scaler = True, torch.amp.GradScaler("cpu", init_scale=2.0**10)
    model, optimizer = accelerator.prepare(mlp, torch.optim.SGD(mlp.parameters(), lr=0.01))
    tdbg = TrainingDebugger(model, accelerator=accelerator, config=DebugConfig(output_dir=str(tmp_path)))
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        x, y = _batch(generator)
        accelerator.backward(((model(x) - y) ** 2).mean())
        if step == 1:
            mlp[2].weight.grad[0, 1] = float("inf")
        tdbg.monitor_training_step(torch.tensor(1.0), optimizer=optimizer, step=step)
        if step == 2:
            break  # stopped before the optimizer step
        optimizer.step()
        optimizer.zero_grad()
    assert optimizer.step_was_skipped and accelerator.scaler.get_scale() == 512.0  # step 1's, stale
    assert _skips(tdbg) == ([(1, 2)], 1, 1)
    tdbg.close()
    assert _skips(tdbg) == ([(1, 2)], 1, 1)


def _skipping_run(tmp_path, reports, overflowed=None):
    """Ten steps under a real GradScaler, an inf planted at steps 2, 4, 5 and 7 (the third and fourth skips within
    SKIP_WINDOW: warnings); the step given is the count of applied steps (a script counting only applied steps: a
    skipped step's number repeats). ``reports``: report() after each monitor and twice after each optimizer step.
    What the run recorded: its skips (what the report saw first aside), its summary, its rows' marks, what each
    step returned."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path)))
    generator, applied, infos = torch.Generator().manual_seed(0), 0, []
    for run in range(10):
        x, y = _batch(generator)
        scaler.scale(((model(x) - y) ** 2).mean()).backward()
        if run in (2, 4, 5, 7):
            model[2].weight.grad[0, 1] = float("inf")
        info = tdbg.monitor_training_step(torch.tensor(1.0), optimizer=optimizer, step=applied, scaler=scaler)
        infos.append((info["step"], info["anomalies"]))
        if reports:
            tdbg.report()
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        applied += scaler.get_scale() >= before
        if reports:
            tdbg.report(), tdbg.report()
    summary = tdbg.get_summary()
    tdbg.close()
    report = tdbg.report()
    skips = [
        {**a.to_dict(), "details": {k: v for k, v in a.details.items() if k != "detected_at_step"}}
        for a in report.anomalies
        if a.kind == "skipped_step"
    ]
    rows = [(row["step"], row.get("skipped")) for row in load_run(report.save()).rank_steps]
    return skips, summary, report.summary["training"], rows, infos


def test_reports_mid_run_change_nothing_the_run_records_counts_or_judges(tmp_path):
    # a report judges the last step's skip before the next step reads it: what the run records, counts (the
    # warning's anomaly step among them) and what each step returns are those of a run that never reports
    quiet = _skipping_run(tmp_path / "quiet", reports=False)
    reported = _skipping_run(tmp_path / "reported", reports=True)
    assert [(a["step"], a["severity"], a["details"]["count"]) for a in quiet[0]] == [
        (2, "info", 1),
        (3, "info", 2),  # steps 4 and 5 of the loop, both numbered 3: folded
        (4, "warning", 1),
    ]
    assert quiet[1]["skipped_steps"] == 4 and quiet[1]["anomaly_steps"] == 2
    assert reported == quiet


@pytest.mark.parametrize("growth_interval, warned", [(2000, []), (5, [32])])
def test_skips_while_the_scale_settles_or_now_and_then_are_info_and_frequent_ones_a_warning(
    tmp_path, growth_interval, warned
):
    # fp16 autocast on CPU, a scaler starting far too high: 10 skips while it settles, then one
    # per growth attempt (every 6 steps here, 20, 26, 32: 3 within 20 steps is frequent; every 2000: never)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=growth_interval)
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), stream_events=False))
    x = torch.randn(64, 8)
    for step in range(40):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        scaler.scale(loss).backward()
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, scaler=scaler)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    skipped = [a for a in tdbg.report().anomalies if a.kind == "skipped_step"]
    assert (skipped[0].step, skipped[0].severity, skipped[0].details["count"]) == (0, "info", 10)  # the settling
    assert [a.step for a in skipped if a.severity == "warning"] == warned
    assert [
        a for a in tdbg.report().anomalies if a.severity in ("warning", "error") and a.kind != "skipped_step"
    ] == []
    tdbg.close()


def test_finite_gradients_whose_norm_float32_cannot_sum_are_named_as_the_sum_s_overflow(mlp, tmp_path):
    # each parameter's gradient norm 1.2e19 (finite in float32), four of them: 2.4e19, past what float32
    # sums (its square passes 3.4e38); naive reference: clip_grad_norm_ reads inf, a float64 sum does not
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), stream_events=False))
    reference = {}

    def plant(step, model, optimizer):
        if step == 3:
            for p in model.parameters():
                p.grad.fill_(1.2e19 / math.sqrt(p.numel()))
            grads = [p.grad.clone() for p in model.parameters()]
            reference["float64"] = math.sqrt(sum(g.double().norm().item() ** 2 for g in grads))
            copies = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
            for c, g in zip(copies, grads):
                c.grad = g
            reference["clip_grad_norm_"] = torch.nn.utils.clip_grad_norm_(copies, 1.0).item()
            reference["clipped"] = torch.cat([c.grad.reshape(-1) for c in copies]).abs().max().item()

    _train(mlp, tdbg, 4, lr=1e-30, plant=plant)
    assert (reference["clip_grad_norm_"], reference["clipped"]) == (math.inf, 0.0)
    (a,) = [a for a in tdbg.report().anomalies if a.kind in ("gradient_explosion", "nonfinite")]
    assert (a.kind, a.step, a.details["sum_overflow"]) == ("gradient_explosion", 3, True)
    assert a.details["grad_norm"] == pytest.approx(reference["float64"], rel=1e-6)
    assert a.message.startswith(
        f"The global gradient norm is {reference['float64']:.4g}, past the largest norm float32 sums (1.845e+19) "
        "though every parameter's (and shard's) own norm is finite: their sum overflows float32, so clip_grad_norm_ "
        "reads it as inf and scales every gradient by 0"
    )
    tdbg.close()


def test_policy_skip_zeroes_gradients(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), policy="skip"))
    before = {}

    def plant(step, model, optimizer):
        if step == 2:
            model[0].weight.grad[0, 0] = float("nan")
            before.update({n: p.detach().clone() for n, p in model.named_parameters()})

    infos = _train(mlp, tdbg, 3, plant=plant)
    assert infos[2]["policy_action"] == "skip"
    for name, p in mlp.named_parameters():  # SGD without momentum: a zero gradient moves nothing
        assert torch.equal(p.detach(), before[name])
    assert tdbg.get_summary()["skipped_steps"] == 1


def test_policy_skip_is_refused_up_front_where_zeroing_cannot_reach_deepspeed_s_gradients(mlp, tmp_path, monkeypatch):
    # ZeRO-3 as the debugger finds it: each parameter marked by the engine (ds_id, its ZeRO-3
    # optimizer); a stand-in, as DeepSpeed runs only under torchrun (test_deepspeed.py)
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    for i, p in enumerate(mlp.parameters()):
        p.ds_id, p._z3_optimizer = i, object()
    with pytest.raises(ConfigError) as refused:
        TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), policy="skip"))
    assert str(refused.value) == (
        "policy 'skip' cannot zero this run's gradients (DeepSpeed ZeRO-3 lends the debugger a float32 copy of each "
        "gradient partition, not the one it applies): use policy 'stop', 'raise' or 'record'."
    )
    assert list(tmp_path.iterdir()) == []  # refused before the run directory
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), stream_events=False))
    with pytest.raises(ConfigError, match=r"^policy 'skip' cannot zero this run's gradients \(DeepSpeed ZeRO-3 "):
        tdbg.config = tdbg.config.replace(policy="skip")
    assert tdbg.config.policy == "record"
    tdbg.params.partitions.capture = True  # Accelerate's DeepSpeed plugin: the step ran inside backward
    with pytest.raises(ConfigError) as refused:
        tdbg.config = tdbg.config.replace(policy="skip")
    assert str(refused.value) == (
        "policy 'skip' cannot zero this run's gradients (Accelerate's DeepSpeed plugin runs the optimizer step "
        "inside accelerator.backward, before monitor_training_step, so the step's gradients are applied already): "
        "use policy 'stop', 'raise' or 'record'."
    )
    tdbg.close()


def test_policy_raise_saves_then_raises(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), policy="raise"))

    def plant(step, model, optimizer):
        if step == 1:
            model[2].bias.grad[0] = float("inf")

    with pytest.raises(DiffusionDebugError) as caught:
        _train(mlp, tdbg, 3, plant=plant)
    assert caught.value.anomaly.kind == "nonfinite" and caught.value.anomaly.step == 1
    summary = load_json(caught.value.run_dir / "summary.json")
    assert [a["parameter"] for a in summary["anomalies"]] == ["2.bias"]


def test_policy_warn_warns(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), policy="warn"))

    def plant(step, model, optimizer):
        if step == 1:
            model[2].bias.grad[0] = float("nan")

    with pytest.warns(RuntimeWarning, match="nonfinite"):
        _train(mlp, tdbg, 2, plant=plant)


def test_report_save_writes_strict_files(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    _train(mlp, tdbg, 4, plant=_nan_bias_grad(2))
    run_dir = tdbg.report().save()
    summary = load_json(run_dir / "summary.json")
    assert summary["training"]["total_steps"] == 4 and len(summary["steps"]) == 4
    events = read_jsonl(run_dir / "events.jsonl")
    assert [e["step"] for e in events if e["type"] == "step"] == [0, 1, 2, 3]
    assert (run_dir / "report.html").is_file()
    json.loads((run_dir / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(c))


def test_the_live_report_s_steps_are_the_loaded_run_s(mlp, tmp_path):
    """``report().steps`` is what ``load_run(...).steps`` reads back: the main process's own rows,
    one a step, though the record also holds rows another rank sent it (added here as the
    exchange of a two-rank step adds them; test_multiprocess checks it on a real launch), which
    summary.json keeps and ``rank_steps`` lists with them, by step then rank, as the loaded run's."""
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    _train(mlp, tdbg, 3)
    tdbg.record.add_rank_step({"step": 1, "rank": 1, "loss": 0.25})
    report = tdbg.report()
    assert [(s["step"], s["rank"]) for s in report.steps] == [(0, 0), (1, 0), (2, 0)]
    assert [(s["step"], s["rank"]) for s in report.rank_steps] == [(0, 0), (1, 0), (1, 1), (2, 0)]
    run = load_run(report.save(html=False))
    assert run.steps == report.steps and run.rank_steps == report.rank_steps
    assert [(s["step"], s["rank"]) for s in run.summary["steps"]] == [(0, 0), (1, 0), (1, 1), (2, 0)]
    tdbg.close()


def test_trackers_receive_scalars(mlp, tmp_path, fresh_accelerate_state):
    from accelerate import Accelerator
    from accelerate.tracking import GeneralTracker

    class ListTracker(GeneralTracker):
        name = "list"
        requires_logging_directory = False

        def __init__(self):
            super().__init__()
            self.rows = []

        @property
        def tracker(self):
            return self

        def store_init_configuration(self, values):
            pass

        def log(self, values, step=None, **kwargs):
            self.rows.append((step, dict(values)))

    tracker = ListTracker()
    accelerator = Accelerator(cpu=True, log_with=tracker)
    accelerator.init_trackers("t")
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(mlp, optimizer)
    tdbg = TrainingDebugger(model, accelerator=accelerator, config=DebugConfig(output_dir=str(tmp_path)))
    x, y = _batch(torch.Generator().manual_seed(0))
    loss = ((model(x) - y) ** 2).mean()
    accelerator.backward(loss)
    info = tdbg.monitor_training_step(loss, optimizer=optimizer, step=7)
    ((step, values),) = tracker.rows
    assert step == 7 and values["debug/loss"] == pytest.approx(info["loss"]) and values["debug/lr_group0"] == 0.01


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(model="not a model"), "torch.nn.Module"),
        (dict(accelerator=object()), "accelerate.Accelerator"),
        (dict(config="advanced"), "DebugConfig"),
    ],
)
def test_bad_input_is_a_clear_error_and_writes_nothing(mlp, tmp_path, kwargs, words):
    args = dict(model=mlp, config=DebugConfig(output_dir=str(tmp_path / "out")))
    args.update(kwargs)
    if "config" in kwargs:
        args["config"] = kwargs["config"]
    with pytest.raises(DiffusionDebugError, match=words):
        TrainingDebugger(args.pop("model"), **args)
    assert not (tmp_path / "out").exists()


def test_no_trainable_parameters_is_an_error(mlp, tmp_path):
    mlp.requires_grad_(False)
    with pytest.raises(DiffusionDebugError, match="no trainable parameters"):
        TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


def test_detach_removes_hooks(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    assert all(p._post_accumulate_grad_hooks for p in mlp.parameters())
    tdbg.detach()
    assert not any(p._post_accumulate_grad_hooks for p in mlp.parameters())


def test_repeats_on_consecutive_steps_fold_into_one_anomaly(mlp, tmp_path):
    # a NaN gradient at step 2 makes the weights NaN: every later loss is NaN
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    _train(mlp, tdbg, 12, plant=_nan_bias_grad(2))
    anomalies = tdbg.report().anomalies
    (loss,) = [a for a in anomalies if a.kind == "nonfinite_loss"]
    assert (loss.step, loss.details["count"], loss.details["last_step"]) == (3, 9, 11)
    assert len(anomalies) <= 4  # not one per step and kind
    summary = tdbg.get_summary()  # counts steps, not folded anomalies
    assert (summary["loss_anomalies"], summary["nonfinite_steps"], summary["anomaly_steps"]) == (9, 10, 10)
    run_dir = tdbg.report().save()
    saved = [a for a in load_json(run_dir / "summary.json")["anomalies"] if a["kind"] == "nonfinite_loss"]
    assert [(a["step"], a["details"]["count"], a["details"]["last_step"]) for a in saved] == [(3, 9, 11)]
    events = read_jsonl(run_dir / "events.jsonl")
    assert sum(e["type"] == "anomaly" and e["kind"] == "nonfinite_loss" for e in events) == 1
    repeats = [e for e in events if e["type"] == "anomaly_repeated" and e["kind"] == "nonfinite_loss"]
    assert [(e["step"], e["count"]) for e in repeats] == [(s, s - 2) for s in range(4, 12)]


def test_a_gap_starts_a_new_anomaly(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), policy="skip"))
    _train(mlp, tdbg, 6, plant=_nan_bias_grad(1, 2, 4))
    nonfinite = [a for a in tdbg.report().anomalies if a.kind == "nonfinite"]
    assert [(a.step, a.parameter, a.details["count"], a.details.get("last_step")) for a in nonfinite] == [
        (1, "0.bias", 2, 2),
        (4, "0.bias", 1, None),
    ]
    assert tdbg.get_summary()["nonfinite_steps"] == 3


def test_failed_measurement_is_recorded_and_not_a_nan_loss(mlp, tmp_path, monkeypatch):
    from diffusion_debug.training.measure import gradients

    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    original = gradients.grad_norms
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("planted")
        return original(*args, **kwargs)

    monkeypatch.setattr(gradients, "grad_norms", failing)
    infos = _train(mlp, tdbg, 5, timesteps=True)
    assert infos[2]["error"] == "RuntimeError('planted')" and not infos[2]["gradients_read"]
    (error,) = tdbg.report().anomalies
    assert (error.kind, error.step, error.rank, error.severity) == ("debugger_error", 2, 0, "warning")
    assert error.message.startswith("Rank 0 failed to measure step 2 (RuntimeError: planted) and training went on")
    summary = tdbg.get_summary()
    assert summary["total_steps"] == 5 and summary["loss_anomalies"] == summary["nonfinite_steps"] == 0
    buckets = tdbg.report().components["model"]["loss_by_timestep_bucket"]
    assert sum(b["count"] for b in buckets) == 4 * 16 and not any(b["nonfinite"] for b in buckets)
    assert math.isfinite(infos[3]["loss"]) and "error" not in infos[3]


def test_failed_measurement_raises_when_strict(mlp, tmp_path, monkeypatch):
    from diffusion_debug.training.measure import gradients

    def failing(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(gradients, "grad_norms", failing)
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), strict=True))
    with pytest.raises(RuntimeError, match="planted"):
        _train(mlp, tdbg, 1)
    # recorded once, as raised: not 'training went on; set strict=True to see the traceback'
    (error,) = [a for a in tdbg.report().anomalies if a.kind == "debugger_error"]
    assert (error.details["where"], error.details.get("raised")) == ("measurement", True)
    assert error.message == "The debugger's measurement failed (RuntimeError: planted) and was raised (strict=True)."
    tdbg.close()


def test_strict_records_once_a_failure_of_the_monitoring_call_itself(mlp, tmp_path):
    """``strict=True``: an error of ``monitor_training_step`` outside the step's own guards (here
    pacing the order hooks after the step) is raised and recorded once as a raised ``debugger_error``
    at ``monitoring`` (it was raised and recorded nowhere)."""
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), stream_events=False, strict=True))

    def failing():
        raise KeyError("planted")

    tdbg._pace_order_hooks = failing
    loss = mlp(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    with pytest.raises(KeyError, match="planted"):
        tdbg.monitor_training_step(loss, step=0)
    (error,) = [a for a in tdbg.report().anomalies if a.kind == "debugger_error"]
    assert (error.details["where"], error.step, error.details["raised"]) == ("monitoring", 0, True)
    assert error.message == "The debugger's monitoring failed (KeyError: 'planted') and was raised (strict=True)."
    tdbg.close()


def test_update_to_weight_ratio_equals_naive_reference(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), level="advanced"))
    optimizer = torch.optim.SGD(
        [{"params": mlp[0].parameters(), "lr": 0.1}, {"params": mlp[2].parameters(), "lr": 0.01}]
    )
    expected = []

    def plant(step, model, optimizer):
        ratios = {}
        for module, lr in (("0", 0.1), ("2", 0.01)):
            ps = list(model[int(module)].parameters())
            grad = math.sqrt(sum(torch.linalg.vector_norm(p.grad.double()).item() ** 2 for p in ps))
            weight = math.sqrt(sum(torch.linalg.vector_norm(p.double()).item() ** 2 for p in ps))
            ratios[module] = (lr, grad, weight)
        expected.append(ratios)

    infos = _train(mlp, tdbg, 12, optimizer=optimizer, plant=plant)
    for step in (0, 10):  # weight norms are read at the steps 0, 10, 20...
        for module, (lr, grad, weight) in expected[step].items():
            assert infos[step]["update_to_weight_ratio"][module] == pytest.approx(lr * grad / weight, rel=1e-5)
    lr, grad, _ = expected[5]["2"]  # in between: this step's gradient over step 0's weights
    assert infos[5]["update_to_weight_ratio"]["2"] == pytest.approx(lr * grad / expected[0]["2"][2], rel=1e-5)


def test_one_host_read_per_monitored_step(tmp_path):
    from diffusion_debug.stats.host import count_host_transfers

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tdbg = TrainingDebugger(
        model, config=DebugConfig(output_dir=str(tmp_path), run_name="reads", memory_tracking=False)
    )
    for step in range(12):  # past the every-10-steps weight-norm refresh
        loss = model(torch.randn(3, 4)).pow(2).mean()
        loss.backward()
        with count_host_transfers() as reads:
            tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, timesteps=torch.tensor([1, 500, 999]))
        assert reads.calls == ["tolist"], (step, reads.calls)
        optimizer.step()
        optimizer.zero_grad()


def test_history_is_bounded(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), history_size=5, stream_events=False))
    _train(mlp, tdbg, 12)
    assert len(tdbg.report().steps) == 5


def test_positions_are_made_once(mlp, tmp_path, monkeypatch):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), stream_events=False))
    calls = []
    arange = torch.arange
    monkeypatch.setattr(torch, "arange", lambda *a, **k: calls.append(1) or arange(*a, **k))
    for step in range(3):
        loss = mlp(torch.randn(2, 4)).pow(2).mean()
        loss.backward()
        tdbg.monitor_training_step(loss, step=step)
        mlp.zero_grad()
    assert len(calls) == 1


def test_a_mapping_is_accepted_as_config(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config={"output_dir": str(tmp_path), "policy": "skip"})
    assert isinstance(tdbg.config, DebugConfig) and tdbg.config.policy == "skip"
    tdbg.detach()
    with pytest.raises(DiffusionDebugError):
        TrainingDebugger(mlp, config={"output_dir": str(tmp_path / "out"), "polcy": "skip"})
    assert not (tmp_path / "out").exists()


def test_a_failed_measurement_is_recorded_at_once_while_another_loops_grad_scaler_is_alive(mlp, tmp_path, monkeypatch):
    """A failed measurement's row is all NaN, which read as 'looks scaled' while some GradScaler was alive (another
    loop's, or one an earlier test left to the garbage collector): the step was held for the scaler's trial, and
    under strict the error raised with its debugger_error never recorded. Now recorded at once."""
    from diffusion_debug.training.measure import gradients

    def failing(*args, **kwargs):
        raise RuntimeError("planted")

    alive = torch.amp.GradScaler("cpu", init_scale=1024.0)  # another loop's scaler, alive beside this one
    other = torch.nn.Linear(2, 1)
    alive.scale(other(torch.ones(1, 2)).sum()).backward()
    alive.step(torch.optim.SGD(other.parameters(), lr=0.1))
    alive.update()
    monkeypatch.setattr(gradients, "grad_norms", failing)
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), strict=True))
    with pytest.raises(RuntimeError, match="planted"):
        _train(mlp, tdbg, 1)
    errors = [(a.kind, a.details["where"], a.step) for a in tdbg.report().anomalies if a.severity != "info"]
    assert errors == [("debugger_error", "measurement", 0)]
    tdbg.close()


def test_a_tracker_failure_still_applies_the_policy(mlp, tmp_path, monkeypatch):
    # A failure after the gather (here: recording the step) must not skip the policy.
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), policy="skip"))
    loss = mlp(torch.randn(2, 4)).pow(2).mean()
    loss.backward()
    mlp[0].weight.grad[0, 0] = float("nan")

    def failing(row, **kwargs):
        raise RuntimeError("planted failure in add_step")

    monkeypatch.setattr(tdbg.record, "add_step", failing)
    info = tdbg.monitor_training_step(loss, step=0)
    assert info["policy_action"] == "skip"
    assert all(torch.count_nonzero(p.grad) == 0 for p in mlp.parameters())
    (error,) = [a for a in tdbg.report().anomalies if a.kind == "debugger_error"]
    assert error.details["where"] == "recording" and "planted failure in add_step" in error.message
    assert tdbg.get_summary()["skipped_by_policy"] == 1


def test_strict_raises_a_late_failure_after_the_policy(mlp, tmp_path, monkeypatch):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), policy="stop", strict=True))
    loss = mlp(torch.randn(2, 4)).pow(2).mean()
    loss.backward()
    mlp[0].weight.grad[0, 0] = float("nan")
    monkeypatch.setattr(tdbg.record, "add_step", lambda row, **kwargs: (_ for _ in ()).throw(RuntimeError("planted")))
    with pytest.raises(RuntimeError, match="planted"):
        tdbg.monitor_training_step(loss, step=0)
    assert tdbg.should_stop  # the policy ran first
    # and it was recorded once, as raised (a late failure was raised unrecorded)
    (error,) = [a for a in tdbg.report().anomalies if a.kind == "debugger_error"]
    assert (error.details["where"], error.step, error.details["raised"]) == ("recording", 0, True)
    # closed here: the raise's traceback (its frames hold the debugger) stays in pytest's captured log
    # records past teardown, and an unclosed debugger keeps probes.copies' patch in (the leak check's)
    tdbg.close()
    assert not tdbg.attached


def test_train_job_policy_stop_ends_the_loop(tmp_path, fresh_accelerate_state, monkeypatch, capsys):
    from diffusion_debug.cli import main

    detached = []
    original = TrainingDebugger.detach
    monkeypatch.setattr(TrainingDebugger, "detach", lambda self: detached.append(1) or original(self))
    code = main(
        ["train", "--cpu", "--steps", "6", "--policy", "stop", "--inject", "nan-grad@2", "--output-dir", str(tmp_path)]
    )
    assert code == 0
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    summary = load_json(run_dir / "summary.json")
    assert summary["training"]["total_steps"] == 3  # steps 0, 1 and 2, where the NaN gradient stopped it
    assert any(a["kind"] == "nonfinite" and a["step"] == 2 for a in summary["anomalies"])
    assert detached == [1]
    # one line says where the loop stopped and why (the cause, as the debugger's stop_reason)
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("stopped:")]
    assert line.startswith("stopped: policy 'stop' ended the training loop after 3 monitored step(s)")
    assert "because of nonfinite at model " in line and ", step 2" in line


# -- lifecycle ------------------------------------------------------------------------------------


def _hooked(model):
    return [bool(p._post_accumulate_grad_hooks) for p in model.parameters()]


def test_constructor_attaches_and_detach_can_be_undone(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    assert tdbg.attached and all(_hooked(mlp))
    tdbg.detach()
    assert not tdbg.attached and not any(_hooked(mlp))
    tdbg.detach()  # idempotent
    handle = tdbg.attach()
    assert tdbg.attached and all(_hooked(mlp))
    handle.remove()
    assert not any(_hooked(mlp))
    # monitoring while detached still works: gradients are named in registration order
    _train(mlp, tdbg, 2, plant=_nan_bias_grad(1))
    (a,) = [a for a in tdbg.report().anomalies if a.kind == "nonfinite"]
    assert (a.step, a.parameter, a.details["order"]) == (1, "0.bias", "registration")


def test_with_block_attaches_and_detaches(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    tdbg.detach()
    with tdbg as entered:
        assert entered is tdbg and all(_hooked(mlp))
        _train(mlp, tdbg, 2, plant=_nan_bias_grad(1))
    assert not tdbg.attached and not any(_hooked(mlp))
    (a,) = [a for a in tdbg.report().anomalies if a.kind == "nonfinite"]
    assert a.parameter == "0.bias"
    assert set(tdbg._order.order) == set(range(len(tdbg.params)))  # the hooks saw the backward inside the block


def test_with_block_restores_process_anomaly_mode_and_attach_enables_it_again(mlp, tmp_path):
    before = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    try:
        with TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), enable_autograd_anomaly=True)) as t:
            assert torch.is_anomaly_enabled() and not torch.is_anomaly_check_nan_enabled()
        assert (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) == before
        t.attach()
        assert torch.is_anomaly_enabled()
        t.close()
        assert (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) == before
    finally:
        torch.set_anomaly_enabled(*before)


def test_close_is_final(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    _train(mlp, tdbg, 2)
    tdbg.close()
    assert not any(_hooked(mlp))
    with pytest.raises(DiffusionDebugError, match="closed"):
        tdbg.attach()
    loss = mlp(torch.randn(2, 4)).pow(2).mean()
    loss.backward()
    with pytest.raises(DiffusionDebugError, match="closed"):
        tdbg.monitor_training_step(loss, step=2)
    tdbg.close()  # idempotent
    assert tdbg.report().save().is_dir()  # the report still works after close


# -- history, policy warn ---------------------------------------------------------------------------


def test_clear_debug_history_resets_the_counts(mlp, tmp_path):
    # policy skip: the NaN gradient never reaches the weights, so only the planted steps are anomalous
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), policy="skip"))
    _train(mlp, tdbg, 3, plant=_nan_bias_grad(1))
    before = tdbg.get_summary()
    assert (before["total_steps"], before["anomaly_steps"], before["anomaly_counts"]) == (3, 1, {"nonfinite": 1})
    tdbg.clear_debug_history()
    cleared = tdbg.get_summary()
    assert (cleared["total_steps"], cleared["anomaly_steps"], cleared["skipped_by_policy"]) == (0, 0, 0)
    assert cleared["anomaly_counts"] == {} and tdbg.report().anomalies == []
    # and counting goes on from there: a NaN right after the clear is a new anomaly, not a repeat
    _train(mlp, tdbg, 2, plant=_nan_bias_grad(0))
    after = tdbg.get_summary()
    assert (after["total_steps"], after["anomaly_steps"], after["anomaly_counts"]) == (2, 1, {"nonfinite": 1})
    (a,) = tdbg.report().anomalies
    assert (a.step, a.details["count"]) == (0, 1)


def test_a_problem_that_goes_on_after_clear_debug_history_is_reported_again(tmp_path):
    # zero_grad() between backward() and step(): not learning before the clear, and after it
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), stream_events=False))
    reported = []
    for step in range(16):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        optimizer.zero_grad()
        optimizer.step()
        if step == 7:
            reported.append([(a.kind, a.step) for a in tdbg.report().anomalies])
            tdbg.clear_debug_history()
    reported.append([(a.kind, a.step) for a in tdbg.report().anomalies])
    assert reported == [[("not_learning", 5)], [("not_learning", 8)]]
    tdbg.close()


@pytest.mark.parametrize(
    "warn_severity, expected", [("warning", ["gradient_explosion", "nonfinite"]), ("error", ["nonfinite"])]
)
def test_policy_warn_warns_at_or_above_warn_severity(mlp, tmp_path, warn_severity, expected):
    config = DebugConfig(
        output_dir=str(tmp_path), policy="warn", warn_severity=warn_severity, grad_explosion_threshold=1e-9
    )
    tdbg = TrainingDebugger(mlp, config=config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(mlp, tdbg, 3, plant=_nan_bias_grad(2))
    ours = [str(w.message) for w in caught if str(w.message).startswith("diffusion-debug ")]
    assert [m.split()[1] for m in ours] == expected  # explosion at step 0 (folded at 1), NaN at 2
    assert ours[-1].startswith("diffusion-debug nonfinite at model 0.bias, step 2: 1 gradient(s) hold NaN/Inf")


def test_nested_inputs_are_checked_and_named(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    for step in range(3):
        x = torch.randn(8, 4)
        if step == 2:
            x[0, 0] = float("nan")
        batch = {"pixel_values": x, "input_ids": torch.ones(8, 3, dtype=torch.long), "extra": [torch.zeros(2)]}
        loss = mlp(batch["pixel_values"]).pow(2).mean()
        loss.backward()
        tdbg.monitor_training_step(loss, step=step, inputs=batch)
        mlp.zero_grad()
    first = tdbg.report().anomalies[0]
    assert (first.kind, first.component, first.step, first.parameter) == (
        "nonfinite_input",
        "input",
        2,
        'inputs["pixel_values"]',
    )
    loss_anomaly = next(a for a in tdbg.report().anomalies if a.kind == "nonfinite_loss")
    assert loss_anomaly.details["follows"] == {"kind": "nonfinite_input", "rank": 0}


def test_without_inputs_the_nan_loss_says_the_batch_was_not_checked(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    loss = mlp(torch.randn(2, 4)).mean() * float("nan")
    loss.backward()
    tdbg.monitor_training_step(loss, step=0)
    (a,) = [a for a in tdbg.report().anomalies if a.kind == "nonfinite_loss"]
    assert "the input batch was not checked (pass inputs=batch" in a.message


def total_grad_norm(model) -> float:
    """The 2-norm of all the gradients, as clip_grad_norm_ computes it (torch < 2.6 has no get_total_norm)."""
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()])))


def test_clipped_flag_from_max_grad_norm_or_the_returned_norm(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), step_offset=1))
    loss = mlp(torch.randn(8, 4)).pow(2).mean() * 100
    loss.backward()
    norm = total_grad_norm(mlp)
    info = tdbg.monitor_training_step(loss, step=0, max_grad_norm=norm / 2)
    assert info["grad_norm_clipped"] is True and info["step"] == 1  # step_offset: numbered from 1
    returned = torch.nn.utils.clip_grad_norm_(mlp.parameters(), norm * 2)  # clipped before monitoring
    info = tdbg.monitor_training_step(loss, step=1, max_grad_norm=norm * 2, grad_norm=returned)
    assert info["grad_norm_clipped"] is False and info["step"] == 2
    assert tdbg.monitor_training_step(loss, step=2)["grad_norm_clipped"] is None  # unknown without max_grad_norm


def test_a_script_that_clips_before_monitoring_is_judged_on_the_norm_it_passed(mlp, tmp_path):
    """diffusers' scripts clip first; the gradients the debugger then reads are the clipped ones, so
    an explosion is seen only through grad_norm= (what clip_grad_norm_ returned): it is recorded and
    judged as the step's norm."""
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), grad_explosion_threshold=1000.0))
    loss = mlp(torch.randn(8, 4)).pow(2).mean() * 1e6
    loss.backward()
    returned = torch.nn.utils.clip_grad_norm_(mlp.parameters(), 1.0)
    clipped = total_grad_norm(mlp)
    assert float(returned) > 1000.0 and clipped <= 1.0 + 1e-5
    info = tdbg.monitor_training_step(loss, step=0, max_grad_norm=1.0, grad_norm=returned)
    assert info["grad_norm"] == pytest.approx(float(returned), rel=1e-6) and info["grad_norm_clipped"] is True
    (explosion,) = [a for a in tdbg.report().anomalies if a.kind == "gradient_explosion"]
    assert explosion.details["grad_norm"] == pytest.approx(float(returned), rel=1e-6)


def test_world_size_in_the_environment_without_a_process_group_warns_once(mlp, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    (a,) = tdbg.report().anomalies
    assert (a.kind, a.severity) == ("distributed_split", "warning")
    assert "Accelerator(cpu=True)" in a.message and "WORLD_SIZE=2" in a.message
    # the launch that joins CPU processes is ours: accelerate's own --cpu starts one process
    assert KINDS["distributed_split"].action == (
        "On CPU create the Accelerator with cpu=True, or start the script with diffusion-debug launch --cpu (plain "
        "accelerate launch --cpu starts one process); check the launcher's backend."
    )


def test_the_model_first_call_order_is_a_clear_type_error(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    loss = mlp(torch.ones(1, mlp[0].in_features)).sum()
    with pytest.raises(TypeError, match=r"takes the loss first.*monitor_training_step\(loss, optimizer="):
        tdbg.monitor_training_step(mlp, loss, 3)
    with pytest.raises(TypeError, match="needs the loss \\(a tensor or a number\\), not str"):
        tdbg.monitor_training_step("loss")
    # a GAN's two optimizers in one list: every step was a debugger_error and nothing was measured
    generator, discriminator = (torch.optim.SGD([p], lr=0.1) for p in mlp.parameters() if p.dim() == 2)
    with pytest.raises(TypeError, match=r"one optimizer, not a list: .* after each optimizer's backward"):
        tdbg.monitor_training_step(loss, optimizer=[generator, discriminator], step=0)
    assert tdbg.get_summary()["total_steps"] == 0  # nothing was recorded as a failure
    assert tdbg.report().anomalies == []
    tdbg.close()


def test_the_learning_rate_is_read_from_the_optimizer_and_lr_scheduler_is_no_argument(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    seen, expected = [], []
    for step in range(5):
        loss = mlp(torch.ones(2, 4)).pow(2).mean()
        loss.backward()
        seen.append(tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)["learning_rates"])
        expected.append(scheduler.get_last_lr())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    assert seen == expected == [[0.1], [0.1], [0.05], [0.05], [0.025]]
    with pytest.raises(TypeError, match="lr_scheduler"):
        tdbg.monitor_training_step(loss.detach(), optimizer=optimizer, lr_scheduler=scheduler)
    tdbg.close()


def test_adafactor_with_its_own_relative_step_lr_of_none_is_measured_quietly(tmp_path, unet_loop):
    # transformers' Adafactor(relative_step=True, lr=None) keeps lr None in its param group: every
    # step was a debugger_error (float(None)) and no step was measured
    from transformers.optimization import Adafactor

    def adafactor(unet):
        return Adafactor(unet.parameters(), scale_parameter=True, relative_step=True, warmup_init=True, lr=None)

    tdbg, losses = unet_loop(DebugConfig(output_dir=str(tmp_path)), 4, optimizer=adafactor)
    assert tdbg.report().anomalies == []
    assert [row["loss"] for row in tdbg.report().steps] == pytest.approx(losses, rel=1e-6)
    assert [row.get("learning_rates", []) for row in tdbg.report().steps] == [[]] * 4


@pytest.mark.parametrize("dtypes", [("float64", "float64"), ("float32", "float64")], ids=["float64", "mixed"])
def test_float64_parameters_are_measured(tmp_path, dtypes):
    # a norm in float32 may not narrow a float64 tensor: every step used to be a failed measurement
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    for layer, dtype in zip(model, dtypes):
        layer.to(getattr(torch, dtype))
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), strict=True, stream_events=False))
    loss = model[1](model[0](torch.randn(16, 4, dtype=getattr(torch, dtypes[0]))).to(model[1].weight.dtype)).pow(2)
    loss = loss.mean()
    loss.backward()
    info = tdbg.monitor_training_step(loss, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), step=0)
    expected = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
    assert info["grad_norm"] == pytest.approx(expected, rel=1e-6)
    assert [a.kind for a in tdbg.report().anomalies] == []
    tdbg.close()


def test_the_update_ratio_of_a_clipped_step_uses_the_clipped_gradients(tmp_path):
    # clip_grad_norm_(max_norm=1) after monitoring scales gradients with a norm in the thousands down
    # to 1: the update ratio is judged on what the optimizer gets (it was above 1: an lr_spike)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    config = DebugConfig(output_dir=str(tmp_path), stream_events=False, grad_explosion_threshold=1e9)
    tdbg = TrainingDebugger(model, config=config)
    x = torch.randn(64, 8)
    ratios, seen = [], []
    for step in range(3):
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean() * 2000
        loss.backward()
        info = tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, max_grad_norm=1.0)
        seen.append(info["update_to_weight_ratio"])
        scale = min(1.0, 1.0 / info["grad_norm"])
        modules = {"0": model[0], "2": model[2]}
        ratios.append(
            {
                name: 1e-3
                * scale
                * math.sqrt(sum(float(p.grad.square().sum()) for p in m.parameters()))
                / math.sqrt(sum(float(p.detach().square().sum()) for p in m.parameters()))
                for name, m in modules.items()
            }
        )
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    assert seen[0] == pytest.approx(ratios[0], rel=1e-5)  # later steps use weight norms up to 10 steps old
    assert seen[2] == pytest.approx(ratios[2], rel=1e-3)
    assert [a for a in tdbg.report().anomalies if a.kind == "lr_spike"] == []
    tdbg.close()


class _Momentum(torch.optim.SGD):  # a user's SGD under another name: still a gradient step
    pass


class DAdaptSGD(torch.optim.SGD):  # D-Adaptation's: SGD in its name, but lr 1.0 x its estimate d (in its groups)
    def __init__(self, params):
        super().__init__(params, lr=1.0)
        for group in self.param_groups:
            group["d"] = 1e-6

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] * group["d"])


@pytest.mark.parametrize("make", [torch.optim.AdamW, DAdaptSGD, torch.optim.SGD, _Momentum])
def test_lr_x_gradient_over_weight_foretells_only_a_gradient_steps_update(tmp_path, make):
    # AdamW (and Prodigy at lr 1.0, 8-bit Adam, Adafactor) divides the gradient out: under a loss
    # 2000x larger its update is the same ~lr a weight, but lr x |g| / |w| read thousands (an lr_spike
    # "would move 2 by 4.4e+03 times its weights" at every Prodigy step whose gradient outgrew the weights).
    # DAdaptSGD (lr 1.0 x d) read 1.3e3 on a LoRA adapter where its step moved 0.6 when judged by its name
    adaptive = make in (torch.optim.AdamW, DAdaptSGD)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = make(model.parameters()) if make is DAdaptSGD else make(model.parameters(), lr=1e-3)
    config = DebugConfig(output_dir=str(tmp_path), stream_events=False, grad_explosion_threshold=1e9)
    tdbg = TrainingDebugger(model, config=config)
    x = torch.randn(64, 8)
    seen, weights, naive = [], [], []
    for step in range(3):
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean() * 2000
        loss.backward()
        info = tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        seen.append(info.get("update_to_weight_ratio"))
        weights.append({n: [p.detach().double().clone() for p in model[int(n)].parameters()] for n in "02"})
        naive.append(  # lr x |g| / |w| per module, with step 0's weights (weight norms up to 10 steps old)
            {
                n: 1e-3
                * math.sqrt(sum(float(p.grad.double().square().sum()) for p in model[int(n)].parameters()))
                / math.sqrt(sum(float(w.square().sum()) for w in weights[0][n]))
                for n in "02"
            }
        )
        optimizer.step()
        optimizer.zero_grad()
    rows = tdbg.report().steps
    columns = dict(TRAINING_STEP_COLUMNS)
    measured = [  # naive: max over modules of ||w(k) - w(k - 1)|| / ||w(k - 1)||
        max(
            math.sqrt(sum(float((a - b).square().sum()) for a, b in zip(weights[k][n], weights[k - 1][n])))
            / math.sqrt(sum(float(b.square().sum()) for b in weights[k - 1][n]))
            for n in "02"
        )
        for k in (1, 2)
    ]
    assert [columns["update/weight (measured, prev. step)"](r) for r in rows[1:]] == pytest.approx(measured, rel=1e-4)
    spikes = [(a.step, a.details["reason"]) for a in tdbg.report().anomalies if a.kind == "lr_spike"]
    if adaptive:
        # lr x |g| / |w| is neither computed nor recorded (it read above 1 here where the step moved < 0.05):
        # the report shows the update measured from the weights alone
        assert seen == [None] * 3 and all("max_update_to_weight_ratio" not in r for r in rows)
        assert [columns["lr x grad/weight"](r) for r in rows] == [None] * 3
        assert spikes == [] and all(0 < m < 0.05 for m in measured)
    else:
        assert seen == [pytest.approx(n, rel=1e-5) for n in naive]
        assert max(seen[0].values()) > 1  # the estimate passes the threshold: an lr_spike
        assert [columns["lr x grad/weight"](r) for r in rows] == pytest.approx([max(n.values()) for n in naive])
        assert spikes[0] == (0, "update_ratio")
    tdbg.close()


def test_prodigy_on_a_lora_adapter_is_quiet(tmp_path):
    # diffusers' --optimizer prodigy: lr 1.0 (its step is d x lr); lora_B grows from zero, so its gradient
    # outgrows its weights: lr x |g| / |w| read above 1 at steps 10 and 11 (two false lr_spikes)
    prodigyopt = pytest.importorskip("prodigyopt")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4, bias=False))
    lora_b = torch.nn.Linear(4, 16, bias=False)
    torch.nn.init.zeros_(lora_b.weight)
    model.append(lora_b)
    model[0].requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = prodigyopt.Prodigy(trained, lr=1.0, weight_decay=1e-2, safeguard_warmup=True, use_bias_correction=True)
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), log_level="error"))
    data = torch.Generator().manual_seed(1)
    for step in range(16):
        x = torch.randn(32, 16, generator=data)
        loss = torch.nn.functional.mse_loss(model(x) + x, torch.tanh(x * 2))
        loss.backward()
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        optimizer.step()
        optimizer.zero_grad()
    assert [(a.kind, a.step) for a in tdbg.report().anomalies if a.severity != "info"] == []
    tdbg.close()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_monitoring_before_backward_says_to_call_it_after_backward(tmp_path, _tiny_unet, set_to_none):
    # the monitor called between the forward and loss.backward(): no watched gradient exists yet
    # (every .grad None), which says where the call belongs, not only "gradient norm 0"; with
    # zero_grad(set_to_none=False) the later steps' gradients are zeros, not None (step 0's are)
    unet = copy.deepcopy(_tiny_unet).train()
    optimizer = torch.optim.SGD(unet.parameters(), lr=1e-3)
    tdbg = TrainingDebugger(unet, config=DebugConfig(output_dir=str(tmp_path), log_level="error"))
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(1, unet.config.in_channels, 8, 8, generator=generator)
    context = torch.randn(1, 4, unet.config.cross_attention_dim, generator=generator)
    for step in range(2):
        loss = unet(sample, torch.tensor([500]), context).sample.square().mean()
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
    tdbg.close()
    first = tdbg.report().anomalies[0]
    assert (first.kind, first.step, first.details["grad_norm"]) == ("gradient_vanishing", 0, 0.0)
    assert first.message == (
        "No watched parameter has a gradient (every .grad is None: the global gradient norm is 0): call "
        "monitor_training_step after loss.backward() and before optimizer.step(), and zero_grad() after the "
        "step, not between backward() and the monitor."
    )


def test_a_zero_gradient_norm_with_gradients_present_keeps_its_own_advice(tmp_path, mlp):
    # gradients present but zero (a loss that no longer depends on the weights: times 0) are not
    # "before backward": the message stays the vanishing one
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.1)
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), log_level="error"))
    (mlp(torch.ones(2, 4)).sum() * 0).backward()
    tdbg.monitor_training_step(torch.tensor(0.0), optimizer=optimizer, step=0)
    tdbg.close()
    (found,) = tdbg.report().anomalies
    assert found.message == (
        "The global gradient norm is 0, below 1e-07: check that the loss depends on the trained parameters and "
        "that zero_grad() runs after the step."
    )


def _scripts_hook(module, args, output):
    """A hook of the script's own (module-level: it pickles by name)."""
    return output * 1.0


def test_a_copy_or_a_pickle_of_a_watched_model_mid_run_is_a_plain_model_and_the_original_stays_watched(mlp, tmp_path):
    """``ema = copy.deepcopy(model)`` and ``torch.save(model)`` between monitored steps: the copy held the
    debugger's call hooks (inert ``CopiedHook`` s, which a pickle named: it loaded only where diffusion-debug
    is installed). Now the copies hold the script's own hook alone, their pickle names nothing of ours, their
    output is the model's bitwise, and the model's NaN loss after the copy is still named at its step."""
    import io
    import pickle

    mlp[2].register_forward_hook(_scripts_hook)
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.1)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    own_getstate = nn.Module.__getstate__
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), log_level="error"))
    for step in range(4):
        if step == 2:
            ours = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in mlp.modules()) - 1
            data, buffer = pickle.dumps(mlp), io.BytesIO()
            torch.save(mlp, buffer)
            twins = [
                copy.deepcopy(mlp),
                pickle.loads(data),
                torch.load(io.BytesIO(buffer.getvalue()), weights_only=False),
            ]
            assert ours > 0 and b"diffusion_debug" not in data + buffer.getvalue()
            for twin in twins:
                hooks = [
                    h for m in twin.modules() for d in (m._forward_hooks, m._forward_pre_hooks) for h in d.values()
                ]
                assert hooks == [_scripts_hook]
                assert torch.equal(twin(x), mlp(x))
        loss = mlp(x).pow(2).mean() * (float("nan") if step == 3 else 1.0)
        loss.backward()
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        optimizer.step()
        optimizer.zero_grad()
    assert tdbg.get_summary()["total_steps"] == 4
    first = tdbg.report().by_cause()[0]
    assert (first.kind, first.step) == ("nonfinite_loss", 3)
    tdbg.close()
    assert nn.Module.__getstate__ is own_getstate


@pytest.mark.parametrize("set_to_none", [True, False], ids=["grads-none", "grads-zeroed"])
def test_a_watched_model_the_script_freezes_whole_mid_run_is_no_vanishing_gradient(tmp_path, set_to_none):
    # train_dreambooth_lora_sdxl's --train_text_encoder_frac: the watched text encoder is frozen
    # (requires_grad_(False)) after step 3 while the rest trains on; its gradients are then None, or
    # zeros (zero_grad(set_to_none=False)). The script froze it: no gradient_vanishing (step 3 was warned,
    # told to call the monitor after backward, or that the loss does not depend on it), training unchanged
    def run(watch):
        torch.manual_seed(0)
        encoder = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        head = nn.Linear(8, 1)
        encoder_optimizer = torch.optim.AdamW(encoder.parameters(), lr=1e-2)
        head_optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2)
        config = DebugConfig(output_dir=str(tmp_path), log_level="error")
        tdbg = TrainingDebugger(encoder, config=config) if watch else None
        x, y = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)), torch.ones(16, 1)
        losses = []
        for step in range(8):
            loss = torch.nn.functional.mse_loss(head(encoder(x)), y)
            loss.backward()
            if tdbg is not None:
                tdbg.monitor_training_step(loss, optimizer=encoder_optimizer, step=step)
            for optimizer in (encoder_optimizer, head_optimizer):
                optimizer.step()
                optimizer.zero_grad(set_to_none=set_to_none)
            if step == 2:
                encoder.requires_grad_(False)
            losses.append(loss.item())
        weights = [p.detach().clone() for p in [*encoder.parameters(), *head.parameters()]]
        return tdbg, losses, weights

    _, plain_losses, plain_weights = run(watch=False)
    tdbg, losses, weights = run(watch=True)
    tdbg.close()
    assert losses == plain_losses and all(torch.equal(a, b) for a, b in zip(weights, plain_weights))
    assert [(a.kind, a.step) for a in tdbg.report().anomalies if a.severity != "info"] == []
