"""The held step's recorded row once its GradScaler not passed is confirmed (``training.step.found_scaler``): read
unscaled (``RunRecord.amend_step``), in the kept row and the stream alike, and only that row, where the script
repeats step numbers (one counting applied optimizer steps, which stays put while the scaler skips).

Each test freezes the objects alive before it (``only_the_tests_objects``): the scaler search walks the
garbage collector's list, which then holds the test's own scalers only."""

import pytest
import torch

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.record.run_dir import every_rank_steps

pytestmark = [
    pytest.mark.usefixtures("only_the_tests_objects"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning"),
]


def test_a_held_step_s_row_read_unscaled_is_the_one_row_it_names_where_step_numbers_repeat(tmp_path):
    """Autocast fp16 on the CPU, a GradScaler at 65536 not passed, and the step a count of applied optimizer
    steps: the first calls (skipped while the scale falls) are all step 0. The first, held, is read unscaled once
    the scaler is confirmed at the second; the stream's rows are the kept rows, the first of step 0 unscaled and the
    later ones of step 0 as they were measured (under the confirmed scaler). Before, the stream's ``step_amended``
    was put into every row of step 0: the later ones took the first one's scale (65536)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0)
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path)))
    data, applied, numbers = torch.Generator().manual_seed(1), 0, []
    for _ in range(8):
        x = torch.randn(16, 8, generator=data) * 4
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (model(x) - 3).square().mean()
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=applied)
        numbers.append(applied)
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        applied += scaler.get_scale() >= before  # a skip lowers the scale: the count stays
    kept = [dict(row) for row in tdbg.record.steps]
    run_dir = tdbg.record.run_dir
    tdbg.close()
    assert numbers == [0, 0, 0, 0, 1, 2, 3, 4]
    streamed = every_rank_steps(run_dir)
    assert [row["step"] for row in streamed] == numbers
    fields = ("grad_norm", "grad_scale", "max_update_to_weight_ratio")
    assert [[row.get(f) for f in fields] for row in streamed] == [[row.get(f) for f in fields] for row in kept]
    # the held row's scale (its own, read unscaled), then each later row of step 0 its own, halved by each skip
    assert [row["grad_scale"] for row in streamed][:4] == [65536.0, 32768.0, 16384.0, 8192.0]
