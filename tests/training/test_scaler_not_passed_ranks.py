"""A GradScaler not passed under plain torch DDP (``step.found_scaler``), where the ranks do not hold together: a
rank that holds the step's verdict (it looks scaled) and one whose measurement failed. The holder releases the
step in place (``StepMonitor._held_alone``), in the same step, so neither waits on the other and both judge and
count the same. A scenario of the session's one launch of multiprocess_job.py (conftest.py's
``multiprocess_job``, with test_multiprocess.py's)."""

import math

import pytest
from test_multiprocess import _printed_norms, _run_dir, _summaries

from diffusion_debug.record import load_json

pytestmark = pytest.mark.xdist_group("launches")

MULTIPROCESS_JOB_SCENARIOS = ("scaler_not_passed_fails0_record",)
"""What the session's launch of multiprocess_job.py runs for this module."""


@pytest.fixture(scope="module")
def scenario(multiprocess_job):
    """``scenario(name)``: that scenario's share of the session's launch and its run directory."""
    output_dir, runs = multiprocess_job
    return lambda name: (runs[name], _run_dir(output_dir / name, runs[name]))


def test_a_held_step_released_by_a_failed_rank_goes_on_on_both_ranks_and_counts_its_nan(scenario):
    """fp16 at 65536, the scaler not passed, policy record: step 0's gradients overflow, which rank 0 holds (it
    looks scaled), while rank 1's gradient norms raise (a planted debugger failure). The step's reduce says a rank
    failed: rank 0 releases its verdict in place, so both ranks finish the 8 steps (none waits on a detail
    exchange the other never joins), and rank 0's NaN gradients of step 0 are counted as read on both ranks alike
    (the flag its hold had cleared rides in the reduce at its own level, ``nonfinite_held``). Before: its
    ``nonfinite`` was emitted but not counted, ``nonfinite_steps`` one short. The ``closure=`` given is not replayed
    on either rank: the held flag counts, after the replay's decision (a step that looks scaled is none of the
    replay's; a replay decided on it said, falsely, that the replay under anomaly mode stayed finite)."""
    done, run_dir = scenario("scaler_not_passed_fails0_record")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "RAISED" not in done.stdout, done.stdout
    norms = _printed_norms(done.stdout)
    assert sorted(norms) == [(rank, step) for rank in (0, 1) for step in range(8)], done.stdout
    anomalies = load_json(run_dir / "summary.json")["anomalies"]
    found = [(a["kind"], a["severity"], a["step"], a["rank"]) for a in anomalies if a["step"] == 0]
    assert found == [("nonfinite", "error", 0, 0), ("debugger_error", "warning", 0, 1)]  # as read: not confirmed
    assert anomalies[0]["message"] == (  # no replay's: the step looked scaled (the replay's words would be false)
        "4 gradient(s) hold NaN/Inf, made in backward at 2.weight in module 2, the last in forward order of those "
        "that hold NaN/Inf: lower the learning rate, check the loss for NaN/Inf, or use closure= to name the "
        "backward op."
    )
    assert sorted(line for line in done.stdout.splitlines() if " REPLAYS " in line) == [
        f"RANK {rank} REPLAYS []" for rank in (0, 1)
    ], done.stdout
    assert anomalies[1]["message"] == (
        "Rank 1 failed to measure step 0 (RuntimeError: planted failure in grad_norms) and training went on; set "
        "strict=True to see the traceback."
    )
    summaries = _summaries(done.stdout)
    assert summaries[0] == summaries[1], summaries
    # step 0 (released in place, as read) and step 2 (its own flags); step 1, held again and released once the
    # scaler is confirmed at step 2, counts no NaN step (its overflow an info: ``_release``'s error-only count)
    assert (summaries[0]["nonfinite_steps"], summaries[0]["total_steps"]) == (2, 8)
    assert all(math.isfinite(norms[(r, s)]["measured"]) for r in (0, 1) for s in range(3, 8)), norms
