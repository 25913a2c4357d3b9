"""diffusion/step_values.py: a step measured in one transfer (one host read per denoising step,
diffusers' own reads subtracted), the CFG output measured once as its halves and merge_stats against
naive references, and calls checked on their own (no scheduler step)."""

import collections
import dataclasses
import json
import math

import pytest
import torch
from diffusion_helpers import plant, run

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion import step_values
from diffusion_debug.diffusion.components import call_sites
from diffusion_debug.record import RunRecord, jsonio
from diffusion_debug.stats import absmax_on_device, batched, collect, measure, merge_stats, tensor_stats
from diffusion_debug.stats.host import count_host_transfers

UNET_LEAF = "up_blocks.1.resnets.0.conv2"


def cfg(tmp_path, **kwargs):
    return DebugConfig(output_dir=str(tmp_path), **kwargs)


def added_reads(pipe, steps, debugger, which="calls"):
    def call():
        pipe(
            "a photo of a cat",
            num_inference_steps=steps,
            output_type="latent",
            generator=torch.Generator().manual_seed(0),
        )

    call()
    with count_host_transfers() as plain:
        call()
    with debugger:
        with count_host_transfers() as watched:
            call()
    return collections.Counter(getattr(watched, which)) - collections.Counter(getattr(plain, which))


@pytest.mark.parametrize("kind", ["sd", "sd3"])
def test_one_host_read_per_denoising_step(pipes, tmp_path, kind):
    pipe = pipes[kind]
    debugger = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), run_name="t", log_level="error"))
    short, long = added_reads(pipe, 2, debugger), added_reads(pipe, 5, debugger)
    assert sum(long.values()) - sum(short.values()) == 3  # 3 more steps, 3 more reads
    assert set(long) <= {"tolist", "__float__"}
    assert [row["step"] for row in debugger.report().steps][-5:] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("kind", ["sd", "sd3"])
def test_the_default_mode_makes_no_blocking_read_in_the_denoising_loop(pipes, tmp_path, kind):
    """Each step is read from its host buffer when the next one is queued: three more steps make
    no more read of a device value (the text encoders' outputs are read once per call) and one
    more read of a host buffer each (the default policy, ``record``)."""
    pipe = pipes[kind]
    debugger = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), run_name="t", log_level="error"))
    blocking = {steps: added_reads(pipe, steps, debugger, "blocking") for steps in (2, 5)}
    deferred = {steps: added_reads(pipe, steps, debugger, "deferred") for steps in (2, 5)}
    assert blocking[2] == blocking[5]
    # every step's buffer is read within the call: the last one as the call ends (output_type="latent":
    # no VAE call reads it first; the pipeline's maybe_free_model_hooks does)
    assert deferred[2] == collections.Counter(tolist=2) and deferred[5] == collections.Counter(tolist=5)
    assert [row["step"] for row in debugger.report().steps][-5:] == [0, 1, 2, 3, 4]


def test_policy_raise_reads_each_step_at_once(pipes, tmp_path):
    pipe = pipes["sd"]
    config = DebugConfig(output_dir=str(tmp_path), run_name="t", log_level="error", policy="raise")
    debugger = DiffusionModelDebugger(pipe, config)
    assert (
        sum(added_reads(pipe, 5, debugger, "blocking").values())
        - sum(added_reads(pipe, 2, debugger, "blocking").values())
        == 3
    )


def test_cfg_output_is_measured_once_and_device_lookups_happen_at_attach(pipes, tmp_path, monkeypatch):
    pipe = pipes["sd"]
    outputs = []
    handle = pipe.unet.register_forward_hook(lambda m, a, o: outputs.append(o[0].detach().clone()))
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="basic"))
    measured, walks = [], []
    real_summarize, real_first_parameter = batched.summarize, call_sites.first_parameter

    def summarize(tensors):
        measured.extend(tuple(t.shape) for t in tensors)
        return real_summarize(tensors)

    monkeypatch.setattr(batched, "summarize", summarize)
    try:
        with dbg:
            monkeypatch.setattr(call_sites, "first_parameter", lambda m: walks.append(m) or real_first_parameter(m))
            run(pipe, steps=2)
    finally:
        handle.remove()
    assert walks == []  # no parameter walk per component call
    assert (2, 4, 8, 8) not in measured  # the CFG halves only, not the whole output again
    for row, out in zip(dbg.report().steps, outputs):
        whole = tensor_stats(out)
        for key in ("dtype", "nan", "posinf", "neginf", "absmax"):
            assert row["model_output"][key] == getattr(whole, key)
        for key in ("mean", "std", "l2"):  # from sums and L2 norms: float32 rounding
            assert row["model_output"][key] == pytest.approx(getattr(whole, key), rel=1e-4, abs=1e-6)
        assert "min" not in row["model_output"]  # no check or report reads it; it costs a pass
        assert row["model_output"]["shape"] == [2, 4, 8, 8] and "uncond" in row and "cond" in row
    dbg.close()


def test_merge_stats_equals_the_stats_of_the_whole():
    torch.manual_seed(0)
    x = torch.randn(6, 3, 5) * 3 + 1
    x[0, 0, 0], x[1, 1, 1], x[4, 2, 2], x[5, 0, 1] = float("nan"), float("inf"), float("-inf"), 0.0
    whole = tensor_stats(x)
    for parts in (x.chunk(2), (x[:1], x[1:]), (x[:3], x[3:3], x[3:])):
        merged = merge_stats(collect([measure(p) for p in parts]), tuple(x.shape))
        for key in ("shape", "dtype", "numel", "nan", "posinf", "neginf", "min", "max", "absmax"):
            assert getattr(merged, key) == getattr(whole, key)
        for key in ("mean", "std", "l2", "zero_fraction", "dtype_max_fraction"):
            assert getattr(merged, key) == pytest.approx(getattr(whole, key), rel=1e-5)
    half = torch.tensor([[60000.0, 1.0], [-2.0, 3.0]], dtype=torch.float16)
    merged = merge_stats(collect([measure(p) for p in half.chunk(2)]), (2, 2))
    assert merged.dtype_max_fraction == pytest.approx(tensor_stats(half).dtype_max_fraction)
    all_bad = merge_stats(collect([measure(torch.full((2,), float("nan")))] * 2), (4,))
    assert all_bad.nan == 4 and all_bad.mean is None and all_bad.std is None


def test_measure_step_matches_a_naive_reference():
    torch.manual_seed(0)
    latents, output = torch.randn(1, 4, 3, 3), torch.randn(2, 4, 3, 3)
    inputs = step_values.StepInputs(torch.tensor(981), latents, output, batch=1, sigma=torch.tensor(14.6))
    with count_host_transfers() as reads:
        values = step_values.measure_step(inputs)
    assert len(reads.calls) == 1  # the one transfer
    uncond, cond = output.chunk(2)
    assert values.scalars == {
        "timestep": 981.0,
        "sigma": pytest.approx(14.6),
        "sigma_next": None,
        "guidance_gap": pytest.approx(torch.linalg.vector_norm(cond - uncond).item(), rel=1e-6),
    }
    assert list(values.stats) == ["latents", "model_output", "uncond", "cond"]
    assert values.stats["cond"].mean == pytest.approx(cond.mean().item(), rel=1e-5)
    assert values.output_finite
    row = step_values.build_row(3, values, time_s=0.5, denoiser_calls=1, run=2)
    assert (row["step"], row["timestep"], row["run"], row["latents"]["shape"]) == (3, 981.0, 2, [1, 4, 3, 3])


def test_an_unmeasurable_component_output_is_skipped_not_an_internal_error(pipes, tmp_path, monkeypatch):
    assert absmax_on_device(torch.empty(0)) is None and absmax_on_device(torch.empty(2, device="meta")) is None
    # an empty or meta decoded image has no abs-max and no saturation values (no op runs on it)
    for empty in (torch.empty(0, 3, 8, 8), torch.empty(1, 3, 8, 8, device="meta")):
        values = step_values.measure_call(empty, None, decoded_images=True)
        assert (values.output_absmax, values.outside_fraction, values.image_ranges) == (None, None, None)
    pipe = pipes["sd"]
    monkeypatch.setattr(step_values, "absmax_on_device", lambda obj: None)  # as for an empty output
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        run(pipe, steps=2)
    anomalies = dbg.report().anomalies
    assert not [a for a in anomalies if a.kind == "debugger_error"], [a.message for a in anomalies]
    dbg.close()


def test_direct_denoiser_calls_are_checked_one_by_one_and_report_a_fault(pipes, tmp_path):
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="basic"))
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    context = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(2))  # short: 200 quick calls
    handle = plant(pipe.unet.get_submodule(UNET_LEAF), 150)
    reads = []
    try:
        with dbg, torch.no_grad():
            for _ in range(200):
                with count_host_transfers() as call_reads:
                    pipe.unet(latents, 10, encoder_hidden_states=context)
                reads.append(len(call_reads.calls))
    finally:
        handle.remove()
    # the first calls wait for a step; after MAX_UNSTEPPED_CALLS every call is read on its own
    # (one transfer; the first of them reads the held outputs before it too, in one more), so
    # nothing queues up (and the 150th call's replay reads more)
    first = step_values.MAX_UNSTEPPED_CALLS
    assert reads[:first] == [0] * first
    assert reads[first] == 2 and set(reads[first + 1 : 150]) == {1}
    (fault,) = [a for a in dbg.report().anomalies if a.kind == "nonfinite"]
    assert fault.severity == "error" and fault.component == "unet" and fault.module == UNET_LEAF
    assert fault.step is None and fault.details["count"] == 50
    assert [e["type"] for e in dbg.record.events].count("unstepped_denoiser_calls") == 1
    assert not [a for a in dbg.report().anomalies if a.kind == "debugger_error"]
    dbg.close()


@pytest.mark.parametrize("bad, back", [(None, None), (0, 1), (1, 0), ((0, 1), 1)])
def test_each_denoiser_output_of_a_step_is_checked_in_the_same_ops_and_transfer(bad, back):
    """Two denoiser calls a step (the conditional, then the unconditional pass): the earlier output
    rides in the step's one stack (no added op), out of the row; the first non-finite one is named."""
    from diffusion_debug.op_count import count_aten_ops

    torch.manual_seed(0)
    latents, outputs = torch.randn(1, 4, 3, 3), [torch.randn(1, 4, 3, 3) for _ in range(2)]
    for i in (bad,) if isinstance(bad, int) else bad or ():  # (0, 1): both calls made one
        outputs[i][0, 1, 2, 0] = float("inf")
    state = step_values.RunState()
    for output in outputs:
        state.add_output(output)
    one_call = step_values.StepInputs(torch.tensor(981), latents, outputs[-1], batch=1)
    inputs = state.with_outputs(step_values.StepInputs(torch.tensor(981), latents, None, batch=1))
    assert inputs.denoiser_output is outputs[-1] and inputs.earlier_outputs == (outputs[0],)
    step_values.measure_step(inputs), step_values.measure_step(one_call)  # the transfers' cached buffers made
    with count_aten_ops() as alone:
        step_values.queue_step(one_call)
    with count_aten_ops() as ops:
        queued = step_values.queue_step(inputs)
    with count_host_transfers() as reads:
        values = step_values.finish_step(queued)
    assert ops.counts == alone.counts
    # the one transfer; a non-finite output is measured again, fully, on its step only (one read each)
    assert len(reads.calls) == 1 + len((bad,) if isinstance(bad, int) else bad or ())
    assert list(values.stats) == ["latents", "model_output"]
    first = values.earlier[0]
    if first.is_finite:
        assert first.mean == pytest.approx(outputs[0].mean().item(), rel=1e-5)
    else:  # measured again, fully, on this step only
        assert (first.posinf, first.nan) == (1, 0)
    assert (values.first_nonfinite_output, values.output_finite) == (back, back is None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_decoded_image_is_checked_in_five_cpu_ops_against_a_naive_reference(dtype):
    from diffusion_debug.op_count import count_aten_ops

    images = torch.randn(4, 3, 8, 8).mul(0.6).to(dtype)
    images[1, 0, 0, 0], images[2, 1, 2, 3], images[3] = float("nan"), float("inf"), 0.25  # NaN, Inf, flat
    step_values.measure_call(images, None, decoded_images=True)  # the transfer's cached buffer made
    with count_aten_ops() as ops:
        values = step_values.measure_call(images, None, decoded_images=True)
    # |x| <= 1 summed (abs, le, sum), the extremes of each image (aminmax on a GPU; on this CPU amin
    # and amax, whose aminmax along a dim takes 7 to 16 times as long), and the one transfer: the
    # count and the extremes joined by one cat, which makes an fp16 image's extremes float32 itself
    # (exact), as the count is (two _to_copy and a stack before)
    checks = ("abs.default", "le.Scalar", "sum.default", "amin.default", "amax.default", "cat.default")
    expected = {f"aten.{op}": 1 for op in checks}
    assert ops.counts == expected
    if dtype == torch.float16:  # under autocast (whose cat would cast, and refuse fp16 beside bf16): as before
        with torch.autocast("cpu", dtype=torch.bfloat16), count_aten_ops() as ops:
            under = step_values.measure_call(images, None, decoded_images=True)
        expected = {**expected, "aten.stack.default": 1, "aten._to_copy.default": 2}
        del expected["aten.cat.default"]
        assert ops.counts == expected
        assert (under.outside_fraction, under.image_ranges[2:]) == (values.outside_fraction, values.image_ranges[2:])
    x = images.double()
    outside = [v for v in x.flatten().tolist() if not abs(v) <= 1]  # NaN and Inf are outside
    assert values.outside_fraction == pytest.approx(len(outside) / x.numel())
    ranges = [img.max().item() - img.min().item() for img in x]  # nan for the NaN image, inf for the Inf one
    assert values.image_ranges[0] == pytest.approx(ranges[0]) and values.image_ranges[3] == 0.0
    assert values.image_ranges[1] != values.image_ranges[1] and values.image_ranges[2] == float("inf")
    assert values.output_absmax != values.output_absmax and not values.output_finite  # NaN wins, as absmax's
    clean = step_values.measure_call(images[[0, 3]], None, decoded_images=True)
    assert clean.output_absmax == images[[0, 3]].abs().max().item() and clean.output_finite


def test_an_fp8_decoded_image_is_checked_as_its_float32_values():
    images = torch.randn(2, 3, 4, 4).to(torch.float8_e4m3fn)  # fp8 has no reduction kernels of its own
    got, expected = (step_values.measure_call(x, None, decoded_images=True) for x in (images, images.float()))
    assert (got.output_absmax, got.outside_fraction, got.image_ranges) == (
        expected.output_absmax,
        expected.outside_fraction,
        expected.image_ranges,
    )
    assert got.output_absmax == images.float().abs().max().item()


def test_merging_a_steps_two_guidance_halves_gives_the_general_merge_bit_for_bit(monkeypatch):
    """The two halves of a step's CFG output, summarised (finite), take a short path of their own:
    its statistics are the general merge's, to the bit."""
    from diffusion_debug.stats import summarize, to_host

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        halves = [
            (torch.randn(1, 4, 8, 8, generator=g) * scale + shift).to(dtype) for scale, shift in ((1, 0), (3, 1))
        ]
        pending = summarize(halves)
        parts = pending.finish(to_host(pending.vectors))
        fast = merge_stats(parts, (2, 4, 8, 8))
        monkeypatch.setattr(batched, "_summarized", lambda stats: False)
        general = merge_stats(parts, (2, 4, 8, 8))
        monkeypatch.undo()
        assert fast == general and fast.mean is not None and fast.dtype == str(dtype).removeprefix("torch.")


def test_a_step_rows_statistics_made_json_where_they_are_made_are_what_the_record_would_have_written(tmp_path):
    """cost39: a statistics dict whose four floats are finite is copied as JSON where it is made
    (``stats_dicts``' ``ready``), and the record keeps that copy instead of checking it value by value;
    one with a NaN, an Inf or a None is left to the record. Either way the record's row is the one
    ``to_jsonable`` makes of the row alone (the same text), and shares no dict or list with the row
    the user is given."""
    finite = tensor_stats(torch.tensor([[1.0, -2.0], [3.0, 0.5]]))
    counted = tensor_stats(torch.tensor([1.0, math.nan]))  # a NaN counted; its values over the finite ones
    none = tensor_stats(torch.empty(0, 3))  # no finite element: mean, std, abs-max and L2 are None
    big = dataclasses.replace(finite, l2=math.inf)  # finite elements whose L2 overflowed
    lost = dataclasses.replace(finite, mean=math.nan)
    stats = {"latents": finite, "model_output": counted, "uncond": none, "cond": big, "pred_original_sample": lost}
    assert none.mean is None and counted.nan == 1 and counted.mean == 1.0
    values = step_values.StepValues(stats, {"timestep": 981.0, "sigma": None, "guidance_gap": 0.25}, {}, [], None)
    ready = {}
    row = step_values.build_row(3, values, time_s=0.5, denoiser_calls=1, run=2, ready=ready)
    assert list(ready) == ["latents", "model_output"]  # the others: left to the record
    assert ready["latents"] == row["latents"] and ready["latents"] is not row["latents"]
    assert ready["latents"]["shape"] is not row["latents"]["shape"]
    row["memory"], ready["memory"] = {"rss_mb": 1.5, "vms_mb": 2.0, "percent": 0.1}, {"rss_mb": 1.5}
    # taken as given, not walked (a memory copy that differs shows it is the one kept)
    assert jsonio.to_jsonable(row, ready)["memory"] is ready["memory"]
    ready["memory"] = dict(row["memory"])
    kept, alone = jsonio.to_jsonable(row, ready), jsonio.to_jsonable(row)
    assert kept == alone and jsonio.dumps(kept) == jsonio.dumps(alone)
    assert [kept[k]["mean"] for k in stats] == [finite.mean, 1.0, None, finite.mean, "nan"]
    assert (kept["model_output"]["nan"], kept["cond"]["l2"]) == (1, "inf")
    for key in (*stats, "memory"):
        assert kept[key] is not row[key]
    record = RunRecord(DebugConfig(output_dir=str(tmp_path)), kind="diffusion")
    record.add_step(row, ready=ready)
    record.close()
    assert record.steps[-1] == alone
    streamed = [json.loads(line) for line in record.events_path.read_text().splitlines()]
    step = [entry for entry in streamed if entry["type"] == "step"][0]
    assert {k: v for k, v in step.items() if k not in ("type", "time", "rank")} == alone
