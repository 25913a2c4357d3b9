"""FSDP2 on two CPU processes (``fully_shard`` under ``torchrun``, gloo): a tiny diffusers UNet
sharded per block, its planted faults named at their origin, stalls named and ended by policy;
and FSDP1 (``FullyShardedDataParallel``, ``use_orig_params`` True and False) in the same launch.
One launch (each start costs seconds): [nan_grad_rank1, nan_grad_rank1_before_reduction,
mixed_bf16_nan_grad_rank0_before_reduction, nan_loss_rank0, lr_jump_and_wait, fsdp1_nan_grad_rank1,
fsdp1_flat_nan_grad_rank1, embedding_new_row, nan_batch_rank1, raise_rank1_forward, accumulate_checkpointed_nan_rank1,
sync_off_forever, stall_rank1], the last ending
the job (see fsdp_job.py). The clean check is the steps before each planted fault: no anomaly there."""

import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from diffusion_debug.record import load_json
from diffusion_debug.testing.features import FSDP2_ON_CPU
from diffusion_debug.testing.launch import by_scenario, cpu_launch_env, free_port, run_launch

# Several processes per launch: under `pytest -n 2` the launches run one at a time on one worker.
pytestmark = [
    pytest.mark.xdist_group("launches"),
    pytest.mark.skipif(not FSDP2_ON_CPU, reason="this torch's FSDP2 needs CUDA streams"),
]

JOB = Path(__file__).with_name("fsdp_job.py")
ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = (
    "nan_grad_rank1",
    "nan_grad_rank1_before_reduction",
    "mixed_bf16_nan_grad_rank0_before_reduction",
    "nan_loss_rank0",
    "lr_jump_and_wait",
    "fsdp1_nan_grad_rank1",
    "fsdp1_flat_nan_grad_rank1",
    "embedding_new_row",
    "nan_batch_rank1",
    "raise_rank1_forward",
    "accumulate_checkpointed_nan_rank1",
    "sync_off_forever",
    "stall_rank1",
)
STALL_TIMEOUT = 4.0  # fsdp_job.STALL_TIMEOUT
EXIT_CODE = 75  # hangs.watcher.EXIT_CODE
TIMEOUT = 480  # seconds for the launch (two processes on two shared cores)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The output directory, each scenario's stdout lines (prefix removed), and stderr."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python")
    output_dir = tmp_path_factory.mktemp("fsdp")
    cmd = [torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()), str(JOB), str(output_dir)]
    done = run_launch([*cmd, *SCENARIOS], cpu_launch_env(ROOT), output_dir, TIMEOUT)  # GPU hidden: gloo on CPU
    if done.returncode is None:
        pytest.fail("the FSDP2 job hung")
    return output_dir, by_scenario(done.stdout, SCENARIOS), done.stderr


def _summary(output_dir: Path, scenario: str) -> dict:
    (run_dir,) = (output_dir / scenario).glob("run-*")
    return load_json(run_dir / "summary.json")


def _finished(stdout: dict, scenario: str) -> None:
    assert "RANK 0 DONE" in stdout[scenario] and "RANK 1 DONE" in stdout[scenario], stdout


def test_nan_gradient_on_rank1_is_named_at_its_parameter_alone(launched):
    output_dir, stdout, stderr = launched
    _finished(stdout, "nan_grad_rank1")
    anomalies = _summary(output_dir, "nan_grad_rank1")["anomalies"]
    assert [a for a in anomalies if a["step"] < 12] == []  # the clean steps are quiet
    # only rank 1 holds the NaN: rank 0's clean shard gets no "gradient norm overflowed" warning
    (nan,) = [a for a in anomalies if a["step"] == 12]
    assert (nan["kind"], nan["parameter"], nan["module"], nan["rank"]) == ("nonfinite", "conv_in.weight", "conv_in", 1)
    assert nan["message"].startswith("1 gradient(s) hold NaN/Inf, first registered conv_in.weight in module conv_in")
    # step 13 (the NaN applied by the update, all-gathered into both ranks' forward): every NaN loss
    # follows step 12's, and no parameter is called first in a forward order FSDP2 does not keep
    later = [a for a in anomalies if a["step"] == 13]
    assert {(a["kind"], a["rank"]) for a in later if a["kind"] == "nonfinite_loss"} == {
        ("nonfinite_loss", 0),
        ("nonfinite_loss", 1),
    }
    for a in later:
        assert a["details"].get("cause", {}).get("step") == 12 or "follows" in a["details"], a
        assert "forward order" not in a["message"]
    assert _summary(output_dir, "nan_grad_rank1")["headline"]["where"] == "model conv_in.weight, step 12, rank 1"


def test_nan_gradient_made_on_rank1_before_the_reduce_scatter_is_named_on_rank1(launched):
    """Rank 1's own gradient of conv_in is NaN before the reduce-scatter gives both ranks NaN
    shards: the pre-reduction check names rank 1; rank 0's anomaly says it received it."""
    output_dir, stdout, stderr = launched
    _finished(stdout, "nan_grad_rank1_before_reduction")
    summary = _summary(output_dir, "nan_grad_rank1_before_reduction")
    assert [a for a in summary["anomalies"] if a["step"] < 12] == []  # the clean steps are quiet
    headline = summary["headline"]
    assert (headline["kind"], headline["where"]) == ("nonfinite", "model conv_in.weight, step 12, rank 1")
    assert "non-finite in this rank's own gradients before the gradient reduce-scatter" in headline["message"]
    at12 = [a for a in summary["anomalies"] if (a["kind"], a["step"]) == ("nonfinite", 12)]
    (received,) = [a for a in at12 if a["rank"] == 0]
    assert received["details"]["reduction"] == {
        "origins": [1],
        "made_here": False,
        "through": "the gradient reduce-scatter",
    }
    assert "received through the gradient reduce-scatter from rank 1" in received["message"]
    # step 13: both ranks' weights NaN since step 12's update; each rank's NaN loss and gradients follow rank 1's
    _consequences_point_at(summary, 13, origin=("model conv_in.weight", 12, 1))


def test_fsdp2_in_bf16_with_float32_reduction_and_no_reshard_names_rank0s_nan_at_its_module(launched):
    """``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``, ``reshard_after_forward=False``:
    the steps before the NaN are quiet, and rank 0's own NaN gradient of ``conv_in`` at step 2 (in
    bfloat16, before the float32 reduce-scatter) is named there, rank 1 told it received it; step 3's
    NaN losses and gradients on both ranks follow rank 0's (the higher rank received it: the other
    order of the ranks than rank 1's NaN at step 12)."""
    output_dir, stdout, stderr = launched
    scenario = "mixed_bf16_nan_grad_rank0_before_reduction"
    _finished(stdout, scenario)
    summary = _summary(output_dir, scenario)
    assert [a for a in summary["anomalies"] if a["step"] < 2] == []
    assert (summary["headline"]["kind"], summary["headline"]["where"]) == (
        "nonfinite",
        "model conv_in.weight, step 2, rank 0",
    )
    at2 = {a["rank"]: a for a in summary["anomalies"] if (a["kind"], a["step"]) == ("nonfinite", 2)}
    assert at2[0]["module"] == "conv_in" and at2[0]["details"]["reduction"]["made_here"]
    assert at2[1]["details"]["reduction"]["made_here"] is False
    assert at2[1]["details"]["follows"] == {"kind": "nonfinite", "rank": 0}
    _consequences_point_at(summary, 3, origin=("model conv_in.weight", 2, 0))


def _consequences_point_at(summary: dict, step: int, origin: tuple[str, int, int]) -> None:
    """Every anomaly of ``step`` (the last) on every rank follows the NaN gradients made at ``origin``
    (place, step, rank): each rank's NaN loss names them as its cause, the rest follow a NaN loss; the
    headline is that origin, and counts every other anomaly of the run as following from it."""
    later = [a for a in summary["anomalies"] if a["step"] == step]
    losses = {a["rank"]: a for a in later if a["kind"] == "nonfinite_loss"}
    assert sorted(losses) == [0, 1], later
    for a in later:
        follows = a["details"].get("follows", {})
        cause = a["details"].get("cause") or losses[follows["rank"]]["details"]["cause"]
        assert ((cause["place"], cause["step"], cause["rank"]), follows.get("kind")) == (
            origin,
            "nonfinite_loss" if follows else None,
        ), a
    where, others = "{}, step {}, rank {}".format(*origin), len(summary["anomalies"]) - 1
    assert (summary["headline"]["where"], summary["headline"]["consequences"]["count"]) == (where, others)


def test_nan_loss_on_rank0_is_named(launched):
    output_dir, stdout, stderr = launched
    _finished(stdout, "nan_loss_rank0")
    summary = _summary(output_dir, "nan_loss_rank0")
    assert [a for a in summary["anomalies"] if a["step"] < 4] == []
    assert (summary["headline"]["kind"], summary["headline"]["where"]) == ("nonfinite_loss", "model, step 4, rank 0")
    assert summary["headline"]["message"].startswith("The loss is nan at step 4 on rank 0")


def test_stall_before_backward_is_named_then_training_goes_on_and_the_lr_jump_is_recorded(launched):
    output_dir, stdout, stderr = launched
    _finished(stdout, "lr_jump_and_wait")  # stall_action="wait": both ranks went on to the end
    summary = _summary(output_dir, "lr_jump_and_wait")
    (stall,) = [a for a in summary["anomalies"] if a["kind"] == "rank_desync"]
    assert (stall["rank"], stall["step"], stall["details"]["ended_job"]) == (1, 4, False)
    assert stall["message"].startswith(
        "Rank 1 is in forward at step 4; rank 0 waits in backward (FSDP2's parameter all-gather or gradient "
        "reduce-scatter) at step 4. "
    )
    assert [a for a in summary["anomalies"] if a["step"] < 10 and a is not stall] == []
    jump = [a for a in summary["anomalies"] if a["kind"] == "lr_spike" and a["step"] == 10]
    assert [a["message"][:58] for a in jump] == ["The learning rate jumped from 0.0001 to 1 (x1e+04) at step"]
    assert summary["training"]["total_steps"] == 12


def test_fsdp1_with_original_parameters_is_quiet_clean_and_names_a_nan_gradient_at_its_parameter_and_rank(launched):
    """FSDP1 with ``use_orig_params=True``: each parameter a view of this rank's shard of a flat
    parameter, the same object from step to step. The replaced-parameter check stays on and
    never finds one replaced; the clean steps are quiet, the rank checks at steps 3 and 7 among
    them (the parameters' checksums are not compared: each rank's are its shards', and they
    called the ranks diverged); rank 1's NaN in its shard of ``conv_out.weight`` at step 6 is named
    there, under the model's own name (not ``named_parameters()``'s, FSDP1's and the checkpoint
    wrapper's ``_fsdp_wrapped_module.conv_out._checkpoint_wrapped_module.weight``), and
    each rank's NaN loss after it follows it. Each clean step's gradient norm is the whole
    model's on both ranks (the shards' squares summed over the ranks, as FSDP2's), FSDP1's own
    ``clip_grad_norm_``; they were each rank's shards' (0.15 and 0.46 for a whole 0.49 on a small
    model). Rank 0's NaN loss at step 2, monitored with ``closure=``: named, with no replay (FSDP1's
    forward runs on views of its unsharded flat parameters, not the watched ones: a backward into
    those ran nothing, and the replay said "stayed finite" of a NaN loss), and the steps after it
    are quiet (its update left out, as a loop that skips a NaN step does: step 6's NaN gradient
    is its own origin, not a consequence of step 2's); a stall in backward names FSDP1, not
    DDP's all-reduce, and the pre-reduction check says FSDP1 has none."""
    output_dir, stdout, stderr = launched
    _finished(stdout, "fsdp1_nan_grad_rank1")
    out = stdout["fsdp1_nan_grad_rank1"]
    checks = re.findall(r"RANK (\d) SWAP CHECK: (\d+) refreshes, (\d+) entries, (\d+) found", out)
    assert sorted(rank for rank, *_ in checks) == ["0", "1"] and {r for _, r, _, _ in checks} == {"0"}, checks
    assert len({n for _, _, n, _ in checks}) == 1 and int(checks[0][2]) > 0, checks  # the check on, alike
    # every entry found: the check walks FSDP1's modules by their own names, not the ones reported
    assert all(found == entries for _, _, entries, found in checks), checks
    summary = _summary(output_dir, "fsdp1_nan_grad_rank1")
    assert [a for a in summary["anomalies"] if a["step"] < 6 and a["step"] != 2] == []
    assert not [a for a in summary["anomalies"] if a["kind"] == "rank_desync"]
    # step 2: rank 0's NaN loss, not replayed (every rank's gradients NaN after the reduce-scatter follow it)
    at2 = [a for a in summary["anomalies"] if a["step"] == 2]
    (loss,) = [a for a in at2 if a["kind"] == "nonfinite_loss"]
    assert (loss["rank"], loss["message"][:35]) == (0, "The loss is nan at step 2 on rank 0")
    # not "pass closure= to name the op": it was passed, and FSDP1 replays none
    assert loss["details"]["sharded"] == "fsdp1" and loss["message"].endswith(
        "(closure= replays nothing under FSDP1: to name the op, rerun this batch without it, on one process or under "
        "DDP, with closure=), or lower the learning rate."
    )
    assert all("localization" not in a["details"] for a in at2), at2
    assert all(a["details"]["follows"]["kind"] == "nonfinite_loss" for a in at2 if a is not loss), at2
    (nan,) = [a for a in summary["anomalies"] if a["step"] == 6]
    assert (nan["kind"], nan["parameter"], nan["module"], nan["rank"]) == (
        "nonfinite",
        "conv_out.weight",
        "conv_out",
        1,
    )
    assert nan["message"].startswith("1 gradient(s) hold NaN/Inf, first registered conv_out.weight in module conv_out")
    assert "cause" not in nan["details"]  # not step 2's NaN gradients: that update was left out, step 3 was finite
    assert (summary["headline"]["kind"], summary["headline"]["where"]) == ("nonfinite_loss", "model, step 2, rank 0")
    # step 7: the NaN applied by rank 1's update is in both ranks' forward (FSDP1 all-gathers it)
    losses = [a for a in summary["anomalies"] if (a["kind"], a["step"]) == ("nonfinite_loss", 7)]
    assert sorted(a["rank"] for a in losses) == [0, 1]
    assert all(a["details"]["cause"]["step"] == 6 for a in losses), losses
    # the whole model's gradient norm on both ranks, FSDP1's own (its float32 sum: rel 1e-5)
    norms = {}
    for rank, step, payload in re.findall(r"RANK (\d) NORM step (\d+): (.*)", out):
        norms[int(step), int(rank)] = json.loads(payload)
    assert sorted(norms) == [(s, r) for s in (0, 1, 3, 4, 5) for r in (0, 1)], out
    for step in (0, 1, 3, 4, 5):
        ours, theirs = norms[step, 0], norms[step, 1]
        assert ours["measured"] == theirs["measured"] and ours["reference"] == theirs["reference"]
        assert ours["measured"] == pytest.approx(ours["reference"], rel=1e-5)
        assert math.isfinite(ours["loss"]) and ours["loss"] != theirs["loss"]  # each rank its own batch
    engines = re.findall(r"RANK (\d) ENGINE (\w+): (.*)", out)
    assert sorted(engines) == [
        (
            str(rank),
            "fsdp1",
            "rank 0 is in validation at step 2; rank 1 waits in backward (FSDP1's "
            "(FullyShardedDataParallel) parameter all-gather or gradient reduce-scatter) at step 3",
        )
        for rank in (0, 1)
    ]
    # no pre-reduction check under FSDP1, said as FSDP1's (a NaN's rank is then not named from it)
    checked = [json.loads(c) for c in re.findall(r"RANK \d PRE-REDUCTION (.*)", out)]
    off = "FSDP1's (FullyShardedDataParallel) gradients are not checked before its gradient reduce-scatter: "
    assert checked == [{"checked": False, "off": [off + "the rank that made a NaN is not known"]}] * 2, checked


def test_fsdp1_with_flat_parameters_names_a_nan_gradient_at_the_users_parameter_and_rank(launched):
    """FSDP1 with ``use_orig_params=False`` (its default): the model's parameters are each unit's
    ``FlatParameter``. The clean steps are quiet, each norm FSDP1's own ``clip_grad_norm_``; rank 1's
    NaN in its shard of ``down_blocks.1``'s flat parameter, in its piece of
    ``resnets.0.conv2.weight``, is named at that parameter and module, step 4, rank 1, as under
    ``use_orig_params=True``; the consequences at step 5 name a parameter of the model too, and so
    does rank 1's NaN loss the weights it finds NaN. Before, every NaN was named
    ``down_blocks.1._flat_param`` (``_flat_param`` "in module (root)" for the root's), a name the
    user never wrote."""
    output_dir, stdout, stderr = launched
    scenario = "fsdp1_flat_nan_grad_rank1"
    _finished(stdout, scenario)
    out = stdout[scenario]
    assert "RANK 1 PIECE 0" not in out  # rank 1's shard holds a piece of the parameter
    norms = {}
    for rank, step, payload in re.findall(r"RANK (\d) NORM step (\d+): (.*)", out):
        norms[int(step), int(rank)] = json.loads(payload)
    assert sorted(norms) == [(s, r) for s in range(4) for r in (0, 1)], out
    assert all(n["measured"] == pytest.approx(n["reference"], rel=1e-5) for n in norms.values()), norms
    summary = _summary(output_dir, scenario)
    assert [a for a in summary["anomalies"] if a["step"] < 4] == []
    (nan,) = [a for a in summary["anomalies"] if a["step"] == 4]
    parameter = "down_blocks.1.resnets.0.conv2.weight"
    assert (nan["kind"], nan["parameter"], nan["module"], nan["rank"]) == ("nonfinite", parameter, parameter[:-7], 1)
    assert nan["details"]["flat_parameter"] == "down_blocks.1._flat_param"
    assert nan["message"].startswith(
        f"1 gradient(s) hold NaN/Inf, first registered {parameter} in module {parameter[:-7]}"
    )
    assert summary["headline"]["where"] == f"model {parameter}, step 4, rank 1"
    later = [a for a in summary["anomalies"] if a["kind"] == "nonfinite" and a["step"] == 5]
    assert later and all(not a["parameter"].endswith("_flat_param") for a in later), later
    # rank 1's NaN loss at step 5: its weights went NaN at that parameter (its shard holds the NaN)
    (loss,) = [a for a in summary["anomalies"] if (a["kind"], a["step"], a["rank"]) == ("nonfinite_loss", 5, 1)]
    assert f"(1 parameter(s) hold NaN/Inf, first {parameter})" in loss["message"], loss["message"]


def test_a_shard_that_never_moves_while_another_ranks_does_is_no_stall_and_a_run_that_stops_learning_is(launched):
    """Textual inversion under FSDP2: the table's new row, in rank 1's shard, is the only one trained and
    every other row put back after each step, so rank 0's shard never moves; until step 5 the run learns,
    and no rank says ``not_learning`` (rank 0 did at step 5, from its own shard: the updates of steps 0-4).
    From step 5 on the new row is put back too: the updates of steps 6-14 (read at steps 7-10 and 15; the
    sketch's schedule) move nothing on any rank, and both ranks say so at step 15, rank 0's the head, each
    naming what its optimizer's step received: its shard's gradients, undone after the step."""
    output_dir, stdout, stderr = launched
    _finished(stdout, "embedding_new_row")
    summary = _summary(output_dir, "embedding_new_row")
    found = [(a["kind"], a["step"], a["rank"]) for a in summary["anomalies"]]
    assert found == [("not_learning", 15, 0), ("not_learning", 15, 1)], summary["anomalies"]
    for a in summary["anomalies"]:
        details = a["details"]
        assert (details["first_step"], details["last_step"], details["updates"]) == (6, 14, 5), a
        # plain SGD keeps no state: what its step received tells it (every rank's rows got their gradients,
        # and were put back after the step), not "gradients cleared"
        assert (details["reason"], details["cleared_at_step"]) == ("undone_after_step", 0), a
        assert details["grad_norm_at_step"] > 0, a
    assert summary["anomalies"][0]["details"]["also_on_ranks"] == [1]
    assert summary["headline"]["where"] == "optimizer, step 15, rank 0"


def test_nan_in_rank1s_batch_is_named_on_rank1_though_the_reduce_scatter_gives_both_ranks_nan_shards(launched):
    """Rank 1's batch (``inputs=``) holds a NaN at step 2: its loss and its own gradients are NaN, and the
    reduce-scatter gives both ranks NaN shards. The batch of rank 1 is the headline, rank 0's gradients say
    they received them from rank 1, and step 3's NaN (the update applied it) follows it on both ranks."""
    output_dir, stdout, stderr = launched
    _finished(stdout, "nan_batch_rank1")
    summary = _summary(output_dir, "nan_batch_rank1")
    assert [a for a in summary["anomalies"] if a["step"] < 2] == []
    headline = summary["headline"]
    assert (headline["kind"], headline["where"]) == ("nonfinite_input", 'input inputs["latents"], step 2, rank 1')
    at2 = [(a["kind"], a["rank"]) for a in summary["anomalies"] if a["step"] == 2]
    assert at2 == [("nonfinite_input", 1), ("nonfinite_loss", 1), ("nonfinite", 0), ("nonfinite", 1)], at2
    grads = {a["rank"]: a["details"] for a in summary["anomalies"] if (a["kind"], a["step"]) == ("nonfinite", 2)}
    through = "the gradient reduce-scatter"
    assert grads[0]["reduction"] == {"origins": [1], "made_here": False, "through": through}
    assert grads[1]["reduction"] == {"origins": [1], "made_here": True, "through": through}
    later = [a for a in summary["anomalies"] if a["step"] == 3]
    assert {a["rank"] for a in later} == {0, 1}
    assert headline["consequences"]["count"] == len(summary["anomalies"]) - 1


def test_a_rank_whose_forward_raised_is_named_with_its_error_while_the_other_waits_in_the_same_forward(launched):
    """Rank 1's forward raises at step 3 (``conv_in``, after the root's all-gather) and rank 1 catches it,
    while rank 0 waits in ``down_blocks.0``'s all-gather, in the same forward: both ranks read "forward at
    step 3", and nothing was named until the process group's watchdog. Rank 1 is named, with its error;
    then it runs the forward again and both go on."""
    output_dir, stdout, stderr = launched
    scenario = "raise_rank1_forward"
    _finished(stdout, scenario)
    assert "RANK 1 RAISED at step 3: planted bad batch on rank 1" in stdout[scenario]
    (run_dir,) = (output_dir / scenario).glob("run-*")
    summary = load_json(run_dir / "summary.json")
    # on two shared cores a slow step may be named too (a rank did wait 4 s): the planted one is at step 3
    (stall,) = [a for a in summary["anomalies"] if a["details"].get("stall") and a["step"] == 3]
    assert (stall["kind"], stall["rank"], stall["details"]["pattern"], stall["details"]["ended_job"]) == (
        "rank_desync",
        1,
        "raised",
        False,
    )
    assert stall["details"]["waiting"] == [0]
    # the headline is the cause, rank 1's forward error at its block (recorded by rank 1 alone, read from its
    # events file), with its own severity (the terminal and report.html show its stall's, an error)
    headline = summary["headline"]
    assert (headline["kind"], headline["where"], headline["severity"]) == (
        "step_error",
        "model conv_in, step 3, rank 1",
        "warning",
    ), headline
    # and when rank 1 went on, no snapshot read while the ranks moved named rank 0 as holding rank 1 there
    stalls = [a["message"] for a in summary["anomalies"] if a["details"].get("stall")]
    assert not [m for m in stalls if "rank 1 waits in forward at step 3" in m], stalls
    assert stall["message"].startswith(
        "Rank 1 raised ValueError: planted bad batch on rank 1 in its forward at step 3; "
        "rank 0 waits in forward at step 3. An error on some ranks only"
    ), stall["message"]
    assert summary["training"]["total_steps"] == 6
    stacks = {r: (run_dir / f"stacks-rank{r}.txt").read_text() for r in range(2)}
    assert "in foreach_all_gather" in stacks[0]  # down_blocks.0's all-gather
    assert f'fsdp_job.py", line {_line_of("sleep_until_stall_named(tdbg.record.run_dir, 2, margin")} in' in stacks[1]


def test_fsdp2_gradient_accumulation_without_sync_is_quiet_and_names_rank1s_nan_made_in_a_micro_step(launched):
    """FSDP2's own gradient accumulation: ``set_requires_gradient_sync(False)`` on each first micro-step, the
    debugger called after every backward without ``accumulating=`` (FSDP2's flag says it), each block under
    non-reentrant activation checkpointing. The micro-steps are micro-steps (4 optimizer steps, 4 micro-steps)
    and the clean steps are quiet, each norm ``clip_grad_norm_``'s of the DTensor gradients; rank 1's NaN made
    in the first micro-step of step 2, which FSDP2 reduces only at the second, is named there, at ``conv_in``,
    rank 1. Before, every micro-step was read as a step whose sharded gradients (none until the reduce-scatter)
    had norm 0: ``gradient_vanishing`` on both ranks at every step, and 8 steps counted."""
    output_dir, stdout, stderr = launched
    scenario = "accumulate_checkpointed_nan_rank1"
    _finished(stdout, scenario)
    clips = re.findall(r"RANK (\d) CLIP step (\d): (\S+) (\S+)", stdout[scenario])
    assert sorted((rank, step) for rank, step, _, _ in clips) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    for _, _, measured, clipped in clips:  # the whole model's norm on each rank (a float32 sum: rel 1e-6)
        assert float(measured) == pytest.approx(float(clipped), rel=1e-6), clips
    summary = _summary(output_dir, scenario)
    training = summary["training"]
    assert (training["total_steps"], training["accumulating_micro_steps"]) == (4, 4)
    assert [a for a in summary["anomalies"] if a["step"] < 2] == []
    at2 = [(a["kind"], a["rank"], a["parameter"], a["module"]) for a in summary["anomalies"] if a["step"] == 2]
    assert at2 == [("nonfinite", 0, "conv_in.weight", "conv_in"), ("nonfinite", 1, "conv_in.weight", "conv_in")]
    headline = summary["headline"]
    assert (headline["kind"], headline["where"]) == ("nonfinite", "model conv_in.weight, step 2, rank 1")
    assert "non-finite in this rank's own gradients before the gradient reduce-scatter" in headline["message"]
    received = next(a for a in summary["anomalies"] if (a["step"], a["rank"]) == (2, 0))
    assert received["details"]["reduction"] == {
        "origins": [1],
        "made_here": False,
        "through": "the gradient reduce-scatter",
    }
    assert not [a for a in summary["anomalies"] if a["kind"] == "gradient_vanishing"]


def test_rank1_stalled_before_step6_is_named_and_the_job_ended(launched):
    output_dir, stdout, stderr = launched
    (run_dir,) = (output_dir / "stall_rank1").glob("run-*")
    (stall,) = [a for a in _summary(output_dir, "stall_rank1")["anomalies"] if a["kind"] == "rank_desync"]
    assert (stall["rank"], stall["step"], stall["details"]["ended_job"]) == (1, 6, True)
    assert stall["message"].startswith(
        "Rank 1 is in the loop after its optimizer step, before the forward at step 6; "
        "rank 0 waits in forward at step 6. "
    )
    stalled_at = float(re.search(r"RANK 1 STALLS at ([\d.]+)", stdout["stall_rank1"]).group(1))
    assert stall["details"]["at"] - stalled_at < 2 * STALL_TIMEOUT
    # stall_action="exit": the processes ended themselves with the verdict's code, stacks saved
    assert "DONE" not in stdout["stall_rank1"]
    assert f"exitcode  : {EXIT_CODE}" in stderr
    stacks = {r: (run_dir / f"stacks-rank{r}.txt").read_text() for r in range(2)}
    assert f'fsdp_job.py", line {_line_of("pred = unet(")} in run_scenario' in stacks[0]
    assert "in foreach_all_gather" in stacks[0]  # FSDP2's all-gather before the root's forward
    assert f'fsdp_job.py", line {_line_of("time.sleep(60.0)")} in run_scenario' in stacks[1]


def _line_of(code: str) -> int:
    """The line of fsdp_job.py holding ``code`` (where a stack must point)."""
    return next(n for n, line in enumerate(JOB.read_text().splitlines(), 1) if code in line)


def test_fsdp2_sync_turned_off_for_good_is_every_rank_s_warning_and_rank0_s_headline(launched):
    """``set_requires_gradient_sync(False)`` and never True again: each rank tells its own stretch at its
    256th call (step 255, since step 0, no optimizer step before), and rank 0's run leads with it."""
    output_dir, stdout, _ = launched
    _finished(stdout, "sync_off_forever")
    said = sorted(line for line in stdout["sync_off_forever"].splitlines() if "SYNC_OFF" in line)
    assert said == [f"RANK {r} SYNC_OFF warning 255 {r} fsdp2_gradient_sync" for r in (0, 1)]
    top = _summary(output_dir, "sync_off_forever")["headline"]
    assert (top["kind"], top["severity"]) == ("not_learning", "warning")
    assert top["message"] == (
        "256 backward passes since step 0 with no optimizer step (none since the run began): gradient sync is off "
        "(FSDP2 set_requires_gradient_sync(False)), so every call reads as a micro-step of gradient accumulation "
        "and the weights never move; turn the sync back on for the backward before each optimizer step."
    )
