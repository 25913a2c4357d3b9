"""Eight CPU processes through `accelerate launch` (gloo): hangs named by the liveness side channel
(``stall_timeout`` 3 s) before any watchdog. Three launches, because a stall that no rank can leave
ends the job: [clean, validation, raise_rank1_backward, raise_rank2_save, skip_rank5] on 8 processes (after
test_multiprocess.py's 8-process scenarios, in the launch the two modules share: conftest.py's ``shared_eight``), then
[monitor_rank0_only] and [left_early_last_rank] on :data:`ENDING` processes each (see stall_job.py):
the same patterns, named by the same code, with fewer processes starting (each ~3 CPU-s on two
shared cores: a launch of 8 took ~24 CPU-s, of 4 ~12). Three are the fewest that keep a run of
ranks in each message (``ranks 1–2 went on``, ``ranks 0–1 wait``: two ranks would name one); the
two launches of 3 take ~7 CPU-s less than of 4 (29.4-32.2 -> 22.9-23.7 CPU-s, load ~4).

Judged by what the job saved and printed: an 8-process gloo job sometimes ends with "terminate
called without an active exception" and exit code 1 whatever the debugger does."""

from pathlib import Path

import pytest

from diffusion_debug.record import load_json, read_jsonl

# Several processes per launch: under `pytest -n 2` the launches run one at a time on one worker
# (two 8-process jobs at once on two cores would starve each other past the stall timeout).
pytestmark = pytest.mark.xdist_group("launches")

JOB = Path(__file__).with_name("stall_job.py")
EXIT_CODE = 75  # stall_watch.EXIT_CODE: a process ended by a stall verdict
ENDING = 3  # the processes of each launch that only one scenario, ending the job, runs in
LAST = ENDING - 1


@pytest.fixture(scope="module")
def launched(shared_eight):
    """[clean, validation, raise_rank1_backward, raise_rank2_save, skip_rank5]: the stall scenarios of the 8-process
    launch that test_multiprocess.py's 8-process tests share (its scenarios run first, in the same processes)."""
    return shared_eight


@pytest.fixture(scope="module")
def monitor_rank0_only(launch_eight, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("stalls_monitor")
    stdout, stderr = launch_eight(output_dir, ("monitor_rank0_only",), processes=ENDING)
    return output_dir, stdout["monitor_rank0_only"], stderr


@pytest.fixture(scope="module")
def left_early_last_rank(launch_eight, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("stalls_left_early")
    stdout, stderr = launch_eight(output_dir, ("left_early_last_rank",), processes=ENDING)
    return output_dir, stdout["left_early_last_rank"], stderr


def _run_dir(output_dir: Path) -> Path:
    (run_dir,) = output_dir.glob("run-*")
    return run_dir


def _line_of(code: str) -> int:
    """The line of stall_job.py holding ``code`` (where a stack must point)."""
    return next(n for n, line in enumerate(JOB.read_text().splitlines(), 1) if code in line)


def _stalls(run_dir: Path) -> list[dict]:
    return [a for a in load_json(run_dir / "summary.json")["anomalies"] if a["details"].get("stall")]


def test_clean_run_names_no_stall(launched):
    output_dir, stdout, stderr = launched
    run_dir = _run_dir(output_dir / "clean")
    assert sorted(stdout["clean"].splitlines())[:8] == [f"RANK {r} DONE" for r in range(8)], stdout["clean"]
    assert _stalls(run_dir) == [] and not list(run_dir.glob("stacks-rank*.txt"))
    assert not any(e["type"] == "stall" for e in read_jsonl(run_dir / "events.jsonl"))


def test_validation_on_rank0_is_named_then_training_goes_on(launched):
    output_dir, stdout, stderr = launched
    run_dir = _run_dir(output_dir / "validation")
    (stall,) = _stalls(run_dir)  # named once, though every rank still waited in it for 3 of its watcher's looks
    assert (stall["kind"], stall["rank"], stall["step"]) == ("rank_desync", 0, 2)
    assert stall["message"].startswith(
        "Rank 0 is in validation at step 2; ranks 1–7 wait in backward (the gradient all-reduce) at step 3. "
    )
    assert stall["details"]["pattern"] == "rank_elsewhere" and stall["details"]["ended_job"] is False
    # stall_action="wait": every rank went on and finished the 6 steps after the validation
    assert "RANK 0 DONE" in stdout["validation"] and "RANK 7 DONE" in stdout["validation"]
    assert load_json(run_dir / "summary.json")["training"]["total_steps"] == 6
    # every rank's stack, at the job's own lines: rank 0 in its validation, the others in backward
    stacks = {r: (run_dir / f"stacks-rank{r}.txt").read_text() for r in range(8)}
    assert f'stall_job.py", line {_line_of("most=7.0)  # as a 7 s validation")} in run_scenario' in stacks[0]
    assert all(f'stall_job.py", line {_line_of("accelerator.backward(loss)")}' in stacks[r] for r in range(1, 8))
    assert stderr.count("rank_desync at model, step 2: Rank 0 is in validation") == 1  # logged by the main process


def test_a_rank_whose_backward_raised_is_named_with_its_error_while_the_others_wait_in_the_all_reduce(launched):
    """Rank 1's backward raises at step 3 (a hook on the model's output: outside the watched forward) and rank 1
    handles it in an ``except`` clause while ranks 0, 2-7 wait in the gradient all-reduce: every rank read
    "backward at step 3", together, and nothing was named. The error the training thread is unwinding with is
    seen by the watcher: rank 1 is named, with its error and where it left the step; then all go on."""
    output_dir, stdout, stderr = launched
    scenario = "raise_rank1_backward"
    run_dir = _run_dir(output_dir / scenario)
    assert "RANK 1 RAISED at step 3: planted error in backward on rank 1" in stdout[scenario]
    (stall,) = [a for a in _stalls(run_dir) if a["step"] == 3]  # (a slow step on shared cores may be named too)
    assert (stall["kind"], stall["rank"], stall["details"]["pattern"], stall["details"]["ended_job"]) == (
        "rank_desync",
        1,
        "raised",
        False,
    )
    assert stall["details"]["waiting"] == [0, 2, 3, 4, 5, 6, 7]
    assert stall["message"].startswith(
        "Rank 1 raised ValueError: planted error in backward on rank 1 in its backward at step 3; ranks 0, 2–7 "
        "wait in backward (the gradient all-reduce) at step 3. An error on some ranks only"
    ), stall["message"]
    assert "RANK 0 DONE" in stdout[scenario] and "RANK 7 DONE" in stdout[scenario]
    assert load_json(run_dir / "summary.json")["training"]["total_steps"] == 6
    stacks = (run_dir / "stacks-rank1.txt").read_text()
    assert f'stall_job.py", line {_line_of("most=7.0)  # handling it")}' in stacks


def test_a_rank_whose_save_raised_is_named_in_its_save_while_the_others_wait_in_the_all_reduce(launched):
    """Rank 2's ``with tdbg.phase("save"):`` raises after step 1's optimizer step and rank 2 handles the error while
    the others wait in step 2's gradient all-reduce: the phase the error left was put back as it ended (after the
    optimizer step, before step 2's forward), and rank 2 was named there. It is named in its save, at step 1."""
    output_dir, stdout, stderr = launched
    scenario = "raise_rank2_save"
    run_dir = _run_dir(output_dir / scenario)
    assert "RANK 2 RAISED at step 1: planted error in the save on rank 2" in stdout[scenario]
    (stall,) = [a for a in _stalls(run_dir) if a["details"]["pattern"] == "raised"]
    assert (stall["rank"], stall["step"], stall["details"]["waiting"]) == (2, 1, [0, 1, 3, 4, 5, 6, 7])
    assert stall["message"].startswith(
        "Rank 2 raised OSError: planted error in the save on rank 2 in save at step 1; ranks 0–1, 3–7 wait in "
        "backward (the gradient all-reduce) at step 2. An error on some ranks only"
    ), stall["message"]
    assert "RANK 0 DONE" in stdout[scenario] and "RANK 7 DONE" in stdout[scenario]
    stacks = (run_dir / "stacks-rank2.txt").read_text()
    assert f'stall_job.py", line {_line_of("most=7.0)  # handling the save")}' in stacks


def test_rank_skipping_a_step_is_named_and_the_job_ends(launched):
    output_dir, stdout, stderr = launched
    run_dir = _run_dir(output_dir / "skip_rank5")
    (stall,) = _stalls(run_dir)  # saved by the main process before the job ended
    assert (stall["rank"], stall["step"], stall["details"]["pattern"]) == (5, 3, "skipped_step")
    assert stall["message"].startswith(
        "Rank 5 skipped step 3 (no monitor_training_step call for it, so its later collectives pair with the other "
        "ranks' earlier ones); ranks 0–4, 6–7 wait in backward (the gradient all-reduce) at step 5. "
    )
    assert stall["details"]["ended_job"] is True
    # rank 5 left the loop (and closed its debugger: no watcher, no stack); the others ended themselves
    assert "RANK 5 DONE" in stdout["skip_rank5"] and "RANK 0 DONE" not in stdout["skip_rank5"]
    stacks = sorted(p.name for p in run_dir.glob("stacks-rank*.txt"))
    assert stacks == [f"stacks-rank{r}.txt" for r in range(8) if r != 5]
    assert f"exitcode  : {EXIT_CODE}" in stderr
    assert "diffusion-debug: ending this process (exit 75), the job stalled: rank 5 skipped step 3" in stderr


def test_monitor_on_rank0_only_ends_the_job_naming_the_mistake(monitor_rank0_only):
    output_dir, stdout, stderr = monitor_rank0_only
    run_dir = _run_dir(output_dir / "monitor_rank0_only")
    expected = (
        f"monitor_training_step is called on rank 0 only: ranks 1–{LAST} went on to forward without it. Call "
        "monitor_training_step on every rank (it holds a collective), not under `if accelerator.is_main_process:`"
    )
    # rank 0 raised in its first monitor_training_step (it never entered the collective)
    assert stdout.startswith(f"RANK 0 RAISED at step 0: {expected}"), stdout + stderr[-3000:]
    stall = next(a for a in _stalls(run_dir) if a["details"]["pattern"] == "monitor_subset")
    assert (stall["rank"], stall["step"], stall["details"]["ranks"]) == (0, 0, [0])
    assert stall["details"]["waiting"] == list(range(1, ENDING)) and stall["details"]["ended_job"] is True
    assert len(list(run_dir.glob("stacks-rank*.txt"))) == ENDING
    # ranks 1-7 ended themselves (the launcher may stop the last ones before they print)
    assert f"the job stalled: {expected[: expected.index('. Call')]}" in stderr


def test_a_rank_that_left_early_on_uneven_data_is_named_and_the_job_ends(left_early_last_rank):
    output_dir, stdout, stderr = left_early_last_rank
    run_dir = _run_dir(output_dir / "left_early_last_rank")
    (stall,) = _stalls(run_dir)  # saved by the main process before the job ended
    assert (stall["rank"], stall["step"], stall["details"]["pattern"]) == (LAST, 4, "left_early")
    assert stall["message"].startswith(
        f"Rank {LAST} left the training loop (closed its debugger) after step 4; ranks 0–{LAST - 1} wait in backward"
    ), stall["message"]
    assert stall["details"]["waiting"] == list(range(LAST)) and stall["details"]["ended_job"] is True
    assert f"RANK {LAST} DONE" in stdout and "RANK 0 DONE" not in stdout
    # the last rank had closed its debugger (no watcher, no stack); the waiting ranks ended themselves
    stacks = sorted(p.name for p in run_dir.glob("stacks-rank*.txt"))
    assert stacks == [f"stacks-rank{r}.txt" for r in range(LAST)]
    assert f"exitcode  : {EXIT_CODE}" in stderr
