"""The held step's recorded row once its GradScaler not passed is confirmed (``training.step.found_scaler``): read
unscaled (``RunRecord.amend_step``), in the kept row and the stream alike, and only that row, where the script
repeats step numbers (one counting applied optimizer steps, which stays put while the scaler skips); each skip
marks the one row of the call it skipped (``RunRecord.mark_skipped``), not a later row of the same step number.

Each test freezes the objects alive before it (``only_the_tests_objects``): the scaler search walks the
garbage collector's list, which then holds the test's own scalers only."""

import pytest
from test_scaler_not_passed import _fp16_loop

from diffusion_debug import DebugConfig
from diffusion_debug.record import read_jsonl
from diffusion_debug.record.run_dir import every_rank_steps, rebuild_summary

pytestmark = [
    pytest.mark.usefixtures("only_the_tests_objects"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning"),
]


def test_a_held_step_s_row_read_unscaled_is_the_one_row_it_names_where_step_numbers_repeat(tmp_path):
    """Autocast fp16 on the CPU, a GradScaler at 65536 not passed, and the step a count of applied optimizer
    steps: the first calls (skipped while the scale falls) are all step 0. The first, held, is read unscaled once
    the scaler is confirmed at the second; the stream's rows are the kept rows, the first of step 0 unscaled and the
    later ones of step 0 as they were measured (under the confirmed scaler). Before, the stream's ``step_amended``
    was put into every row of step 0: the later ones took the first one's scale (65536). Its ``step_amended`` names
    the held row's monitored step (1: the first), which the main process's copy of it is matched by."""
    results, scales, _, tdbg = _fp16_loop(DebugConfig(output_dir=str(tmp_path)), False, steps=8, applied=True)
    kept, run_dir = [dict(row) for row in tdbg.record.steps], tdbg.record.run_dir
    numbers = [result["step"] for result in results]
    assert numbers == [0, 0, 0, 0, 1, 2, 3, 4]
    streamed = every_rank_steps(run_dir)
    assert [row["step"] for row in streamed] == numbers
    fields = ("grad_norm", "grad_scale", "max_update_to_weight_ratio")
    assert [[row.get(f) for f in fields] for row in streamed] == [[row.get(f) for f in fields] for row in kept]
    # the held row's scale (its own, read unscaled), then each later row of step 0 its own, halved by each skip
    assert [row["grad_scale"] for row in streamed][:4] == scales[:4] == [65536.0, 32768.0, 16384.0, 8192.0]
    (amended,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["type"] == "step_amended"]
    assert (amended["step"], amended["joined"]) == (0, 1)


def test_each_skip_marks_the_row_of_the_call_it_skipped_where_step_numbers_repeat(tmp_path):
    """The same loop, its scaler passed: the scaler skips the first three calls (each lowers the scale), all step 0,
    and applies the fourth (step 0 too). Each skip, read at the next call, marks the row of the call it skipped,
    in the kept rows, the stream (``every_rank_steps``) and a summary rebuilt from it alike: the first three rows,
    not the fourth. Before, the kept rows marked the next call's row of step 0 (the second, third and fourth:
    ``mark_skipped`` ran after that row was added), and the stream marked every row of step 0."""
    results, scales, _, tdbg = _fp16_loop(DebugConfig(output_dir=str(tmp_path)), True, steps=8, applied=True)
    run_dir = tdbg.record.run_dir
    skipped = [later < earlier for earlier, later in zip(scales, scales[1:])]  # the naive reference: the scale fell
    assert [result["step"] for result in results] == [0, 0, 0, 0, 1, 2, 3, 4]
    assert skipped == [True, True, True, False, False, False, False]
    marked = [["skipped" in row for row in rows][:7] for rows in (tdbg.record.steps, every_rank_steps(run_dir))]
    assert marked == [skipped, skipped]
    assert [row.get("skipped") for row in rebuild_summary(run_dir)["steps"]][:4] == ["grad_scaler"] * 3 + [None]


def test_a_gan_s_held_row_read_unscaled_is_its_own_optimizer_s_not_the_other_s_of_the_same_step(tmp_path):
    """A GAN-style loop monitors D then G under the same step number, one GradScaler (1024) not passed stepping
    both. D's step 0 is held and confirmed at G's; D's row of step 0 is read unscaled (its norm over 1024, the naive
    reference from its own gradients), and G's row of step 0 by its own values (the scaler stepped G too: its own
    norm over 1024, not D's), in the kept rows, the stream and a rebuilt summary alike. Before, the row was picked
    by step number: G's row (the last of step 0) took D's unscaled values' place (its own norm over 1024) and D's
    held row stayed scaled; then (gan39) G's row stayed scaled, G never searched."""
    import torch

    from diffusion_debug import TrainingDebugger

    torch.manual_seed(0)
    nets = {
        name: torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, n))
        for name, n in (("D", 1), ("G", 8))
    }
    opts = {name: torch.optim.SGD(net.parameters(), lr=1e-4) for name, net in nets.items()}
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    tdbg = TrainingDebugger(nets, config=DebugConfig(output_dir=str(tmp_path)))
    g, norms = torch.Generator().manual_seed(1), []
    for step in range(3):
        x = torch.randn(16, 8, generator=g)
        for name, target in (("D", 1.0), ("G", 0.5)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = (nets[name](x) - target).square().mean()
            opts[name].zero_grad()
            scaler.scale(loss).backward()
            norms.append(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in nets[name].parameters()])))
            tdbg.monitor_training_step(loss, optimizer=opts[name], step=step)
        scaler.step(opts["D"])
        scaler.step(opts["G"])
        scaler.update()
    kept, run_dir = [dict(row) for row in tdbg.record.steps], tdbg.record.run_dir
    tdbg.close()
    d0, g0 = kept[0], kept[1]
    assert (d0["step"], g0["step"]) == (0, 0)
    assert d0["grad_norm"] == pytest.approx(float(norms[0]) / 1024, rel=1e-4) and d0["grad_scale"] == 1024.0
    assert g0["grad_norm"] == pytest.approx(float(norms[1]) / 1024, rel=1e-4) and g0["grad_scale"] == 1024.0
    fields = ("step", "grad_norm", "grad_scale")
    expected = [[row.get(f) for f in fields] for row in kept]
    assert [[row.get(f) for f in fields] for row in every_rank_steps(run_dir)] == expected
    assert [[row.get(f) for f in fields] for row in rebuild_summary(run_dir)["steps"]] == expected
    amended = [(e["step"], e["joined"]) for e in read_jsonl(run_dir / "events.jsonl") if e["type"] == "step_amended"]
    assert amended == [(0, 1), (0, 2)]  # D's held row, then G's


def test_a_held_step_s_skip_released_at_a_third_optimizer_s_call_marks_the_held_row_not_the_one_before(tmp_path):
    """Three models monitored under one step number, one GradScaler (1024) not passed: D's step 0 is held (an
    Inf planted in its gradients), D and G stepped after G's monitor call, E monitored and stepped after them. D's
    held step is decided at E's call (step 0 too) and its skip released there: it marks D's row of step 0 (the held
    row, monitored step 1), in the kept rows, the stream and a rebuilt summary alike; the naive reference is the
    optimizer steps themselves (D's weights unchanged, G's and E's moved). Before, a skip released at a call of
    the same step number marked the row before that call (G's, monitored step 2), and D's stayed unmarked."""
    import torch

    from diffusion_debug import TrainingDebugger

    torch.manual_seed(0)
    names = ("D", "G", "E")
    nets = {n: torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)) for n in names}
    opts = {n: torch.optim.SGD(net.parameters(), lr=1e-4) for n, net in nets.items()}
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    tdbg = TrainingDebugger(nets, config=DebugConfig(output_dir=str(tmp_path)))
    g = torch.Generator().manual_seed(1)
    before = {n: [p.detach().clone() for p in net.parameters()] for n, net in nets.items()}

    def monitored(name: str, step: int) -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (nets[name](torch.randn(16, 8, generator=g)) - 0.5).square().mean()
        opts[name].zero_grad()
        scaler.scale(loss).backward()
        if (name, step) == ("D", 0):
            next(nets[name].parameters()).grad[0, 0] = float("inf")
        tdbg.monitor_training_step(loss, optimizer=opts[name], step=step)

    moved = {}
    for step in range(2):
        monitored("D", step)
        monitored("G", step)
        scaler.step(opts["D"])
        scaler.step(opts["G"])
        monitored("E", step)
        scaler.step(opts["E"])
        scaler.update()
        if step == 0:
            moved = {
                n: any(not torch.equal(a, b) for a, b in zip(before[n], net.parameters())) for n, net in nets.items()
            }
    kept, run_dir = [dict(row) for row in tdbg.record.steps], tdbg.record.run_dir
    tdbg.close()
    assert moved == {"D": False, "G": True, "E": True}  # the naive reference: D's optimizer step alone skipped
    truth = ["grad_scaler", None, None, None, None, None]
    assert [row["step"] for row in kept] == [0, 0, 0, 1, 1, 1]
    assert [row.get("skipped") for row in kept] == truth
    assert [row.get("skipped") for row in every_rank_steps(run_dir)] == truth
    assert [row.get("skipped") for row in rebuild_summary(run_dir)["steps"]] == truth
    (skip,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["type"] == "step_skipped"]
    assert (skip["step"], skip["joined"], skip["reason"]) == (0, 1, "grad_scaler")


def _gan_fp16(tmp_path, passed: bool, order: str, bad: tuple[str, ...], steps: int = 4, at: int = 1):
    """A GAN-style fp16 loop (autocast on the CPU), D then G monitored under one step number, one GradScaler
    (1024) stepping both: ``order`` "together" steps both after G's monitor call, "each" each one after its own;
    an Inf planted in the gradients of each model in ``bad`` at step ``at``. Returns the kept rows, the run directory,
    the report's anomalies and the naive reference of each call: its gradient norm over the scale it was made
    with, and whether its optimizer step was skipped (its weights unchanged by ``scaler.step``)."""
    import torch

    from diffusion_debug import TrainingDebugger

    torch.manual_seed(0)
    nets = {
        name: torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, n))
        for name, n in (("D", 1), ("G", 8))
    }
    opts = {name: torch.optim.SGD(net.parameters(), lr=1e-4) for name, net in nets.items()}
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    tdbg = TrainingDebugger(nets, config=DebugConfig(output_dir=str(tmp_path)))
    g, truth = torch.Generator().manual_seed(1), {}

    def step_of(name: str) -> bool:
        before = [p.detach().clone() for p in nets[name].parameters()]
        scaler.step(opts[name])
        return all(torch.equal(a, b) for a, b in zip(before, nets[name].parameters()))

    for step in range(steps):
        x = torch.randn(16, 8, generator=g)
        for name, target in (("D", 1.0), ("G", 0.5)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = (nets[name](x) - target).square().mean()
            opts[name].zero_grad()
            scaler.scale(loss).backward()
            if step == at and name in bad:
                next(nets[name].parameters()).grad[0, 0] = float("inf")
            grads = torch.cat([p.grad.flatten() for p in nets[name].parameters()])
            truth[step, name] = [float(torch.linalg.vector_norm(grads)) / float(scaler.get_scale()), None]
            tdbg.monitor_training_step(loss, optimizer=opts[name], step=step, **({"scaler": scaler} if passed else {}))
            if order == "each":
                truth[step, name][1] = step_of(name)
        if order == "together":
            truth[step, "D"][1], truth[step, "G"][1] = step_of("D"), step_of("G")
        scaler.update()
    tdbg.close()  # (a skip at the last step is read here)
    kept, run_dir = [dict(row) for row in tdbg.record.steps], tdbg.record.run_dir
    return kept, run_dir, tdbg.report().anomalies, list(truth.values())


@pytest.mark.parametrize("passed", [True, False], ids=["passed", "not-passed"])
@pytest.mark.parametrize("order", ["together", "each"])
@pytest.mark.parametrize("bad", [("D",), ("G",), ("D", "G")], ids=["D", "G", "both"])
@pytest.mark.parametrize("at", [1, 3], ids=["read-at-the-next-step", "read-at-close"])
def test_a_gan_s_skip_marks_the_row_of_the_optimizer_the_scaler_skipped(tmp_path, passed, order, bad, at):
    """One GradScaler, two optimizers (a VAE fine-tune with a discriminator): an overflow in one model's gradients
    at step 1 (or both), the scaler skips that optimizer's step alone and halves the scale, read at D's step 2 (at
    step 3, the last: read at close). The
    skip marks the row of the optimizer it skipped (the naive reference: its weights unchanged by ``scaler.step``),
    in the kept rows, the stream and a rebuilt summary alike, with one ``skipped_step`` (its scales, read at step
    2), and the Inf is an info, not a ``nonfinite`` error, whether the scaler was passed or not. Before, the skip
    was pinned on the last row monitored before the scale fell (G's, whose optimizer stepped), D's row said
    nothing; with the scaler not passed, G's rows (no scale on them: never searched) reset the scale the skip is
    read against, so no skip was recorded, and an Inf in G was a ``nonfinite`` error."""
    kept, run_dir, anomalies, truth = _gan_fp16(tmp_path, passed, order, bad, at=at)
    skipped = ["grad_scaler" if was else None for _, was in truth]
    assert skipped == [None] * 2 * at + ["grad_scaler" if n in bad else None for n in ("D", "G")] + [None] * (
        6 - 2 * at
    )
    assert [row.get("skipped") for row in kept] == skipped
    assert [row.get("skipped") for row in every_rank_steps(run_dir)] == skipped
    assert [row.get("skipped") for row in rebuild_summary(run_dir)["steps"]] == skipped
    marks = [(e["step"], e["joined"]) for e in read_jsonl(run_dir / "events.jsonl") if e["type"] == "step_skipped"]
    assert marks == [(at, joined + 2 * at) for joined, name in ((1, "D"), (2, "G")) if name in bad]
    (skip,) = [a for a in anomalies if a.kind == "skipped_step"]  # one update() skipped them: counted once
    assert (skip.step, skip.severity) == (at, "info")
    assert skip.details == {
        "scale_before": 1024.0,
        "scale_after": 512.0,
        "detected_at_step": 2 if at == 1 else "close",
        "reason": "grad_scaler",
        "count": 1,
    }
    nonfinite = [(a.step, a.severity) for a in anomalies if a.kind == "nonfinite"]
    assert nonfinite == [(at, "info")] * len(bad)
    assert not [a for a in anomalies if a.severity == "error"]


@pytest.mark.parametrize("order", ["together", "each"])
def test_a_gan_s_other_optimizer_is_read_under_the_scaler_not_passed_that_steps_it(tmp_path, order):
    """The scaler (1024) not passed: D's first norm (3049) looks scaled and D is searched, G's (684.9, scaled) reads
    clean and is never searched. Once D's scaler is confirmed, the per-optimizer state it stepped D in says it
    stepped G too: G's rows from then on are measured under it, and G's row of step 0 (read with no scaler) is
    read unscaled, so every row's norm is its gradients' norm over the scale (the naive reference) and carries
    the scale. Before, G's rows stayed 1024x (then 512x) too large the whole run."""
    kept, run_dir, _, truth = _gan_fp16(tmp_path, False, order, ())
    expected = [norm for norm, _ in truth]
    assert [row["grad_norm"] for row in kept] == pytest.approx(expected, rel=1e-4)
    assert [row["grad_scale"] for row in kept] == [1024.0] * 8
    assert [row["grad_norm"] for row in every_rank_steps(run_dir)] == pytest.approx(expected, rel=1e-4)
    assert [row["grad_norm"] for row in rebuild_summary(run_dir)["steps"]] == pytest.approx(expected, rel=1e-4)
    amended = [(e["step"], e["joined"]) for e in read_jsonl(run_dir / "events.jsonl") if e["type"] == "step_amended"]
    assert amended == [(0, 1), (0, 2)]  # D's held row, then G's row of step 0


def test_a_skip_of_the_scaled_optimizer_is_read_past_the_other_optimizer_s_unscaled_rows(tmp_path):
    """D in fp16 under a GradScaler (1024, passed), updated after D's step; G in fp32 with a plain
    ``optimizer.step()``, monitored after D (its rows carry no scale). An Inf in D's gradients at step 1: the scaler
    skips D's step (the naive reference: D's weights unchanged) and halves the scale, read at D's step 2 past G's
    row: D's row of step 1 says ``skipped``, G's rows none, one ``skipped_step`` (1024 -> 512). Before, each G row
    (no scale) reset the scale the next D row was read against: the skip was never recorded."""
    import torch

    from diffusion_debug import TrainingDebugger

    torch.manual_seed(0)
    nets = {
        name: torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, n))
        for name, n in (("D", 1), ("G", 8))
    }
    opts = {name: torch.optim.SGD(net.parameters(), lr=1e-4) for name, net in nets.items()}
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    tdbg = TrainingDebugger(nets, config=DebugConfig(output_dir=str(tmp_path)))
    g, truth = torch.Generator().manual_seed(1), []
    for step in range(4):
        x = torch.randn(16, 8, generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (nets["D"](x) - 1.0).square().mean()
        opts["D"].zero_grad()
        scaler.scale(loss).backward()
        if step == 1:
            next(nets["D"].parameters()).grad[0, 0] = float("inf")
        tdbg.monitor_training_step(loss, optimizer=opts["D"], step=step, scaler=scaler)
        before = [p.detach().clone() for p in nets["D"].parameters()]
        scaler.step(opts["D"])
        scaler.update()
        truth += [all(torch.equal(a, b) for a, b in zip(before, nets["D"].parameters())), False]
        loss = (nets["G"](x) - 0.5).square().mean()
        opts["G"].zero_grad()
        loss.backward()
        tdbg.monitor_training_step(loss, optimizer=opts["G"], step=step)
        opts["G"].step()
    tdbg.close()
    run_dir = tdbg.record.run_dir
    skipped = ["grad_scaler" if was else None for was in truth]
    assert skipped == [None, None, "grad_scaler", None, None, None, None, None]
    assert [row.get("skipped") for row in tdbg.record.steps] == skipped
    assert [row.get("skipped") for row in every_rank_steps(run_dir)] == skipped
    scales = [1024.0, None, 1024.0, None, 512.0, None, 512.0, None]
    assert [row.get("grad_scale") for row in tdbg.record.steps] == scales
    (skip,) = [a for a in tdbg.report().anomalies if a.kind == "skipped_step"]
    assert (skip.step, skip.severity) == (1, "info")
    assert skip.details == {
        "scale_before": 1024.0,
        "scale_after": 512.0,
        "detected_at_step": 2,
        "reason": "grad_scaler",
        "count": 1,
    }
