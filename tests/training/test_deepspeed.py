"""Two CPU processes under `torchrun` (DS_ACCELERATOR=cpu, gloo): the tiny diffusers UNet trained by a
raw DeepSpeed ZeRO-2 engine (ZeRO-3 for the ``zero3_`` scenarios; no ZeRO: test_deepspeed_stage0_launch.py), the
engine given to the debugger. ZeRO keeps the gradients in its own partitions (``.grad`` is None): they
are read there, named as the user's parameters. One launch runs the scenarios of deepspeed_job.py one
after the other (the session's, conftest.py's ``deepspeed_job``); the ZeRO-2 stall, which ends the job,
comes last.
Skipped, saying why, where DeepSpeed does not install or import (``pip install 'diffusion-debug[deepspeed]'``)."""

import csv
import json
import math
import re
from pathlib import Path

import pytest

from diffusion_debug.cli import main
from diffusion_debug.record import load_json
from diffusion_debug.testing.launch import first_row_where
from diffusion_debug.training.ranks.summary import WIDTH

pytestmark = pytest.mark.xdist_group("launches")

JOB = Path(__file__).with_name("deepspeed_job.py")
SCENARIOS = (
    "nan_grad_rank1",
    "nan_grad_rank1_before_reduction",
    "nan_grad_rank1_in_rank0_partition",
    "nan_loss_rank0",
    "lr_jump",
    "zero3_nan_grad_rank1_before_reduction",  # its steps 0-11 are ZeRO-3's clean run (a ZeRO-3 launch less)
    "zero3_stall_rank1",
    "fp16_overflow",
    "zero3_fp16_overflow",
    "zero3_nan_batch_rank1",
    "fp16_inf_batch_rank1",
    "fp16_accumulate_inf_last_rank1",  # ZeRO-2, fp16, 2 micro-steps a step: 3 steps (~2 s)
    "stall_before_step_rank1",
    "stall_rank1",
)
DEEPSPEED_JOB_SCENARIOS = SCENARIOS  # what the session's launch of deepspeed_job.py runs for this module
EXIT_CODE = 75  # hangs.watcher.EXIT_CODE: a process ended by a stall verdict


@pytest.fixture(scope="module")
def launched(deepspeed_job) -> tuple[Path, dict[str, str], str]:
    """The output directory, each scenario's stdout lines (prefix removed) and the launch's stderr: the
    session's one launch of deepspeed_job.py (conftest.py)."""
    return deepspeed_job


def _summary(output_dir: Path, scenario: str) -> dict:
    (run_dir,) = (output_dir / scenario).glob("run-*")
    return load_json(run_dir / "summary.json")


def _found(summary: dict) -> list[tuple]:
    return [(a["kind"], a["severity"], a["rank"], a["step"], a["parameter"]) for a in summary["anomalies"]]


def _collectives(out: str) -> dict[tuple[int, int], str]:
    """(rank, step) -> the torch.distributed collectives the debugger called in that monitored step."""
    found = {}
    for line in out.splitlines():
        head, _, names = line.partition(": ")
        words = head.split()
        if words[:1] == ["RANK"] and words[2:4] == ["COLLECTIVES", "step"]:
            found[(int(words[1]), int(words[4]))] = names
    return found


@pytest.mark.parametrize("scenario", ["nan_grad_rank1_before_reduction", "zero3_nan_grad_rank1_before_reduction"])
def test_zero_with_the_check_on_a_clean_step_makes_two_fixed_size_all_reduces(launched, scenario):
    """Each rank's own gradients were checked before ZeRO's reduction (issue 46): the flag rode in the
    step's one exchange of 18 values; the only other collective sums the shards' squares (one value
    per parameter, the weights' too on the steps that read them), as under FSDP2. Steps 0-11 of
    both scenarios are clean (the NaN comes at step 12)."""
    output_dir, stdout, stderr = launched
    called = _collectives(stdout[scenario])
    assert set(called) == {(r, s) for r in (0, 1) for s in range(14)}, stdout[scenario] + stderr[-3000:]
    one, both = f"all_reduce[286],all_reduce[{WIDTH}]", f"all_reduce[572],all_reduce[{WIDTH}]"  # 286 parameters
    expected = {s: both if s % 10 == 0 else one for s in range(12)}  # the weights read at steps 0 and 10
    assert {key: names for key, names in called.items() if key[1] < 12} == {
        (r, s): expected[s] for r in (0, 1) for s in range(12)
    }
    assert WIDTH == 18
    assert _summary(output_dir, scenario)["training"]["pre_reduction_check"] == {"checked": True, "off": []}


def test_zero2_nan_made_on_rank1_before_the_reduction_is_named_on_rank1_and_its_skip_too(launched):
    output_dir, stdout, stderr = launched
    out = stdout["nan_grad_rank1_before_reduction"]
    assert "RANK 0 DONE skipped=1" in out and "RANK 1 DONE skipped=1" in out, out + stderr[-3000:]
    summary = _summary(output_dir, "nan_grad_rank1_before_reduction")
    assert _found(summary) == [
        ("nonfinite", "error", 1, 12, "up_blocks.1.resnets.0.conv2.weight"),
        ("skipped_step", "info", 0, 12, None),
    ]
    assert summary["headline"]["where"] == "model up_blocks.1.resnets.0.conv2.weight, step 12, rank 1"
    nan, skipped = summary["anomalies"]
    assert nan["details"]["reduction"] == {
        "origins": [1],
        "made_here": True,
        "through": "DeepSpeed ZeRO's gradient reduction",
    }
    assert "non-finite in this rank's own gradients before DeepSpeed ZeRO's gradient reduction" in nan["message"]
    assert skipped["details"]["overflow_ranks"] == [1]
    assert "(non-finite gradients of rank 1 before the reduction, " in skipped["message"]


def test_zero2_nan_made_on_rank1_in_rank0_s_partition_is_named_on_rank1_everywhere(
    launched, tmp_path, capsys, monkeypatch
):
    """Rank 1 makes the NaN in a parameter whose reduced gradient ZeRO keeps in rank 0's partition:
    only rank 0 holds it after the reduction. The headline, the terminal, report.html and the export
    name rank 1 (the rank that made it), rank 0's says it received it from rank 1."""
    output_dir, stdout, stderr = launched
    out = stdout["nan_grad_rank1_in_rank0_partition"]
    assert "RANK 0 HOLDS True" in out and "RANK 1 HOLDS False" in out, out  # where the NaN lands: rank 0
    assert "RANK 0 DONE skipped=1" in out and "RANK 1 DONE skipped=1" in out, out + stderr[-3000:]
    (run_dir,) = (output_dir / "nan_grad_rank1_in_rank0_partition").glob("run-*")
    summary = load_json(run_dir / "summary.json")
    parameter, through = "up_blocks.0.resnets.0.conv1.weight", "DeepSpeed ZeRO's gradient reduction"
    assert sorted(_found(summary), key=lambda found: (found[0], found[2])) == [
        ("nonfinite", "error", 0, 12, parameter),
        ("nonfinite", "error", 1, 12, parameter),
        ("skipped_step", "info", 0, 12, None),
    ]
    where = f"model {parameter}, step 12, rank 1"
    assert (summary["headline"]["where"], summary["headline"]["consequences"]["count"]) == (where, 1)
    nan = {a["rank"]: a for a in summary["anomalies"] if a["kind"] == "nonfinite"}
    assert nan[0]["details"]["reduction"] == {"origins": [1], "made_here": False, "through": through}
    assert nan[0]["details"]["follows"] == {"kind": "nonfinite", "rank": 1}
    assert nan[0]["message"] == (
        f"1 gradient(s) hold NaN/Inf (first registered: {parameter}), received through {through} from rank 1, "
        "whose own gradients were non-finite before it."
    )
    assert nan[1]["details"]["reduction"] == {
        "origins": [1],
        "made_here": True,
        "through": through,
        "received_by": [0],
        "found": {"rank": 0, "parameter": parameter, "module": "up_blocks.0.resnets.0.conv1"},
    }
    assert nan[1]["message"].startswith(
        f"This rank's own gradients held NaN/Inf before {through}, which gave them to rank 0 (rank 0 holds 1 "
        f"non-finite gradient(s), first registered {parameter} in module up_blocks.0.resnets.0.conv1; this "
        "rank's own share holds none after it): "
    ), nan[1]["message"]
    assert (
        f"Most important: nonfinite at {where}; 1 of the others follow from it."
        in (run_dir / "report.html").read_text()
    )
    monkeypatch.setenv("COLUMNS", "160")  # the same width, whatever runs the test
    capsys.readouterr()
    assert main(["report", str(run_dir), "--no-html"]) == 0  # in this process: no second import of it all
    terminal = capsys.readouterr().out
    assert first_row_where(terminal) == where, terminal
    rows = [line.split()[:2] for line in terminal.splitlines() if line.startswith(("error ", "info "))]
    assert rows == [["error", "nonfinite"], ["info", "skipped_step"]]  # rank 0's copy is folded under rank 1's
    assert main(["export", str(run_dir), "--out", str(tmp_path)]) == 0
    with open(tmp_path / "anomalies.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row["kind"] == "nonfinite"]
    made = {row["rank"]: json.loads(row["details"])["reduction"]["made_here"] for row in rows}
    assert made == {"0": False, "1": True}


def test_zero2_gradients_read_from_the_partitions_nan_on_rank1_named_exactly(launched):
    output_dir, stdout, stderr = launched
    out = stdout["nan_grad_rank1"]
    assert "RANK 0 DONE skipped=1" in out and "RANK 1 DONE skipped=1" in out, out + stderr[-3000:]
    # the global norm, from each rank's fragments, is DeepSpeed's own (safe_get_full_grad) on both ranks
    for rank in (0, 1):
        line = next(line for line in out.splitlines() if line.startswith(f"RANK {rank} GRAD_NORM"))
        measured, reference = float(line.split()[3]), float(line.split()[5])
        assert measured == pytest.approx(reference, rel=1e-6)
    summary = _summary(output_dir, "nan_grad_rank1")
    # clean for 12 steps: no unwatched "flat partition", no vanishing norm; then exactly the planted NaN
    # on rank 1, and DeepSpeed's overflow skip of that step (an info, once)
    assert _found(summary) == [
        ("nonfinite", "error", 1, 12, "up_blocks.1.resnets.0.conv2.weight"),
        ("skipped_step", "info", 0, 12, None),
    ]
    skipped = summary["anomalies"][1]
    assert skipped["details"]["reason"] == "deepspeed_overflow"
    assert skipped["message"].startswith("The optimizer step 12 was skipped by DeepSpeed's overflow check")
    assert summary["training"]["total_steps"] == 14
    # DeepSpeed's skip is counted as DeepSpeed's, not the GradScaler's
    counts = summary["training"]
    assert (counts["skipped_steps"], counts["skipped_by_deepspeed"], counts["skipped_by_scaler"]) == (1, 1, 0)


def test_zero2_nan_loss_on_rank0_is_the_headline(launched):
    output_dir, stdout, stderr = launched
    summary = _summary(output_dir, "nan_loss_rank0")
    found = _found(summary)
    assert found[0] == ("nonfinite_loss", "error", 0, 4, None), found
    # the NaN gradients of both ranks' partitions follow from it; nothing before step 4
    assert sorted(rank for kind, _, rank, _, _ in found if kind == "nonfinite") == [0, 1]
    assert all(a["details"]["follows"]["rank"] == 0 for a in summary["anomalies"] if a["kind"] == "nonfinite")
    assert all(step == 4 for *_, step, _ in found)
    (run_dir,) = (output_dir / "nan_loss_rank0").glob("run-*")
    headline = "Most important: nonfinite_loss at model, step 4, rank 0; 2 of the others follow from it."
    assert headline in (run_dir / "report.html").read_text()


def test_zero2_lr_jump_at_step_10_is_recorded_as_the_headline(launched):
    output_dir, stdout, stderr = launched
    summary = _summary(output_dir, "lr_jump")
    first = summary["anomalies"][0]
    assert (first["kind"], first["step"]) == ("lr_spike", 10)
    assert first["message"].startswith("The learning rate jumped from 0.0001 to 1 (x1e+04) at step 10")
    assert all(a["step"] >= 10 for a in summary["anomalies"])


def test_zero2_rank1_stalled_at_step_6_is_named_and_the_job_ends(launched):
    output_dir, stdout, stderr = launched
    (run_dir,) = (output_dir / "stall_rank1").glob("run-*")
    anomalies = load_json(run_dir / "summary.json")["anomalies"]
    # on two shared cores a slow step may be named too (a rank did wait 3 s): the planted one is at step 6
    (stall,) = [a for a in anomalies if a["details"].get("stall") and a["step"] == 6]
    assert (stall["kind"], stall["rank"], stall["details"]["ended_job"]) == ("rank_desync", 1, True)
    waiting = "rank 0 waits in backward (DeepSpeed ZeRO's gradient reduction) at step 6"
    assert waiting in stall["message"], stall["message"]
    # both ranks ended by the verdict, with their stacks: rank 1 in its sleep, rank 0 in ZeRO's reduce
    assert "RANK 0 DONE" not in stdout["stall_rank1"] and f"exitcode  : {EXIT_CODE}" in stderr
    job = JOB.read_text().splitlines()
    sleep_line = next(n for n, line in enumerate(job, 1) if "time.sleep(60.0)" in line)
    assert f'deepspeed_job.py", line {sleep_line}' in (run_dir / "stacks-rank1.txt").read_text()
    backward_line = next(n for n, line in enumerate(job, 1) if "engine.backward(loss)" in line)
    assert f'deepspeed_job.py", line {backward_line}' in (run_dir / "stacks-rank0.txt").read_text()


def test_zero3_nan_made_on_rank1_before_the_reduction_is_named_on_rank1_and_the_clean_steps_are_quiet(launched):
    """Steps 0-11 are ZeRO-3's clean run: nothing is found before step 12, and the norm of step 1 is
    DeepSpeed's own."""
    output_dir, stdout, stderr = launched
    out = stdout["zero3_nan_grad_rank1_before_reduction"]
    assert "RANK 0 DONE skipped=1" in out and "RANK 1 DONE skipped=1" in out, out + stderr[-3000:]
    # every parameter partitioned over both ranks (ds_tensor): the norm of the partitions is DeepSpeed's own
    for rank in (0, 1):
        line = next(line for line in out.splitlines() if line.startswith(f"RANK {rank} GRAD_NORM"))
        measured, reference = float(line.split()[3]), float(line.split()[5])
        assert measured == pytest.approx(reference, rel=1e-6)
    summary = _summary(output_dir, "zero3_nan_grad_rank1_before_reduction")
    assert summary["training"]["total_steps"] == 14
    # ZeRO-3 partitions every parameter over both ranks: both hold the NaN after the reduce-scatter; the
    # list is exact: quiet before step 12 (ZeRO-3's clean steps) and after it
    parameter = "up_blocks.1.resnets.0.conv2.weight"
    assert _found(summary) == [
        ("nonfinite", "error", 0, 12, parameter),
        ("nonfinite", "error", 1, 12, parameter),
        ("skipped_step", "info", 0, 12, None),
    ]
    assert summary["headline"]["kind"] == "nonfinite"
    assert summary["headline"]["where"] == f"model {parameter}, step 12, rank 1"
    received, made, skipped = summary["anomalies"]
    through = "DeepSpeed ZeRO's gradient reduction"
    assert made["details"]["reduction"] == {"origins": [1], "made_here": True, "through": through}
    assert received["details"]["reduction"] == {"origins": [1], "made_here": False, "through": through}
    assert f"non-finite in this rank's own gradients before {through}" in made["message"]
    assert received["message"] == (
        f"1 gradient(s) hold NaN/Inf (first registered: {parameter}), received through {through} "
        "from rank 1, whose own gradients were non-finite before it."
    )
    assert skipped["details"]["overflow_ranks"] == [1]


def test_zero3_rank1_stalled_at_step_6_is_named_and_the_ranks_go_on(launched):
    output_dir, stdout, stderr = launched
    out = stdout["zero3_stall_rank1"]
    # stall_action "wait": named while rank 1 sleeps, then both ranks finish
    assert "RANK 0 DONE skipped=0" in out and "RANK 1 DONE skipped=0" in out, out + stderr[-3000:]
    (run_dir,) = (output_dir / "zero3_stall_rank1").glob("run-*")
    summary = load_json(run_dir / "summary.json")
    # on two shared cores a slow step may be named too (a rank did wait 3 s): the planted one is at step 6
    (stall,) = [a for a in summary["anomalies"] if a["details"].get("stall") and a["step"] == 6]
    assert (stall["kind"], stall["rank"], stall["details"]["ended_job"]) == ("rank_desync", 1, False)
    assert stall["message"].startswith(
        "Rank 1 is in the loop after its optimizer step, before the forward at step 6; rank 0 waits in backward"
    ), stall["message"]
    assert summary["training"]["total_steps"] == 8
    job = JOB.read_text().splitlines()
    sleep_line = next(n for n, line in enumerate(job, 1) if "sleep_until_stall_named(tdbg" in line)
    assert f'deepspeed_job.py", line {sleep_line}' in (run_dir / "stacks-rank1.txt").read_text()


@pytest.mark.parametrize(
    "scenario, severity",
    [("zero3_nan_batch_rank1", "error"), ("fp16_inf_batch_rank1", "info")],
    ids=["zero3-nan", "zero2-fp16-inf"],
)
def test_zero_a_bad_batch_on_rank1_is_named_on_rank1_and_so_is_deepspeed_s_skip(launched, scenario, severity):
    """Rank 1's batch holds a NaN (ZeRO-3) or an Inf (ZeRO-2 in fp16, DeepSpeed's loss scale) at step 2: its
    loss is the headline, every rank's gradients (ZeRO's reduction gave rank 0 rank 1's NaN) follow it, and
    DeepSpeed's skip of the step names rank 1's gradients. In fp16 the gradients are an overflow DeepSpeed's
    loss scaler handles (infos); only the loss, rank 1's, is an error."""
    output_dir, stdout, stderr = launched
    out = stdout[scenario]
    assert "RANK 0 DONE skipped=1" in out and "RANK 1 DONE skipped=1" in out, out + stderr[-3000:]
    summary = _summary(output_dir, scenario)
    assert (summary["headline"]["kind"], summary["headline"]["where"]) == ("nonfinite_loss", "model, step 2, rank 1")
    found = [(a["kind"], a["severity"], a["rank"], a["step"]) for a in summary["anomalies"]]
    assert found == [
        ("nonfinite_loss", "error", 1, 2),
        ("nonfinite", severity, 0, 2),
        ("nonfinite", severity, 1, 2),
        ("skipped_step", "info", 0, 2),
    ]
    loss, received, made, skipped = summary["anomalies"]
    through = "DeepSpeed ZeRO's gradient reduction"
    assert received["details"]["reduction"] == {"origins": [1], "made_here": False, "through": through}
    assert made["details"]["reduction"] == {"origins": [1], "made_here": True, "through": through}
    assert received["details"]["follows"] == made["details"]["follows"] == {"kind": "nonfinite_loss", "rank": 1}
    assert (skipped["details"]["reason"], skipped["details"]["overflow_ranks"]) == ("deepspeed_overflow", [1])
    assert "(non-finite gradients of rank 1 before the reduction" in skipped["message"]


def test_zero2_fp16_accumulating_a_skip_of_the_last_step_is_in_the_report_made_before_close(launched):
    """ZeRO-2 in fp16 with ``gradient_accumulation_steps`` 2, each micro-step monitored: the clean steps are
    quiet, each norm DeepSpeed's own (``get_global_grad_norm``, unscaled); rank 1's Inf in the first micro-step
    of the last step makes DeepSpeed's loss scaler skip it, and the report made after that ``engine.step()``,
    before close, says so: a ``skipped_step``, counted (DeepSpeed's ``skipped_steps`` 1), the gradients infos.
    Before, a report judged only a GradScaler's last step (only its state told that it had run): the summary
    saved counted no skip of a run whose last step DeepSpeed skipped."""
    output_dir, stdout, stderr = launched
    scenario = "fp16_accumulate_inf_last_rank1"
    out = stdout[scenario]
    assert "RANK 0 DONE skipped=1" in out and "RANK 1 DONE skipped=1" in out, out + stderr[-3000:]
    norms = re.findall(r"RANK (\d) FP16 step (\d): (\S+) (\S+) (\d+)", out)
    assert sorted((rank, step) for rank, step, *_ in norms) == [(r, s) for r in "01" for s in "012"], out
    for _, step, measured, theirs, skipped in norms:
        if step != "2":  # a float32 sum of fp16 gradients unscaled: rel 1e-5
            assert float(measured) == pytest.approx(float(theirs), rel=1e-5) and skipped == "0", norms
    summary = _summary(output_dir, scenario)
    training = summary["training"]
    assert (training["total_steps"], training["accumulating_micro_steps"], training["skipped_by_deepspeed"]) == (
        3,
        3,
        1,
    )
    found = [(a["kind"], a["severity"], a["rank"], a["step"]) for a in summary["anomalies"]]
    assert found == [
        ("nonfinite_loss", "error", 1, 2),
        ("nonfinite", "info", 0, 2),
        ("nonfinite", "info", 1, 2),
        ("skipped_step", "info", 0, 2),
    ]
    skipped = summary["anomalies"][-1]
    assert (skipped["details"]["reason"], skipped["details"]["overflow_ranks"]) == ("deepspeed_overflow", [1])
    assert summary["headline"]["where"] == "model, step 2, rank 1"


def test_zero2_rank1_held_after_its_monitor_is_named_while_rank0_waits_in_the_optimizer_step(launched):
    """After step 6's monitor rank 1 sleeps (a checkpoint saved on one rank) while rank 0 is in
    ``engine.step()``, whose norm and overflow all-reduce wait for rank 1: both ranks read "after step 6's
    monitor", and nothing was named until the process group's watchdog. Rank 1 is named, rank 0 waiting in
    ZeRO's optimizer step; then rank 1 goes on (``stall_action`` "wait") and both finish."""
    output_dir, stdout, stderr = launched
    out = stdout["stall_before_step_rank1"]
    assert "RANK 0 DONE skipped=0" in out and "RANK 1 DONE skipped=0" in out, out + stderr[-3000:]
    (run_dir,) = (output_dir / "stall_before_step_rank1").glob("run-*")
    summary = load_json(run_dir / "summary.json")
    # on two shared cores a slow step may be named too (a rank did wait 3 s): the planted one is at step 6
    (stall,) = [a for a in summary["anomalies"] if a["details"].get("stall") and a["step"] == 6]
    assert (stall["kind"], stall["rank"], stall["details"]["waiting"], stall["details"]["ended_job"]) == (
        "rank_desync",
        1,
        [0],
        False,
    )
    assert stall["message"].startswith(
        "Rank 1 is after step 6's monitor, before its optimizer step (a save, a log or a wait of its own); rank 0 "
        "waits in the optimizer step (DeepSpeed ZeRO's gradient norm and overflow all-reduce, then its parameter "
        "all-gather) at step 6. "
    ), stall["message"]
    assert summary["training"]["total_steps"] == 8
    job = JOB.read_text().splitlines()
    step_line = next(n for n, line in enumerate(job, 1) if line.strip() == "engine.step()")
    assert f'deepspeed_job.py", line {step_line}' in (run_dir / "stacks-rank0.txt").read_text()


@pytest.mark.parametrize("scenario", ["fp16_overflow", "zero3_fp16_overflow"])
def test_zero_fp16_steps_the_loss_scale_overflows_are_skipped_steps_and_the_norms_are_deepspeeds_unscaled(
    launched, scenario
):
    """fp16 with DeepSpeed's dynamic loss scale (ZeRO-2 and ZeRO-3): steps 0 and 1 overflow while the
    scale settles and DeepSpeed skips them. They are skipped steps and overflows its loss scaler
    handles (infos), nothing else is found; each clean step's norm is DeepSpeed's own, unscaled.
    Before, the debugger read the fragments as true gradients: each overflow was a ``nonfinite``
    error (the headline of a healthy run) and each clean norm 2**18 times DeepSpeed's."""
    output_dir, stdout, stderr = launched
    out = stdout[scenario]
    rows = {}
    for line in out.splitlines():
        words = line.split()
        if words[2:3] == ["FP16"]:
            rows[int(words[1]), int(words[4].rstrip(":"))] = (float(words[5]), float(words[6]), int(words[7]))
    assert sorted(rows) == [(r, s) for r in (0, 1) for s in range(4)], out + stderr[-3000:]
    for (rank, step), (measured, deepspeed, skipped) in rows.items():
        assert skipped == min(step + 1, 2)  # DeepSpeed skipped steps 0 and 1
        if step < 2:
            assert deepspeed == math.inf
        else:
            assert measured == pytest.approx(deepspeed, rel=1e-5), (rank, step)
    summary = _summary(output_dir, scenario)
    assert {a["severity"] for a in summary["anomalies"]} == {"info"}, _found(summary)
    assert {a["kind"] for a in summary["anomalies"]} == {"nonfinite", "skipped_step"}
    assert all(a["step"] < 2 for a in summary["anomalies"])
    assert all(
        a["details"]["reason"] == "deepspeed_overflow" for a in summary["anomalies"] if a["kind"] == "skipped_step"
    )
    for a in summary["anomalies"]:
        if a["kind"] == "nonfinite" and a["details"]["reduction"]["made_here"]:
            assert a["message"].endswith("DeepSpeed's loss scaler will skip this optimizer step and lower the scale.")
    counts = summary["training"]
    assert (counts["total_steps"], counts["skipped_steps"], counts["skipped_by_deepspeed"]) == (4, 2, 2)
