"""The same launch as test_deepspeed.py (deepspeed_job.py under `torchrun`, two CPU processes, DS_ACCELERATOR=cpu,
gloo), its ``stage0_`` scenarios: the tiny diffusers UNet trained by a raw DeepSpeed engine without ZeRO
(``zero_optimization.stage`` 0; DeepSpeed's mixed-precision optimizer around the AdamW), which all-reduces every
``.grad`` in backward at its accumulation boundary. One launch for both modules (conftest.py's ``deepspeed_job``)."""

import pytest
from test_deepspeed import _collectives, _found, _summary

from diffusion_debug.training.ranks.summary import WIDTH

pytestmark = pytest.mark.xdist_group("launches")

DEEPSPEED_JOB_SCENARIOS = (
    "stage0_nan_grad_rank1_before_reduction",  # no ZeRO, bf16: 4 steps (~1 s of the launch)
    "stage0_fp16_nan_grad_rank1_before_reduction",  # no ZeRO, fp16: 4 steps (~1 s)
    "stage0_accumulate_boundary_off",  # no ZeRO, bf16, 2 micro-steps a step: 12 calls (~2 s)
)
"""What the session's launch of deepspeed_job.py runs for this module (with test_deepspeed.py's)."""


@pytest.fixture(scope="module")
def launched(deepspeed_job) -> tuple:
    """The session's one launch of deepspeed_job.py (conftest.py): output directory, stdout by scenario, stderr."""
    return deepspeed_job


def _lines(out: str, word: str) -> dict[int, str]:
    """rank -> the rest of its ``RANK r <word> ...`` line."""
    return {
        int(w[1]): " ".join(w[3:]) for w in map(str.split, out.splitlines()) if w[:1] == ["RANK"] and w[2:3] == [word]
    }


@pytest.mark.parametrize(
    "scenario, severity",
    [("stage0_nan_grad_rank1_before_reduction", "error"), ("stage0_fp16_nan_grad_rank1_before_reduction", "info")],
    ids=["bf16", "fp16"],
)
def test_stage0_nan_made_on_rank1_before_the_engine_s_all_reduce_is_named_on_rank1_on_both_ranks(
    launched, scenario, severity
):
    """DeepSpeed without ZeRO (stage 0; its mixed-precision optimizer around the AdamW) all-reduces
    every ``.grad`` in backward: rank 1's NaN at step 2 reaches both ranks' gradients. Each rank's own
    gradients were checked as the engine's all-reduce started (``PreReductionCheck.wrap_engine``):
    rank 1 is named (not rank 0, the first to hold it), in both ranks' reports' headlines, and
    DeepSpeed's overflow skip at step 2 with its reason; steps 0, 1 and 3 are quiet, their one
    collective the step's exchange (the flag rides in it). In fp16 the NaN is an overflow its loss
    scaler handles (infos), DeepSpeed skipping step 2 on both ranks; there each report leads with its own
    rank's ``not_learning`` at step 0, DeepSpeed#8393's loss that ``engine.backward`` never scaled
    (``test_deepspeed_fp16_stage0``; step 0 not quiet), and the norms are the gradients' as they are:
    DeepSpeed's own."""
    output_dir, stdout, stderr = launched
    out = stdout[scenario]
    assert "RANK 0 DONE skipped=1" in out and "RANK 1 DONE skipped=1" in out, out + stderr[-3000:]
    # no ZeRO: DeepSpeed's own wrapper (not a ZeRO optimizer; FP16_UnfusedOptimizer on the CPU, bf16 too)
    assert _lines(out, "OPTIMIZER") == {0: "FP16_UnfusedOptimizer", 1: "FP16_UnfusedOptimizer"}
    parameter = "up_blocks.1.resnets.0.conv2.weight"
    lead = f"nonfinite {severity} rank 1 step 2 {parameter}"
    leads = {r: lead for r in (0, 1)}  # each rank's own report leads with rank 1's
    if severity == "info":  # fp16: DeepSpeed#8393's warning first, each rank's own at step 0
        leads = {r: f"not_learning warning rank {r} step 0 None" for r in (0, 1)}
    assert _lines(out, "HEADLINE") == leads
    called = _collectives(out)
    quiet = {(r, s): f"all_reduce[{WIDTH}]" for r in (0, 1) for s in range(2)}
    if severity == "info":  # fp16: step 0's finding (DeepSpeed#8393) gathered as a step's anomalies are
        quiet.update({(r, 0): f"all_reduce[{WIDTH}],all_gather_object" for r in (0, 1)})
    assert {key: names for key, names in called.items() if key[1] < 2} == quiet
    summary = _summary(output_dir, scenario)
    assert summary["training"]["pre_reduction_check"] == {"checked": True, "off": []}
    unscaled = [("not_learning", "warning", r, 0, None) for r in (0, 1)] if severity == "info" else []
    assert sorted(_found(summary), key=lambda found: (found[0], found[2])) == [
        ("nonfinite", severity, 0, 2, parameter),
        ("nonfinite", severity, 1, 2, parameter),
        *unscaled,
        ("skipped_step", "info", 0, 2, None),
    ]
    where = "optimizer, step 0, rank 0" if unscaled else f"model {parameter}, step 2, rank 1"
    assert summary["headline"]["where"] == where
    nan = {a["rank"]: a for a in summary["anomalies"] if a["kind"] == "nonfinite"}
    through = "DeepSpeed's gradient all-reduce"  # the engine's own allreduce_gradients (before: DDP's words)
    assert nan[1]["details"]["reduction"] == {"origins": [1], "made_here": True, "through": through}
    assert nan[0]["details"]["reduction"] == {"origins": [1], "made_here": False, "through": through}
    assert nan[0]["details"]["follows"] == {"kind": "nonfinite", "rank": 1}
    assert f"non-finite in this rank's own gradients before {through}" in nan[1]["message"]
    assert nan[0]["message"] == (
        f"1 gradient(s) hold NaN/Inf (first registered: {parameter}), received through {through} "
        "from rank 1, whose own gradients were non-finite before it."
    )
    (skipped,) = [a for a in summary["anomalies"] if a["kind"] == "skipped_step"]
    assert (skipped["details"]["reason"], skipped["details"]["overflow_ranks"]) == ("deepspeed_overflow", [1])
    assert skipped["message"].startswith(
        "The optimizer step 2 was skipped by DeepSpeed's overflow check (non-finite gradients of rank 1 before "
        'the reduction, "OVERFLOW! Skipping step")'
    ), skipped["message"]
    counts = summary["training"]
    assert (counts["total_steps"], counts["skipped_steps"], counts["skipped_by_deepspeed"]) == (4, 1, 1)
    if severity == "info":  # fp16: DeepSpeed skipped step 2 (its norm inf) on both ranks, and no other
        rows = {}  # (rank, step) -> (DeepSpeed's norm, its skip count) after the step
        for words in map(str.split, out.splitlines()):
            if words[:1] == ["RANK"] and words[2:3] == ["FP16"]:
                rows[int(words[1]), int(words[4].rstrip(":"))] = (words[6], int(words[7]), words[5])
        assert {key: count for key, (_, count, _) in rows.items()} == {
            (r, s): int(s >= 2) for r in (0, 1) for s in range(4)
        }
        assert sorted(key for key, (norm, _, _) in rows.items() if norm == "inf") == [(0, 2), (1, 2)]
        for key, (norm, _, ours) in rows.items():  # .grad never scaled: DeepSpeed's norm is the true one
            if key[1] != 2:
                assert float(ours) == pytest.approx(float(norm), rel=1e-2), (key, ours, norm)
        assert "deepspeedai/DeepSpeed#8393" in summary["headline"]["message"]
        assert "every update is 256x too small" in summary["headline"]["message"]
        assert nan[1]["message"].endswith("DeepSpeed's loss scaler will skip this optimizer step and lower the scale.")
        assert (skipped["details"]["scale_before"], skipped["details"]["scale_after"]) == (256.0, 128.0)
    else:  # bf16: the norm of step 1 is DeepSpeed's own gradients'
        for rank, rest in _lines(out, "GRAD_NORM").items():
            measured, reference = float(rest.split()[0]), float(rest.split()[2])
            assert measured == pytest.approx(reference, rel=1e-5), rank


def test_stage0_accumulating_is_read_at_the_engine_s_boundary_and_a_boundary_left_off_stays_micro_steps(launched):
    """No ZeRO, ``gradient_accumulation_steps`` 2, each micro-step monitored: two whole steps, then the loop turns
    the engine's boundary off (``set_gradient_accumulation_boundary(False)``) and never on again. A call is a
    micro-step where the engine is not at its boundary (``is_gradient_accumulation_boundary()``, as ZeRO's): the
    two steps are counted, with each step's norm DeepSpeed's own gradients' after the all-reduce; the ten others
    are micro-steps, which call no collective, and nothing is found (below the sync-off floor). Before, only a ZeRO
    engine's boundary was read: every call was a whole step (12, no micro-step), each with the exchange, and the
    unsynced stretch, whose weights never moved, a ``not_learning`` of cause unknown."""
    output_dir, stdout, stderr = launched
    scenario = "stage0_accumulate_boundary_off"
    out = stdout[scenario]
    assert "RANK 0 DONE skipped=0" in out and "RANK 1 DONE skipped=0" in out, out + stderr[-3000:]
    assert _lines(out, "HEADLINE") == {0: "None", 1: "None"}
    summary = _summary(output_dir, scenario)
    assert _found(summary) == []
    counts = summary["training"]
    assert (counts["total_steps"], counts["accumulating_micro_steps"]) == (2, 10)
    synced = {r: [] for r in (0, 1)}  # (step, collectives) of each call, in order
    for words in map(str.split, out.splitlines()):
        if words[:1] == ["RANK"] and words[2:4] == ["COLLECTIVES", "step"]:
            synced[int(words[1])].append((int(words[4].rstrip(":")), " ".join(words[5:])))
    whole = f"all_reduce[{WIDTH}]"
    assert synced == {r: [(c // 2, whole if c in (1, 3) else "") for c in range(12)] for r in (0, 1)}
    for rank, rest in _lines(out, "GRAD_NORM").items():  # step 1's: its two micro-steps' gradients, all-reduced
        measured, reference = float(rest.split()[0]), float(rest.split()[2])
        assert measured == pytest.approx(reference, rel=1e-5), rank
