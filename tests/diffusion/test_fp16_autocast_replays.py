"""float32 pipelines under ``torch.autocast`` (CPU autocast here, as users run CUDA's), replays and devices: which
device's autocast a component computes under (CUDA's leaves one on the CPU in float32; an offloaded or moved one is
answered for its execution device), and every replay (``why``, a repro bundle's, the localiser's) runs under the
autocast its call ran in, outside it where the call was made outside, in its own dtype, leaving the user's autocast
weight cache as it was. Split from test_fp16_autocast.py (its helpers: autocast_helpers.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from autocast_helpers import UNET_ATTENTION_OUT, autocast, cfg, found, to_out_inf
from diffusion_helpers import run

from diffusion_debug import DiffusionModelDebugger


def _cuda_autocast_only(monkeypatch):
    """The autocast queries answer as under ``torch.autocast("cuda", dtype=torch.float16)`` alone (this machine
    has no CUDA): the CPU's autocast is off."""
    import importlib

    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type="cuda": device_type == "cuda")
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda device_type: torch.float16)
    for name in ("component_probes", "autocast"):
        try:
            module = importlib.import_module(f"diffusion_debug.diffusion.components.{name}")
        except ImportError:  # (before the autocast module)
            continue
        monkeypatch.setattr(module, "ANY_AUTOCAST", lambda: True)


def test_cuda_fp16_autocast_leaves_components_on_the_cpu_probed_as_float32(tmp_path, monkeypatch):
    """Autocast is per device type: CUDA's leaves a component on the CPU (a text encoder kept there) computing in
    float32, with no overflow to watch. It was probed as under autocast (the first device type found open was
    taken for every component): full probes and sentinels on an fp32 pipeline that cannot overflow. Under the
    CPU's own float16 autocast they are probed as float16 ones; under its bfloat16 one, as float32 ones."""
    from diffusion_debug.testing import tiny_pipeline

    pipe = tiny_pipeline("sd")
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with torch.autocast("cpu", dtype=torch.float16), dbg:
        assert dbg._steps.probes.levels == {"unet": "sentinel", "text_encoder": "full", "vae": "full"}
    with torch.autocast("cpu", dtype=torch.bfloat16), dbg:
        assert dbg._steps.probes.levels == {"unet": "output", "text_encoder": "output", "vae": "output"}
    with monkeypatch.context() as patched:
        _cuda_autocast_only(patched)
        with dbg:
            assert dbg._steps.probes.levels == {"unet": "output", "text_encoder": "output", "vae": "output"}
    dbg.close()


def test_a_component_offloaded_to_the_cpu_between_calls_is_answered_for_its_execution_device():
    """``enable_model_cpu_offload`` keeps a component's weights on the CPU until its call moves them to the GPU: its
    autocast is its execution device's (accelerate's hook names it), not the CPU's where the weights wait."""
    from accelerate.hooks import CpuOffload, add_hook_to_module

    from diffusion_debug.diffusion.components.autocast import autocast_dtype, execution_device_type

    offloaded, kept = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    add_hook_to_module(offloaded, CpuOffload(execution_device="cuda"))
    state = (("cuda", torch.float16),)
    assert [execution_device_type(offloaded), execution_device_type(kept)] == ["cuda", "cpu"]
    assert [autocast_dtype(state, execution_device_type(m)) for m in (offloaded, kept)] == [torch.float16, None]
    assert execution_device_type(torch.nn.Linear(2, 2, device="meta")) == "?"


def test_why_replays_an_fp16_autocast_overflow_under_the_autocast_it_ran_in(pipes, tmp_path):
    """``to_out`` overflowing float16 under autocast at step 0 (its weights float32): ``report.why()`` runs after
    the user's ``with torch.autocast(...)`` has closed, and replayed the call in float32, so its "as it was" row
    was finite ("does not reproduce") and no module was named. The run's autocast is kept with its calls and
    entered again: the row is non-finite, the producer the Linear; so is the bundle's own replay, and its
    meta.json says the autocast. Running outside autocast, or autocasting to bfloat16, makes it finite."""
    from diffusion_debug.diffusion import replay

    with to_out_inf(pipes["sd"], tmp_path) as (dbg, error):
        result = dbg.report().why()
        replayed = replay(dbg.report().save() / error.details["bundle"], pipes["sd"].unet)
    assert (error.kind, error.component, error.module, error.step) == ("nonfinite", "unet", UNET_ATTENTION_OUT, 0)
    assert (result.component, result.module, result.step) == ("unet", UNET_ATTENTION_OUT, 0)
    assert (result.baseline.factor, result.baseline.finite) == ("as it was", False)
    assert (replayed["module"], replayed["output_finite"]) == (UNET_ATTENTION_OUT, False)
    assert replayed["meta"]["autocast"] == [["cpu", "float16"]]
    rows = {r.factor: r.finite for r in result.replays}
    assert (rows["autocast to bfloat16"], rows["outside autocast"]) == (True, True)
    assert result.fix == "autocast to bfloat16"


def test_why_under_the_users_bfloat16_autocast_replays_as_it_ran_and_in_bfloat16_each_in_its_own_dtype(
    pipes, tmp_path
):
    """The test above with ``why()`` asked while the user's bfloat16 autocast is on without a region: the row as it
    ran (float16) left its casts in the user's cache, and the bfloat16 row read them ('mat1 and mat2 must have the
    same dtype'): no row finite, no fix. Each row casts for itself; the user's autocast is as it was."""
    with to_out_inf(pipes["sd"], tmp_path) as (dbg, _), users_bfloat16_autocast("no-region"):
        result = dbg.report().why()
        still = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
    assert (result.baseline.factor, result.baseline.finite, result.baseline.error) == ("as it was", False, "")
    rows = {r.factor: (r.finite, r.error) for r in result.replays}
    assert (rows["autocast to bfloat16"], rows["outside autocast"]) == ((True, ""), (True, ""))
    assert result.fix == "autocast to bfloat16"
    assert still == (True, torch.bfloat16)


def test_a_component_moved_to_the_autocast_device_under_one_open_attach_is_probed_as_under_it(tmp_path):
    """A text encoder computing on another device (an accelerate hook naming CUDA: this machine has none) is left
    unprobed under the CPU's float16 autocast; moved to the CPU while one attach stays open (the same autocast,
    the same dtypes), it computes under that autocast from the next run. Its probe level was kept as the attach
    decided it (only the autocast state was compared): it is read again as the next attach would."""
    import types

    from diffusion_debug.testing import tiny_pipeline

    pipe = tiny_pipeline("sd")
    pipe.text_encoder._hf_hook = types.SimpleNamespace(execution_device="cuda")
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    levels = []  # as each call of the text encoder begins
    probes = dbg._steps.probes
    hook = pipe.text_encoder.register_forward_pre_hook(lambda *_: levels.append(probes.levels["text_encoder"]))
    with autocast(), dbg:
        run(pipe, steps=1, output_type="latent")
        del pipe.text_encoder._hf_hook  # computes on the CPU now
        run(pipe, steps=1, output_type="latent")
        run(pipe, steps=1, output_type="latent")
    hook.remove()
    assert levels == ["output", "output", "full", "full", "sentinel", "sentinel"]  # (prompt, negative prompt)
    assert found(dbg) == []
    dbg.close()


def test_why_and_a_bundles_replay_of_a_call_made_outside_autocast_run_outside_the_callers_autocast(tmp_path):
    """An fp16 UNet whose ``to_out`` overflows, run with no autocast: ``report.why()`` and the bundle's replay asked
    inside the caller's own ``with torch.autocast("cpu", dtype=torch.bfloat16)`` ran the call under it (the
    recorded state, none, entered nothing): the "as it was" row raised a mixed dtype error. They replay as the call
    ran, outside autocast: the row is the same non-finite one, the Linear named, inside the caller's autocast or
    not."""
    from diffusion_debug.diffusion import replay
    from diffusion_debug.testing import tiny_pipeline

    pipe = tiny_pipeline("sd", dtype=torch.float16)
    answers = []
    with to_out_inf(pipe, tmp_path, under_autocast=False) as (dbg, error):
        bundle = dbg.report().save() / error.details["bundle"]
        for inside in (False, True):
            with torch.autocast("cpu", dtype=torch.bfloat16) if inside else contextlib.nullcontext():
                result = dbg.report().why()
                replayed = replay(bundle, pipe.unet)
            row = (result.baseline.factor, result.baseline.finite, result.baseline.error)
            answers.append((row, result.module, replayed["module"], replayed["output_finite"], replayed["note"]))
    assert answers == [(("as it was", False, ""), UNET_ATTENTION_OUT, UNET_ATTENTION_OUT, False, "")] * 2


def test_a_bundle_saved_under_cuda_autocast_replayed_on_the_cpu_says_it_ran_outside_it(pipes, tmp_path):
    """A bundle whose call ran under CUDA's float16 autocast, replayed with the model on the CPU: CUDA's autocast
    does not reach it (torch warned that CUDA is not available where it has none). The replay runs outside
    autocast, and its note says so; no warning."""
    import json
    import warnings

    from diffusion_debug.diffusion import replay

    with to_out_inf(pipes["sd"], tmp_path) as (dbg, error):
        bundle = dbg.report().save() / error.details["bundle"]
        meta = json.loads((bundle / "meta.json").read_text())
        (bundle / "meta.json").write_text(json.dumps({**meta, "autocast": [["cuda", "float16"]]}))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            replayed = replay(bundle, pipes["sd"].unet)
    assert (replayed["module"], replayed["output_finite"]) == (None, True)
    assert replayed["note"] == (
        "the call ran under cuda float16 autocast, which does not reach cpu, where the model is: replayed outside it"
    )
    assert [str(w.message) for w in caught if "autocast" in str(w.message).lower()] == []


@pytest.mark.parametrize(
    "state, outside",
    [((("cpu", torch.bfloat16),), False), ((("cpu", None),), False), ((), True)],
    ids=["replayed-under-it", "replayed-outside-it", "why-outside"],
)
def test_a_replay_keeps_the_weight_cache_of_an_autocast_turned_on_without_a_region(state, outside):
    """``torch.set_autocast_enabled`` turns autocast on with no region (nesting count 0), and its cache of cast
    weights lives on from call to call: a replay's region (:func:`autocast_as`, under the call's autocast, outside
    it, or ``why()``'s outside every one) left at count 0 cleared it, and the user's next call cast its weight and
    bias again (3 ``_to_copy`` where it made 1). The cache is the user's: the next call casts what it did."""
    from diffusion_debug.diffusion.components.autocast import autocast_as
    from diffusion_debug.op_count import count_aten_ops

    linear, x = torch.nn.Linear(4, 4), torch.ones(2, 4)
    torch.set_autocast_enabled("cpu", True)
    try:
        torch.set_autocast_dtype("cpu", torch.bfloat16)
        linear(x)
        with count_aten_ops() as warm:
            linear(x)
        with autocast_as(state, outside=outside):
            replayed = linear(x).dtype
        with count_aten_ops() as after:
            linear(x)
        still = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
    finally:
        torch.set_autocast_enabled("cpu", False)
        torch.clear_autocast_cache()
    assert replayed == (torch.bfloat16 if state and state[0][1] else torch.float32)
    assert dict(warm.counts) == dict(after.counts) == {"aten._to_copy.default": 1, "aten.addmm.default": 1}
    assert still == (True, torch.bfloat16)


@contextlib.contextmanager
def users_bfloat16_autocast(caller):
    """The user's bfloat16 autocast, as ``caller`` turned it on: ``no-region`` (``torch.set_autocast_enabled``,
    nesting count 0), ``region`` (``with torch.autocast``) or ``disabled-inside`` (a region with a disabled one
    inside it: the replay runs in the inner one, the user's next call in the outer). Yields ``replaying``, the
    context a replay runs in; its cache cleared after."""
    with contextlib.ExitStack() as stack:
        stack.callback(torch.clear_autocast_cache)
        if caller == "no-region":
            torch.set_autocast_enabled("cpu", True)
            stack.callback(torch.set_autocast_enabled, "cpu", False)
            torch.set_autocast_dtype("cpu", torch.bfloat16)
        else:
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        if caller == "disabled-inside":
            yield lambda: torch.autocast("cpu", enabled=False)
        else:
            yield contextlib.nullcontext


@pytest.mark.parametrize("caller", ["no-region", "region", "disabled-inside"])
def test_a_replay_in_another_dtype_than_the_users_autocast_neither_reads_nor_writes_its_weight_cache(caller):
    """The cache of cast weights is keyed by the weight alone: a replay under float16 autocast read the user's
    bfloat16 casts ('mat1 and mat2 must have the same dtype, but got Half and BFloat16'), and where it ran first
    its float16 casts, left in the cache, raised in the user's next bfloat16 call. The replay casts for itself;
    the user's next call casts what it did before (nothing: its cache kept)."""
    from diffusion_debug.diffusion.components.autocast import autocast_as
    from diffusion_debug.op_count import count_aten_ops

    linear, x = torch.nn.Linear(4, 4), torch.ones(2, 4)
    fresh = torch.nn.Linear(4, 4)  # replayed first: its float16 casts in no cache of the user's
    with users_bfloat16_autocast(caller) as replaying:
        linear(x)
        with count_aten_ops() as warm:
            linear(x)
        with replaying(), autocast_as((("cpu", torch.float16),)):
            replayed = linear(x).dtype, fresh(x).dtype
        with count_aten_ops() as after:
            next_call = linear(x).dtype, fresh(x).dtype
    assert replayed == (torch.float16, torch.float16)
    assert next_call == (torch.bfloat16, torch.bfloat16)
    assert dict(warm.counts) == {"aten._to_copy.default": 1, "aten.addmm.default": 1}
    assert dict(after.counts) == {"aten._to_copy.default": 4, "aten.addmm.default": 2}  # fresh's 3 casts, its first
