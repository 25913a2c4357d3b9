"""diffusion/call_sites.py: the component hooks live next to diffusers' and accelerate's own
(attention slicing, accelerate hooks, cpu_offload) and count calls."""

from __future__ import annotations

import numpy as np
import pytest
from diffusion_helpers import plant, run

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import tiny_pipeline

UNET_LEAF = "up_blocks.1.resnets.0.conv2"


def cfg(tmp_path, **kwargs):
    return DebugConfig(output_dir=str(tmp_path), **kwargs)


def kinds(report, kind):
    return [a for a in report.anomalies if a.kind == kind]


def test_attention_slicing_and_accelerate_hooks(tmp_path):
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    class CountingHook(ModelHook):
        def __init__(self):
            self.calls = 0

        def pre_forward(self, module, *args, **kwargs):
            self.calls += 1
            return args, kwargs

    pipe = tiny_pipeline("sd")
    pipe.enable_attention_slicing()
    hook = CountingHook()
    add_hook_to_module(pipe.unet, hook)
    plain = run(pipe, steps=2)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        watched = run(pipe, steps=2)
    assert np.array_equal(plain, watched)
    assert hook.calls == 4 and hasattr(pipe.unet, "_hf_hook")
    assert dbg.report().components["unet"]["calls"] == 2 and dbg.report().components["unet"]["offload_hooks"]
    with plant(pipe.unet.get_submodule(UNET_LEAF), 1):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="basic"))
        with dbg:
            run(pipe, steps=2)
    (anomaly,) = [a for a in kinds(dbg.report(), "nonfinite") if a.severity == "error"]
    assert (anomaly.module, anomaly.step) == (UNET_LEAF, 1)
    remove_hook_from_module(pipe.unet)
    assert np.array_equal(run(pipe, steps=2), plain)


def test_accelerate_cpu_offload(tmp_path, monkeypatch):
    import torch
    from accelerate import cpu_offload

    pipe = tiny_pipeline("sd")
    plain = run(pipe, steps=2)
    cpu_offload(pipe.unet, execution_device="cpu")
    # diffusers 0.32 (the floor) asks the first module of a set for the pipeline's device: by the
    # hash seed, the offloaded UNet, whose weights are on meta, half of the runs (before any debugger)
    monkeypatch.setattr(type(pipe), "_execution_device", property(lambda self: torch.device("cpu")))
    offloaded = run(pipe, steps=2)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        watched = run(pipe, steps=2)
    assert np.array_equal(offloaded, watched)  # the contract: same objects, with and without us
    # cpu_offload re-materialises the weights at other addresses; MKL/oneDNN kernels chosen by
    # alignment can differ by ~1e-6 there, so offloaded vs plain is a numerics question
    np.testing.assert_allclose(offloaded, plain, rtol=0, atol=1e-4)
    assert len(dbg.report().steps) == 2


def test_the_default_probes_watch_only_components_whose_dtype_can_overflow(tmp_path):
    """fp32 (and bf16) components are checked at their call site, with no probe: their activations
    cannot come near their dtype's largest value, and a NaN/Inf is named by a replay. In fp16 (or
    under autocast to fp16 at attach) a text encoder or VAE gets full probes on its first call,
    which see a near-overflow inside a block, and its block sentinel after (test_fp16_probes.py);
    the denoiser its block sentinel."""
    import torch

    pipe = tiny_pipeline("sd")
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        assert dbg._steps.probes.levels == {"unet": "output", "text_encoder": "output", "vae": "output"}
        assert list(dbg._steps.probes.probes) == []
    pipe.vae.to(torch.bfloat16)
    pipe.text_encoder.half()
    pipe.unet.half()
    with dbg:
        assert dbg._steps.probes.levels == {"unet": "sentinel", "text_encoder": "full", "vae": "output"}
        assert list(dbg._steps.probes.probes) == ["unet", "text_encoder"]
    pipe.vae.float()
    pipe.text_encoder.float()
    pipe.unet.float()
    with torch.autocast("cpu", dtype=torch.float16), dbg:
        assert dbg._steps.probes.levels == {"unet": "sentinel", "text_encoder": "full", "vae": "full"}
    dbg.close()
    with DiffusionModelDebugger(pipe, cfg(tmp_path, probes="full")) as full:
        assert full._steps.probes.levels == {"unet": "full", "text_encoder": "full", "vae": "full"}


def test_non_finite_latents_reaching_an_unprobed_vae_are_a_consequence_without_a_replay(tmp_path):
    pipe = tiny_pipeline("sd")
    with plant(pipe.unet.get_submodule(UNET_LEAF), 1):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
        with dbg:
            run(pipe, steps=2)
    report = dbg.report()
    errors = [a for a in kinds(report, "nonfinite") if a.severity == "error"]
    assert [(a.component, a.module, a.step) for a in errors] == [("unet", UNET_LEAF, 1)]
    (vae,) = [a for a in kinds(report, "nonfinite") if a.component == "vae"]
    assert vae.severity == "warning"
    assert vae.details["localized_by"] == "output check: its inputs were already non-finite"
    replayed = [e["component"] for e in dbg.record.events if e["type"] == "replay"]
    assert replayed == ["unet"]  # the block, to name the conv inside it; never the VAE


def test_the_kept_arguments_read_are_those_of_the_site_being_checked(tmp_path):
    """The VAE has two call sites (``encoder``, ``decoder``): with both calls kept, the decoder's
    check reads the decoder's arguments (the first site's, the encoder's finite image, said the
    decoder's NaN latents were finite: a consequence taken for a producer)."""
    import torch

    from diffusion_debug.diffusion import origins
    from diffusion_debug.diffusion.components.call_sites import CallSiteHooks, kept_arguments
    from diffusion_debug.diffusion.components.inventory import find_components

    def reraise(where, error):
        raise error

    pipe = tiny_pipeline("sd")
    calls = CallSiteHooks(find_components(pipe), cfg(tmp_path))
    handle = calls.register(
        busy=lambda: False,
        failed=reraise,
        on_start=lambda *_: None,
        on_output=lambda *_: None,
    )
    latents = torch.zeros(1, 4, 8, 8)
    latents[0, 0, 0, 0] = float("nan")
    with torch.no_grad():
        pipe.vae.encoder(torch.zeros(1, 3, 32, 32))
        pipe.vae.decoder(latents)
    handle.remove()

    def nonfinite(prefix):
        module, args, kwargs = kept_arguments(calls, "vae", prefix)
        return module, origins.nonfinite_names(origins.call_arguments(module, args, kwargs))

    assert nonfinite("decoder") == (pipe.vae.decoder, ["sample"])
    assert nonfinite("encoder") == (pipe.vae.encoder, [])
    assert kept_arguments(calls, "unet", "") is None


def test_calls_stopped_by_a_keyboard_interrupt_leave_a_bounded_number_of_starts(tmp_path):
    """A component call stopped by KeyboardInterrupt runs no post-hook (torch's ``always_call`` is
    for Exceptions): its start stays behind, and component calls that never step begin no new run
    to clear them. Held per site at most ``_OPEN_CALLS`` (the oldest dropped): 50 interrupted calls
    hold 8 starts, and the next call is timed and counted as usual."""
    import torch

    from diffusion_debug.diffusion.components.call_sites import _OPEN_CALLS

    pipe = tiny_pipeline("sd")
    encoder = pipe.text_encoder
    ids = torch.zeros(1, 8, dtype=torch.long)

    def interrupt(module, args):
        raise KeyboardInterrupt

    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, log_level="error"))
    with dbg:
        calls = dbg._steps.calls
        with encoder.register_forward_pre_hook(interrupt):  # after ours: our pre-hook has run
            for _ in range(50):
                try:
                    encoder(ids)
                except KeyboardInterrupt:
                    pass
        assert [len(starts) for starts in calls._started.values()] == [_OPEN_CALLS] == [8]
        before = calls.runtime.get("text_encoder", {}).get("calls", 0)
        encoder(ids)
        assert calls.runtime["text_encoder"]["calls"] == before + 1
        assert calls.runtime["text_encoder"]["total_time_s"] > 0
        assert [len(starts) for starts in calls._started.values()] == [_OPEN_CALLS - 1]
    dbg.close()


@pytest.mark.parametrize("call", ["encode_prompt", "text_encoder"])
def test_an_encode_only_calls_nan_is_named_as_the_call_returns(tmp_path, call):
    """Issue 45: an encoder's calls are read together (one read for a pipeline call's prompt and
    negative prompt), before the next call. ``pipe.encode_prompt(...)`` or the text encoder called
    alone has no next call: its finding waited for the next event, ``report()`` or detach. Read as
    the call returns where no pipeline call runs (a pipeline call's reads stay as they were:
    test_fp16_probes pins its flushes), the NaN is named at its module right after the call."""
    import torch

    pipe = tiny_pipeline("sd")
    leaf = next(n for n, _ in pipe.text_encoder.named_modules() if n.endswith("layers.1.mlp.fc1"))
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    handle = plant(pipe.text_encoder.get_submodule(leaf), 0, lambda out: torch.full_like(out, float("nan")))
    try:
        with dbg, torch.no_grad():
            if call == "encode_prompt":
                pipe.encode_prompt("a cat", "cpu", 1, True, negative_prompt="")
            else:
                pipe.text_encoder(pipe.tokenizer("a cat", return_tensors="pt").input_ids)
            found = [(a.kind, a.component, a.module) for a in dbg.record.anomalies if a.kind == "nonfinite"]
            held = len(dbg._steps.encoded)
    finally:
        handle.remove()
    dbg.close()
    assert held == 0 and found == [("nonfinite", "text_encoder", leaf)], found


def _skip_where_a_compiled_decode_fails_unwatched():
    """The floor stack (torch 2.5.1, diffusers 0.32.2) cannot compile ``vae.decode`` at all: dynamo raises
    ``NameError: name 'torch' is not defined`` in diffusers' ``apply_forward_hook`` wrapper, with no
    debugger. Tried on a pipeline of its own, so the test's pipeline is compiled only once."""
    import torch

    pipe = tiny_pipeline("sd")
    torch._dynamo.reset()
    decode = torch.compile(pipe.vae.decode, backend="eager")
    try:
        with torch.no_grad():
            decode(torch.zeros(1, 4, 8, 8))
    except Exception as error:  # noqa: BLE001 (whatever this stack's dynamo raises)
        pytest.skip(f"this torch cannot compile vae.decode, unwatched too ({type(error).__name__}: {error})")
    finally:
        torch._dynamo.reset()


def _hooked_vae_calls(tmp_path, held_calls: int, compiled: bool):
    """A tiny SD pipeline's call sites hooked on their own (every error raised), the VAE's ``decode``
    compiled (``backend="eager"``) where ``compiled``: its decoder is then watched around it."""
    import torch

    from diffusion_debug.diffusion.components.call_sites import CallSiteHooks
    from diffusion_debug.diffusion.components.inventory import find_components

    def reraise(where, error):
        raise error

    pipe = tiny_pipeline("sd")
    if compiled:
        _skip_where_a_compiled_decode_fails_unwatched()
        torch._dynamo.reset()
        pipe.vae.decode = torch.compile(pipe.vae.decode, backend="eager")
    calls = CallSiteHooks(find_components(pipe), cfg(tmp_path), held_calls=held_calls)
    handle = calls.register(busy=lambda: False, failed=reraise, on_start=lambda *_: None, on_output=lambda *_: None)
    return pipe, calls, handle


def test_a_site_called_twice_in_a_step_with_one_held_call_keeps_the_last(tmp_path):
    """``held_calls=1`` (the constructor's default: only the kept call, none before it): a second call
    of a site in the step is kept in place of the first. The oldest held call was deleted before the new
    one was added, from a list still empty: an IndexError, and the second call went unkept."""
    import torch

    from diffusion_debug.diffusion.components.call_sites import kept_arguments

    pipe, calls, handle = _hooked_vae_calls(tmp_path, held_calls=1, compiled=False)
    first, second = torch.zeros(1, 4, 8, 8), torch.ones(1, 4, 8, 8)
    with torch.no_grad():
        pipe.vae.decoder(first)
        pipe.vae.decoder(second)
    handle.remove()
    module, args, kwargs = kept_arguments(calls, "vae", "decoder")
    assert module is pipe.vae.decoder and torch.equal(args[0], second)
    assert calls.earlier == {("vae", "decoder"): []}


def test_a_compiled_decodes_call_made_the_halfs_and_then_held_is_kept_apart_from_the_latents(tmp_path):
    """A VAE whose ``decode`` is compiled keeps its decoder's call as the method's until a use makes the
    half's own arguments (a check, :func:`kept_arguments`); a second decode in the step then holds that call
    among the earlier ones, and the scheduler step's :meth:`keep_apart` read it as ``(args, kwargs)``: a
    TypeError (a ``debugger_error``, the step's kept calls not cloned apart from the latents). In the debugger
    a VAE call's check drops its kept call as it ends, so only a check that failed after making them left one."""
    import torch

    from diffusion_debug.diffusion.components.call_sites import kept_arguments

    pipe, calls, handle = _hooked_vae_calls(tmp_path, held_calls=3, compiled=True)
    latents = torch.zeros(1, 4, 8, 8)
    with torch.no_grad():
        pipe.vae.decode(latents)
        assert kept_arguments(calls, "vae", "decoder")[0] is pipe.vae.decoder  # the half's arguments made
        pipe.vae.decode(latents + 1)
        calls.keep_apart(latents)
    handle.remove()
    assert [len(held) for held in calls.earlier.values()] == [1]
    module, args, kwargs = kept_arguments(calls, "vae", "decoder")
    with torch.no_grad():  # the second decode's, as its decoder was passed them
        assert module is pipe.vae.decoder and torch.equal(args[0], pipe.vae.post_quant_conv(latents + 1))
