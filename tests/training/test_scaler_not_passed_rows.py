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
    reference from its own gradients), G's row of step 0 stays as it was measured, in the kept rows, the stream and
    a rebuilt summary alike. Before, the row was picked by step number: G's row (the last of step 0) took D's
    unscaled values' place (its own norm over 1024) and D's held row stayed scaled."""
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
    assert g0["grad_norm"] == pytest.approx(float(norms[1]), rel=1e-4) and g0.get("grad_scale") is None
    fields = ("step", "grad_norm", "grad_scale")
    expected = [[row.get(f) for f in fields] for row in kept]
    assert [[row.get(f) for f in fields] for row in every_rank_steps(run_dir)] == expected
    assert [[row.get(f) for f in fields] for row in rebuild_summary(run_dir)["steps"]] == expected
    (amended,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["type"] == "step_amended"]
    assert (amended["step"], amended["joined"]) == (0, 1)
