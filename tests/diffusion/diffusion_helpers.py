"""Helpers for the DiffusionModelDebugger tests: run a tiny pipeline, plant a fault."""

from __future__ import annotations

import tempfile
from contextlib import contextmanager

import torch
from torch._dynamo.utils import counters

from diffusion_debug import DebugConfig, DiffusionModelDebugger

PROMPT = "a photo of a cat"

SD_FP16_VAE = (
    "this pipeline does not read vae.config.force_upcast (SDXL's do): pipe.vae.to(torch.float32); where the call "
    'then fails in the VAE (its float16 latents or input image), instead call it with output_type="latent" (its VAE '
    "as it is), then pipe.vae.to(torch.float32) and decode the latents cast to float32"
)
"""The advice for a float16 SD 1.5 VAE: ``StableDiffusionPipeline`` reads no ``force_upcast``."""
ANY_FP16_VAE = (
    "keep the VAE in float32 for the decode: vae.config.force_upcast=True where the pipeline reads it (SDXL's do), "
    "otherwise pipe.vae.to(torch.float32); where the call then fails in the VAE (its float16 latents or input "
    'image), instead call it with output_type="latent" (its VAE as it is), then pipe.vae.to(torch.float32) and '
    "decode the latents cast to float32"
)
"""The advice for a float16 SD VAE where whether its pipeline reads ``force_upcast`` is not known."""
SDXL_FP16_VAE = (
    "keep the VAE in float32 for the decode (vae.config.force_upcast=True: this pipeline then upcasts the VAE and "
    "the latents), or use an fp16-fixed VAE such as madebyollin/sdxl-vae-fp16-fix"
)
"""The advice for a float16 SDXL VAE in a pipeline that reads its ``force_upcast``."""
BF16_VAE = "it ran in bfloat16, whose range is float32's, so this is no overflow of a narrow dtype"
"""What a bfloat16 VAE's NaN/Inf (no autocast) is told: float32 holds no more."""


def run(pipe, steps: int = 3, **kwargs):
    kwargs.setdefault("output_type", "np")
    prompt = kwargs.pop("prompt", PROMPT)
    return pipe(prompt, num_inference_steps=steps, generator=torch.Generator().manual_seed(0), **kwargs).images


def warmed(pipe, call, output_dir: str | None = None, **config):
    """A debugger of ``pipe`` whose first run, ``call(pipe)`` (full probes on the components called once
    per image: the VAE, the text encoders), is behind it."""
    output_dir = output_dir or tempfile.mkdtemp()
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=output_dir, log_level="error", **config))
    with dbg:
        call(pipe)
    return dbg


def plant(module: torch.nn.Module, from_call: int, make=None):
    """Forward hook that replaces ``module``'s output from its ``from_call``-th call (0-based) on;
    returns the hook handle.  Default: every element +inf."""
    calls = {"n": 0}
    make = make or (lambda out: torch.full_like(out, float("inf")))

    def hook(mod, args, output):
        n = calls["n"]
        calls["n"] += 1
        if n >= from_call:
            return make(output)
        return None

    return module.register_forward_hook(hook)


@contextmanager
def scaled(module, by: float):
    """``module``'s weight and bias multiplied by ``by`` while the block runs, put back after."""
    saved = [p.detach().clone() for p in (module.weight, module.bias)]
    with torch.no_grad():
        module.weight.mul_(by)
        module.bias.mul_(by)
    try:
        yield
    finally:
        with torch.no_grad():
            module.weight.copy_(saved[0])
            module.bias.copy_(saved[1])


@contextmanager
def changed_weight(module: torch.nn.Module, change):
    """``module``'s weight changed in place by ``change(weight)`` while the block runs, put back after
    (a compiled graph reads a weight like any input: no recompile)."""
    weight = module.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        change(weight)
    try:
        yield
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def inf_weight(module: torch.nn.Module):
    """An Inf in ``module``'s first weight while the block runs."""
    return changed_weight(module, lambda weight: weight.view(-1)[:1].fill_(float("inf")))


def dynamo_counts() -> tuple[int, int]:
    """Dynamo's graph breaks and graphs made so far in the process (its ``counters``)."""
    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def pipeline_hooks(pipe) -> int:
    """The forward hooks and pre-hooks on every module of every component of ``pipe``."""
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks)
        for c in pipe.components.values()
        if isinstance(c, torch.nn.Module)
        for m in c.modules()
    )


T5_WO = "encoder.block.0.layer.1.DenseReluDense.wo"


def t5_near_max(t5: torch.nn.Module, call):
    """A float16 T5 (a tiny Flux's ``text_encoder_2``) whose embeddings run at 0.45 of float16's max (measured by
    one ``call()``); returns ``wo_at(scale)``, which sets ``wo``'s weights so that its output peaks at ``scale`` x
    float16's max (2.0: an Inf, which T5 clamps in its block)."""
    fp16_max = torch.finfo(torch.float16).max
    wo, embed = t5.get_submodule(T5_WO), t5.encoder.embed_tokens
    peaks = {}
    hooks = [m.register_forward_hook(lambda _m, _a, out, k=k: peaks.__setitem__(k, out.abs().max().item()))
             for k, m in (("wo", wo), ("embed", embed))]  # fmt: skip
    call()
    for hook in hooks:
        hook.remove()
    base = wo.weight.detach().clone()
    with torch.no_grad():
        embed.weight.mul_(0.45 * fp16_max / peaks["embed"])

    def wo_at(scale: float) -> None:
        with torch.no_grad():
            wo.weight.copy_(base * (scale * fp16_max / peaks["wo"]))

    return wo_at


def assert_watched_unchanged_and_fault_named(
    tmp_path, build, call, component: str, module: str, from_call: int, step, compiled: bool = False, told=()
):
    """The sweeps' one check of a pipeline ``build()`` makes: two ``call``s on one attach and a call after
    detach bitwise equal to an unwatched twin's three, nothing reported; then on a fresh pipeline an Inf
    planted in ``component``'s ``module`` from its ``from_call``-th call (0-based) named as the one error,
    ``nonfinite`` at exactly that component, module and ``step``. ``told``: the kinds the clean run rightly
    reports (a tiny SD's scheduler at 3 steps: ``scheduler_config``). ``compiled``: dynamo is reset before
    each pipeline is built (neither reuses the other's code) and each call's graph breaks and graphs made
    are the twin's."""
    from diffusion_debug.testing import plant_nonfinite

    def counted(pipe):
        before = dynamo_counts()
        image = call(pipe)
        return image, tuple(after - was for after, was in zip(dynamo_counts(), before))

    if compiled:
        torch._dynamo.reset()
    twin = build()
    expected = [counted(twin) for _ in range(3)]
    if compiled:
        torch._dynamo.reset()
    pipe = build()
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path / "clean"), log_level="error"))
    with dbg:
        seen = [counted(pipe), counted(pipe)]
    seen.append(counted(pipe))  # detached
    for (image, graphs), (twins, twin_graphs) in zip(seen, expected):
        torch.testing.assert_close(image, twins, rtol=0, atol=0)
        assert not compiled or graphs == twin_graphs
    found = [(a.kind, a.component, a.module, a.step) for a in dbg.report().anomalies]
    assert found == [(kind, "", "", None) for kind in told]
    dbg.close()

    pipe = build()
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path / "fault"), log_level="error"))
    with plant_nonfinite(getattr(pipe, component).get_submodule(module), from_call=from_call), dbg:
        call(pipe)
    errors = [a for a in dbg.report().anomalies if a.severity == "error"]
    assert [(a.kind, a.component, a.module, a.step) for a in errors] == [("nonfinite", component, module, step)]
    dbg.close()
