"""A compiled denoiser under the debugger: no added graph break or recompile (dynamo's counters),
the same images as the plain compiled call, and a NaN/Inf named at its module (without the
``_orig_mod.`` prefix) by an eager replay. aot_eager for every way of compiling, one inductor case."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusion_helpers import dynamo_counts, inf_weight
from torch._dynamo.utils import counters

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion.components.compiled import compile_state
from diffusion_debug.testing import plant_nonfinite, plant_overflow, tiny_pipeline
from diffusion_debug.testing.features import HAS_REPEATED_BLOCKS

FAULTY = "up_blocks.1.resnets.0.conv2"  # an Inf weight: the compiled graph reads it like any input


def compile_unet(pipe, how: str, backend: str) -> None:
    if how == "torch.compile":
        pipe.unet = torch.compile(pipe.unet, backend=backend)
    elif how == "torch.compile fullgraph":
        pipe.unet = torch.compile(pipe.unet, backend=backend, fullgraph=True)
    elif how == "module.compile":
        pipe.unet.compile(backend=backend)
    elif how == "module.compile fullgraph":
        pipe.unet.compile(backend=backend, fullgraph=True)
    else:  # regional
        pipe.unet.compile_repeated_blocks(backend=backend, fullgraph=True)


def call(pipe):
    return pipe("a cat", num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0)).images


def watch_compiled(how: str, backend: str, tmp_path, reset: bool = True):
    if reset:
        torch._dynamo.reset()
        counters.clear()
    pipe = tiny_pipeline("sd")
    compile_unet(pipe, how, backend)
    plain, before = call(pipe), dynamo_counts()  # compiles: the plain compiled call's image and graphs
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path)))
    with dbg:
        watched = call(pipe)
    assert dynamo_counts() == before, "the debugger added a graph break or a recompile"
    np.testing.assert_array_equal(watched, plain)
    assert not dbg.report().anomalies or {a.kind for a in dbg.report().anomalies} == {"scheduler_config"}

    unet = pipe.unet._orig_mod if compile_state(pipe.unet) == "wrapped" else pipe.unet
    with inf_weight(unet.get_submodule(FAULTY)), dbg:
        call(pipe)
    np.testing.assert_array_equal(call(pipe), plain)  # nothing left behind: same image, same graphs
    assert dynamo_counts() == before
    (error, *_) = [a for a in dbg.report().anomalies if a.severity == "error"]
    assert (error.component, error.module, error.step) == ("unet", FAULTY, 0)
    assert not [a for a in dbg.report().anomalies if a.kind == "debugger_error"]
    dbg.close()


@pytest.fixture(scope="module")
def unet_forward_cache():
    """Dynamo's cache emptied once for the whole-UNet cases. Dynamo compiles the UNet's ``forward``
    (``Module.__call__`` is not traced as a frame) and caches the graph on that code object, guarded
    on the module it is called with: each way of compiling a fresh tiny UNet finds the first case's
    graph (4 aot_eager compiles of ~6 CPU-s -> 1), with the guards it would have made itself. Each
    case still compares the counts after its plain compiled call with those after its debugger's
    calls: a guarded attribute the debugger changed is a recompile (made under that case's own
    settings, fullgraph's included; a resnet's ``output_scale_factor`` changed: 1 -> 2 graphs), a
    graph break is counted, and a case whose debugger recompiled fails there."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


WHOLE = ["torch.compile", "torch.compile fullgraph", "module.compile", "module.compile fullgraph"]


@pytest.mark.xdist_group("compiled_unet")  # one worker under -n 2: one compile for the four cases
@pytest.mark.parametrize("how", WHOLE)
def test_a_compiled_unet_is_watched_without_a_graph_break_and_named_eagerly(how, tmp_path, unet_forward_cache):
    watch_compiled(how, "aot_eager", tmp_path, reset=False)


@pytest.mark.skipif(not HAS_REPEATED_BLOCKS, reason="this diffusers has no compile_repeated_blocks")
def test_a_regionally_compiled_unet_is_watched_without_a_graph_break_and_named_eagerly(tmp_path):
    watch_compiled("regional", "aot_eager", tmp_path)  # its blocks' forward: compiled anew


@pytest.mark.skipif(not HAS_REPEATED_BLOCKS, reason="this diffusers has no compile_repeated_blocks")
def test_an_inductor_compiled_unet_too(tmp_path, monkeypatch):
    # inductor compiles its kernels in this process, not in its pool of one worker a core: a compile-worker
    # Python per core (importing torch) is most of what the pool would add here (the test 38.3 -> 33.3 CPU-s
    # alone, load ~5-7); the generated code and the compiled graphs are the same
    import torch._inductor.config

    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)
    watch_compiled("regional", "inductor", tmp_path)  # regional: the shortest inductor compile (~40 s on CPU)


def test_before_torch_2_6_a_replay_runs_every_compiled_part_eagerly_and_puts_it_back(monkeypatch):
    """Without ``set_stance`` (torch 2.5, the floor) :func:`eager` lifts the compiled call of each
    module compiled in place and puts each ``torch.compile`` wrapper child's original in its place."""
    from diffusion_debug.diffusion.components import compiled

    monkeypatch.setattr(compiled, "HAS_SET_STANCE", False)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[0].compile(backend="aot_eager")
    wrapper = torch.compile(model[1], backend="aot_eager")
    model[1] = wrapper
    seen = []
    for layer in (model[0], wrapper._orig_mod):
        layer.register_forward_hook(lambda m, a, o: seen.append(torch.compiler.is_compiling()))
    with compiled.eager(model):
        assert model[1] is wrapper._orig_mod and model[0]._compiled_call_impl is None
        model(torch.ones(1, 2))
    assert seen == [False, False]  # both ran as their original Python
    assert model[1] is wrapper and model[0]._compiled_call_impl is not None


def unwrapped_hook(method):
    """diffusers 0.32's ``apply_forward_hook``: a wrapper without ``functools.wraps``."""

    def wrapper(self, *args, **kwargs):
        return method(self, *args, **kwargs)

    return wrapper


class TinyVae(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = torch.nn.Linear(2, 2)

    @unwrapped_hook
    def decode(self, z):
        return self.decoder(z)


def test_a_vae_decode_wrapped_without_its_name_is_found_and_run_eagerly_before_torch_2_6(monkeypatch):
    """diffusers 0.32 (the floor) wraps ``decode`` without ``functools.wraps``: its ``__name__`` is
    ``wrapper``. Compiled on the instance it is still the VAE's compiled ``decode`` (its call site
    is watched around it, not traced into it), and without ``set_stance`` :func:`eager` runs its
    original, through a call-site wrapper too (a preview's decode: no recompile), then puts it back."""
    from diffusion_debug.diffusion.components import compiled

    monkeypatch.setattr(compiled, "HAS_SET_STANCE", False)
    vae = TinyVae()
    vae.decode = function = torch.compile(vae.decode, backend="eager")
    assert compile_state(vae) == "method" and list(compiled.compiled_methods(vae)) == ["decode"]
    seen, around = [], []
    vae.decoder.register_forward_hook(lambda m, a, o: seen.append(torch.compiler.is_compiling()))
    patch = compiled.wrap_compiled_method(vae, "decode", vae.decoder, lambda *a: around.append(1), lambda *a: None)
    try:
        with compiled.eager(vae):
            vae.decode(torch.ones(1, 2))
        assert seen == [False] and around == [1]
        assert patch.inner is function
    finally:
        patch.remove()
    assert vars(vae)["decode"] is function


def test_the_busy_check_is_a_constant_to_dynamo_and_the_eager_flag_outside(tmp_path, monkeypatch):
    """Every hook and wrapper of the debugger asks ``_is_busy`` first (``probes.tracing.compiling``
    spelled inline): traced, it returns False at once (no graph break under fullgraph, no guard on
    torch's flag, so no recompile); in eager code it reads ``torch.compiler.is_compiling()``'s flag
    (True while ``torch.export`` traces in Python)."""
    from diffusion_debug.probes.tracing import compiling

    dbg = DiffusionModelDebugger(tiny_pipeline("sd"), DebugConfig(output_dir=str(tmp_path), log_level="error"))

    def traced(x):
        return x + 1 if compiling() and not dbg._is_busy() else x - 1

    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = torch.compile(traced, backend="eager", fullgraph=True)
        with dbg._steps.quiet("unet"):  # busy in eager code: still not busy while traced
            assert [compiled(torch.zeros(1)).item() for _ in range(3)] == [1.0] * 3
        assert dynamo_counts() == (0, 1)
    finally:
        torch._dynamo.reset()
    assert (compiling(), traced(torch.zeros(1)).item()) == (False, -1.0)
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    assert compiling() == torch.compiler.is_compiling() is True and dbg._is_busy() is False
    dbg.close()


VAE_FAULTY = "decoder.up_blocks.1.resnets.0.conv2"
VAE_UPSAMPLER = "decoder.up_blocks.0.upsamplers.0.conv"


def same(pipe, step, timestep, kwargs):
    return kwargs


def compile_vae(pipe, how: str, backend: str) -> None:
    if how == "vae.decode = torch.compile(vae.decode)":
        pipe.vae.decode = torch.compile(pipe.vae.decode, backend=backend)
    else:
        pipe.vae.decoder.compile(backend=backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("how", ["vae.decode = torch.compile(vae.decode)", "vae.decoder.compile()"])
def test_a_compiled_vae_decode_is_watched_without_a_graph_break_and_named_eagerly(how, dtype, tmp_path):
    """The VAE's decoder runs inside the user's compiled ``decode``: no hook of ours is traced there
    (the call site's clock and host read were 13 graph breaks in fp32; fp16's full probes and sentinel
    more), the call site is watched around the compiled function, and a NaN/Inf in the decoder is
    named at its module by an eager replay of the decoder's call, found from ``decode``'s arguments.
    The debugger attaches before the first call: every graph is compiled with it there. Each call
    passes a ``callback_on_step_end`` (the debugger's step-end watch, a global pre-hook armed after
    the last step, is taken off at the decode's call site, before dynamo guards on it). Backend
    ``eager``: aot_eager fails on this tiny decoder without the debugger (torch 2.13 on CPU,
    ``Expected X.is_contiguous(memory_format)`` in its group norm); dynamo's counters are the same."""

    def call(pipe):
        generator = torch.Generator().manual_seed(0)
        images = pipe("a cat", num_inference_steps=2, output_type="np", generator=generator, callback_on_step_end=same)
        return images.images

    def fresh():
        torch._dynamo.reset()
        counters.clear()
        pipe = tiny_pipeline("sd").to(dtype=dtype)
        compile_vae(pipe, how, "eager")
        return pipe

    pipe = fresh()
    plain, expected = call(pipe), dynamo_counts()  # compiles: the plain compiled call's image and graphs
    assert expected[0] == 0 and expected[1] >= 1
    pipe = fresh()
    config = DebugConfig(output_dir=str(tmp_path), log_level="error", preview_vae_every=1)
    dbg = DiffusionModelDebugger(pipe, config)  # its previews decode one image: eagerly, no graph of theirs
    with dbg:
        call(pipe)
    with dbg:
        watched = call(pipe)
    assert dynamo_counts() == expected, "the debugger added a graph break or a recompile"
    np.testing.assert_array_equal(watched, plain)
    assert {a.kind for a in dbg.report().anomalies} <= {"scheduler_config"}
    assert dbg.report().components["vae"]["calls"] == 2  # its decode, watched at each call

    with inf_weight(pipe.vae.get_submodule(VAE_FAULTY)), dbg:
        call(pipe)
    np.testing.assert_array_equal(call(pipe), plain)  # nothing left behind: same image, same graphs
    assert dynamo_counts() == expected
    (error, *_) = [a for a in dbg.report().anomalies if a.severity == "error"]
    assert (error.component, error.module) == ("vae", VAE_FAULTY)
    assert not [a for a in dbg.report().anomalies if a.kind == "debugger_error"]
    dbg.close()


def test_a_vae_decode_compiled_between_two_attaches_gets_no_probe_inside(tmp_path):
    """What an attach works out of a component is kept while its module tree is the same
    (``TreeMemo``); ``vae.decode = torch.compile(vae.decode)`` leaves the tree as it was, so the
    memo's key holds the VAE's own ``decode``: compiled after a watched fp16 call (the VAE's full
    probes, then its sentinel), the next attaches put no probe in the compiled decode (traced into its
    graph, they made a second one), and the image is the unwatched compiled call's."""
    torch._dynamo.reset()
    counters.clear()
    pipe = tiny_pipeline("sd").to(dtype=torch.float16)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        call(pipe)
    pipe.vae.decode = torch.compile(pipe.vae.decode, backend="eager")
    with dbg:
        call(pipe)
    with dbg:
        watched = call(pipe)
    assert dynamo_counts() == (0, 1)
    np.testing.assert_array_equal(watched, call(pipe))
    assert dynamo_counts() == (0, 1)
    assert [e["components"] for e in dbg.record.events if e["type"] == "compiled_components"][-1] == ["vae"]
    dbg.close()


def test_a_vae_compiled_in_place_is_watched_as_usual_since_its_decode_runs_eagerly(tmp_path):
    """``vae.compile()`` compiles the VAE's ``forward``, which ``vae.decode`` does not call: the
    decode runs eagerly (no graph at all), so the fp16 VAE is probed as an uncompiled one (it was
    taken for compiled and got no probe: a near-overflow inside its decoder went unseen). Its full
    probes name the near-overflow on the first call, its sentinel and a replay on the next, and a
    NaN after them; the images are the unwatched call's, and no graph is made."""
    torch._dynamo.reset()
    counters.clear()
    pipe = tiny_pipeline("sd").to(dtype=torch.float16)
    pipe.vae.compile(backend="eager")
    plain = call(pipe)
    assert dynamo_counts() == (0, 0)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    faulty = pipe.vae.get_submodule(VAE_UPSAMPLER)
    for _ in range(2):
        with plant_overflow(faulty, fraction=0.61), dbg:  # planted first: the debugger's probes read it
            call(pipe)
    with plant_nonfinite(faulty, value=float("nan")), dbg:
        call(pipe)
    with dbg:
        watched = call(pipe)
    np.testing.assert_array_equal(watched, plain)
    np.testing.assert_array_equal(call(pipe), plain)
    assert dynamo_counts() == (0, 0)
    found = [(a.kind, a.component, a.module, a.details.get("localized_by")) for a in dbg.report().anomalies]
    assert [f for f in found if f[0] != "scheduler_config"] == [
        ("compile_bypassed", "vae", "", None),  # its compiled forward is never called: said once, at attach
        ("overflow_risk", "vae", VAE_UPSAMPLER, "full probes"),
        ("overflow_risk", "vae", VAE_UPSAMPLER, "sentinel -> replay with full probes"),
        ("nonfinite", "vae", VAE_UPSAMPLER, "sentinel -> replay with full probes"),
    ]
    assert not [e for e in dbg.record.events if e["type"] == "compiled_components"]
    assert compile_state(pipe.vae) is None
    dbg.close()


def latents(pipe):
    generator = torch.Generator().manual_seed(0)
    return pipe("a cat", num_inference_steps=2, output_type="latent", generator=generator).images


def test_a_compiled_fp16_unet_whose_output_nears_overflow_is_warned_at_its_step_from_the_row(tmp_path):
    """A compiled fp16 UNet has no probe inside (its sentinel would be traced): its output's abs-max,
    which the step's row reads at the call site for NaN/Inf already, is what warns of a near-overflow
    there, at the step, naming the component's output and saying that its inside is not read. No op,
    graph or host read is added (the row's reduction was made anyway); the images are the unwatched
    compiled call's. The UNet's ``conv_out`` is scaled so that step 0's output is at 30% of the fp16
    maximum, over a threshold of 25% (DDIM's x0 from an output at 55% is an Inf, and latents this large
    are one as the pipeline scales them for the VAE: the latents are the images compared; a hook
    planted inside compiled code would be a guard on its call counter: recompiles)."""
    torch._dynamo.reset()
    counters.clear()
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    conv_out, peaks = pipe.unet.conv_out, []
    handle = conv_out.register_forward_hook(lambda _m, _a, out: peaks.append(float(out.abs().amax())))
    latents(pipe)
    handle.remove()
    with torch.no_grad():  # the output is linear in the weight and bias together
        scale = 0.3 * torch.finfo(torch.float16).max / peaks[0]
        conv_out.weight.mul_(scale), conv_out.bias.mul_(scale)
    compile_unet(pipe, "torch.compile", "aot_eager")
    plain, before = latents(pipe), dynamo_counts()
    config = DebugConfig(output_dir=str(tmp_path), log_level="error", overflow_fraction=0.25)
    dbg = DiffusionModelDebugger(pipe, config)
    with dbg:
        watched = latents(pipe)
    assert dynamo_counts() == before, "the debugger added a graph break or a recompile"
    np.testing.assert_array_equal(watched, plain)
    (risk,) = [a for a in dbg.report().anomalies if a.kind == "overflow_risk"]
    assert (risk.component, risk.module, risk.step, risk.severity) == ("unet", "", 0, "warning")
    assert (risk.details["count"], risk.details["last_step"]) == (2, 1)  # step 1's folded into it
    assert risk.details["localized_by"] == "output check (a compiled component: nothing inside it is read)"
    assert risk.details["dtype_max_fraction"] == pytest.approx(0.3, abs=1e-3)
    absmax = risk.details["absmax"]
    assert absmax == dbg.record.steps[0]["model_output"]["absmax"]  # the row's own reading
    assert risk.message == (
        f"unet output reached 30% of the float16 maximum (|x|={absmax:.4g}); unet is compiled: its inside is "
        "not read, so the module that made these values is not named (run it uncompiled once to name it); "
        "run this component in bfloat16 or float32, or upcast this module."
    )
    assert not [a for a in dbg.report().anomalies if a.kind in ("nonfinite", "debugger_error")]

    # ten calls a step: the ninth and tenth are each checked on their own (MAX_UNSTEPPED_CALLS), and the
    # step's row holds the tenth's output only: warned of once a checked call (2 a step), as the uncompiled
    # UNet's conv_out is (its sentinel's readings taken by each call's check): not a third time by the row
    # (the pipeline's call: its graph, not a recompile)
    kw = dict(timestep_cond=None, cross_attention_kwargs=None, added_cond_kwargs=None, return_dict=False)
    with dbg, torch.no_grad():
        kw["encoder_hidden_states"] = torch.cat(pipe.encode_prompt("a cat", "cpu", 1, True)[::-1])
        pipe.scheduler.set_timesteps(2)
        noisy = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float16)
        for t in pipe.scheduler.timesteps:
            x = pipe.scheduler.scale_model_input(noisy, t)
            outputs = [pipe.unet(x, t, **kw)[0] for _ in range(10)]
            noisy = pipe.scheduler.step(torch.stack(outputs).mean(0), t, noisy).prev_sample
    assert dynamo_counts() == before
    (_, many) = [a for a in dbg.report().anomalies if a.kind == "overflow_risk"]
    assert (many.component, many.module, many.step) == ("unet", "", 0)
    assert (many.details["count"], many.details["last_step"]) == (4, 1)
    dbg.close()


def test_a_compiled_fp16_unets_watched_step_adds_a_pinned_number_of_python_calls(tmp_path):
    """DESIGN's compiled budget (watched <= 1.05x the plain compiled call) is host time on a GPU: the
    Python a watched step runs around the compiled UNet call (its call site's hooks, the step's row and
    checks), nothing inside it. Counted per step (a 6-step call's added calls minus a 2-step call's, the
    fewest of three each, the collector off) on tiny SD in fp16 with its UNet under
    ``torch.compile(backend="aot_eager")``, as ``benchmarks.compiled`` times it. comp30 (2026-12-02):
    103.75 a step here (steps 2-5) where main at 512968dd (the fifth session's compiled 1.022x) ran 154;
    at SD1.5 topology (steps 4-7) 86 against 136, 7.5 aten ops a step at both (the same ops). A watched
    step's Python fell since, it did not grow: this pins it there."""
    import gc
    import sys

    torch._dynamo.reset()
    counters.clear()
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    compile_unet(pipe, "torch.compile", "aot_eager")

    def latents(steps):
        generator = torch.Generator().manual_seed(0)
        return lambda: pipe("a cat", num_inference_steps=steps, output_type="latent", generator=generator)

    def calls(run) -> int:
        count = [0]

        def profile(frame, event, arg):
            if event == "call":
                count[0] += 1

        gc.collect()
        gc.disable()  # a collection's finalizers are no step's calls
        sys.setprofile(profile)
        try:
            run()
        finally:
            sys.setprofile(None)
            gc.enable()
        return count[0]

    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))

    def watched(steps):
        def run():
            with dbg:
                latents(steps)()

        return run

    latents(2)()  # compiles
    before = dynamo_counts()
    try:
        for _ in range(3):  # the first runs' reads of the encoders behind it
            watched(2)()
        added = {
            steps: min(calls(watched(steps)) for _ in range(3)) - min(calls(latents(steps)) for _ in range(3))
            for steps in (2, 6)
        }
        per_step = (added[6] - added[2]) / 4
        assert dynamo_counts() == before, "the debugger added a graph break or a recompile"
        assert 0 < per_step <= 110, (per_step, added)  # 103.75 (comp30); 154 at 512968dd
    finally:
        dbg.close()


def test_a_watched_call_leaves_every_dict_under_a_compiled_unet_with_its_version_tag(tmp_path):
    """Dynamo's guards skip what a dict whose version tag (PEP 509) is unchanged holds (a module's
    parameters, its attributes): a debugger that wrote into, or set and took back, anything under the
    compiled UNet would send every later UNet call through the whole guard tree (1.8M instructions a
    call on the SD1.5-shaped proxy, callgrind) with no recompile to show it. comp31 (callgrind, the
    fp16 proxy): the guard tree's instructions a 4-step call 7,276,428 plain, 7,282,663 watched. Pinned
    here over every dict of every module under the wrapper (4584 on tiny SD), across an attach, a
    watched call and a detach."""
    guards = pytest.importorskip("torch._C._dynamo.guards")
    dict_version = getattr(guards, "dict_version", None)
    if dict_version is None:
        pytest.skip("this torch has no dict_version")
    torch._dynamo.reset()
    counters.clear()
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    compile_unet(pipe, "torch.compile", "aot_eager")

    def call():
        generator = torch.Generator().manual_seed(0)
        return pipe("a cat", num_inference_steps=2, output_type="latent", generator=generator).images

    def tags() -> dict:
        found = {("wrapper", "__dict__"): dict_version(vars(pipe.unet))}
        for name, module in pipe.unet._orig_mod.named_modules():
            found[name, "__dict__"] = dict_version(vars(module))
            for attribute, value in vars(module).items():
                if isinstance(value, dict):
                    found[name, attribute] = dict_version(value)
        return found

    plain = call()  # compiles
    before = dynamo_counts()
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    try:
        with dbg:  # the first call's full reads, then a reused debugger's
            call()
        tagged = tags()
        with dbg:
            watched = call()
        assert [key for key, tag in tags().items() if tagged.get(key) != tag] == []
        assert len(tagged) > 1000
        assert dynamo_counts() == before
        assert torch.equal(watched, plain)
    finally:
        dbg.close()
