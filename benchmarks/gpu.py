"""The real-size GPU run: an SD1.5-size pipeline in fp16 (UNet 860M with the SD1.5 config, the SD
VAE, a 12-layer CLIP text encoder, random weights), 512x512, 20 steps, classifier-free guidance.

Sections, each timed interleaved in one process (``harness.interleaved``) and written as soon as it
ends, so a run cut short keeps what it measured:

- ``inference``: plain vs the debugger with probes off, level basic, the default and full probes
  (``benchmarks.user_path``'s feature table, the same cases as its CPU proxy), and one blocking
  sync per step for scale; ``inference_bf16``: the same with the pipeline in bf16;
- ``one_step``: a 1-step call without guidance (the turbo / LCM shape), plain vs a reused debugger
  vs one attached once around all the calls (on a twin of the pipeline) vs one made per call: the
  fixed cost per call; and the same call component by component (text
  encoder, UNet, VAE decode, the rest), each synced, plain vs the reused debugger;
- ``syncs``: blocking host syncs the default debugger adds per step, and the loop under
  ``torch.cuda.set_sync_debug_mode("error")``;
- ``ops``: aten ops added per denoising step (default mode);
- ``checks``: the image is bitwise the plain one (default and full probes); a real CUDA
  out-of-memory error is named at its block; a memory snapshot pickles the allocator's state;
- ``training``: one SD1.5-UNet training step under Accelerate fp16 and bf16, clipped at 1.0 as
  diffusers' scripts clip, plain (no debugger attached) vs TrainingDebugger vs
  ``torch.autograd.detect_anomaly``; the step ``benchmarks.user_path`` times on the CPU
  (``benchmarks.training``);
- ``offload``: ``enable_model_cpu_offload``, watched, and the image compared with the plain one;
- ``compiled``: ``torch.compile`` (inductor) UNet, plain vs watched, with dynamo's counts (last:
  inductor compiles the UNet for a minute or more).

``python -m benchmarks.gpu --out gpu.md`` on a CUDA machine (``python -m benchmarks.run`` calls
:func:`run` there); ``python -m benchmarks.gpu --smoke`` runs every section on the CPU with the tiny
pipeline in seconds: a check that the code runs, not figures. Nothing here downloads.

Over 500 lines: one file for the one command a borrowed GPU runs, its sections sharing one
``Setup``; the shared measuring code is already elsewhere (``harness``, ``user_path``,
``per_component``, ``op_counts``, ``training``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger, TrainingDebugger

from .harness import Comparison, interleaved, machine, smoke_warm_ups
from .models import sd15_unet
from .per_component import Split
from .training import CLIP, AccelerateStep, accelerate_steps, plain_vs_watched, reset_accelerate

SECTIONS = ("inference", "inference_bf16", "one_step", "syncs", "ops", "checks", "training", "offload", "compiled")
PROMPT = "a photo of an astronaut"


@dataclass
class Setup:
    """What every section runs on: the real size on CUDA, or the tiny pipeline on the CPU (smoke)."""

    pipe: Any
    device: str
    steps: int
    repeats: int
    out: str
    smoke: bool

    def generator(self) -> torch.Generator:
        return torch.Generator(self.device).manual_seed(0)

    def call(self, pipe: Any = None, steps: int | None = None, **kwargs: Any) -> Any:
        pipe = pipe or self.pipe
        kwargs.setdefault("generator", self.generator())
        return pipe(PROMPT, num_inference_steps=steps or self.steps, **kwargs)

    def config(self, **kwargs: Any) -> DebugConfig:
        return DebugConfig(output_dir=self.out, **kwargs)


def sd15_pipeline(dtype: torch.dtype = torch.float16, device: str = "cuda") -> Any:
    """An SD1.5-size StableDiffusionPipeline with random weights, built offline."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline
    from transformers import CLIPTextConfig, CLIPTextModel

    from diffusion_debug.testing import tiny_pipeline

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vae = AutoencoderKL(
            block_out_channels=(128, 256, 512, 512),
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            latent_channels=4,
            layers_per_block=2,
            sample_size=512,
        )
        text_encoder = CLIPTextModel(
            CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)
        )
    tokenizer = tiny_pipeline("sd").tokenizer  # a CLIP tokenizer built offline (77 tokens)
    pipe = StableDiffusionPipeline(
        unet=sd15_unet(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device=device, dtype=dtype)


def make_setup(smoke: bool, out: str | None = None) -> Setup:
    out = out or tempfile.mkdtemp(prefix="diffusion-debug-gpu-")
    if smoke:
        from diffusion_debug.testing import tiny_pipeline

        pipe = tiny_pipeline("sd")
        pipe.set_progress_bar_config(disable=True)
        return Setup(pipe, "cpu", steps=2, repeats=1, out=out, smoke=True)
    return Setup(sd15_pipeline(), "cuda", steps=20, repeats=7, out=out, smoke=False)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def inference(setup: Setup) -> dict[str, Any]:
    names = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
    name = names.get(setup.pipe.unet.dtype, str(setup.pipe.unet.dtype))

    def synced() -> None:  # the cost of one blocking sync per step, for scale
        setup.call(callback_on_step_end=lambda p, i, t, kw: _sync() or {})

    # what the watched call finds on these random weights (a finding changes what is timed)
    debugger = DiffusionModelDebugger(setup.pipe, setup.config())
    with debugger:
        setup.call(output_type="latent")
    found = sorted({a.kind for a in debugger.report().anomalies})
    debugger.close()
    from .user_path import feature_cases

    result = interleaved(
        f"SD1.5 size, {name}, 512x512, {setup.steps} steps (CFG)",
        {**feature_cases(setup.call, setup.pipe, setup.out), "plain + one sync per step": synced},
        repeats=setup.repeats,
    )
    return {"comparison": result, "anomaly_kinds_found": found}


def in_bf16(setup: Setup) -> Setup:
    """``setup`` with the same pipeline built in bf16 (a second copy: the fp16 one stays as it is
    for the sections after)."""
    if setup.smoke:
        from diffusion_debug.testing import tiny_pipeline

        pipe = tiny_pipeline("sd", dtype=torch.bfloat16)
        pipe.set_progress_bar_config(disable=True)
    else:
        pipe = sd15_pipeline(torch.bfloat16)
    return dataclasses.replace(setup, pipe=pipe)


def one_step(setup: Setup) -> dict[str, Any]:
    from .call_cost import ATTACHED, PER_CALL, REUSED
    from .call_cost import one_step as trailing

    pipe = trailing(setup.pipe)
    served = copy.deepcopy(pipe)  # watched by one attach throughout: call_cost's twin, as there

    def plain() -> None:
        setup.call(pipe, steps=1, guidance_scale=0.0)

    def served_call() -> None:
        setup.call(served, steps=1, guidance_scale=0.0)

    reused = DiffusionModelDebugger(pipe, setup.config())
    serving = DiffusionModelDebugger(served, setup.config())

    def watched_reused() -> None:
        with reused:
            plain()

    def watched_new() -> None:
        with DiffusionModelDebugger(pipe, setup.config()):
            plain()

    try:
        serving.attach()
        result = interleaved(
            "1 step, no guidance, 512x512 (turbo-style)",
            {"plain": plain, REUSED: watched_reused, ATTACHED: served_call, PER_CALL: watched_new},
            repeats=setup.repeats * 5,
            warmup=3,
        )
    finally:
        reused.close()
        serving.close()
    from .user_path import one_step_split

    by_component = one_step_split(
        pipe,
        plain,
        title="1 step by component (synced)",
        repeats=setup.repeats * 3,
        output_dir=setup.out,
        clock="wall",
    )
    return {
        "comparison": result,
        "by_component": by_component,
        "plain_ms": 1e3 * result.median("plain"),
        "reused_added_ms": result.added_ms(REUSED),
        "reused_added_ms_interval": result.added_ms_interval(REUSED),
        "attached_added_ms": result.added_ms(ATTACHED),
        "per_call_added_ms": result.added_ms(PER_CALL),
    }


def syncs(setup: Setup) -> dict[str, Any]:
    """Blocking host syncs the default debugger adds per denoising step (torch's sync debug mode
    warns once per sync), and the watched loop from its second step to its last under
    ``set_sync_debug_mode("error")`` (the plain pipeline is run the same way first)."""
    if setup.device != "cuda":
        return {"note": "CUDA only"}

    def count(run: Callable[[int], Any], steps: int) -> int:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                run(steps)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)

    debugger = DiffusionModelDebugger(setup.pipe, setup.config())

    def plain(steps: int) -> None:
        setup.call(steps=steps)

    def watched(steps: int) -> None:
        with debugger:
            setup.call(steps=steps)

    added_long = count(watched, 10) - count(plain, 10)
    added_short = count(watched, 5) - count(plain, 5)
    steps = 10

    def strict_from_step_1(p: Any, i: int, t: Any, kwargs: dict) -> dict:
        torch.cuda.set_sync_debug_mode("error" if i < steps - 1 else "default")  # the VAE may read once
        return {}

    def strict_call() -> str:
        try:
            setup.call(steps=steps, callback_on_step_end=strict_from_step_1)
        except RuntimeError as error:
            return f"raised: {str(error).splitlines()[0]}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return "no sync"

    plain_strict = strict_call()
    with debugger:
        watched_strict = strict_call()
    debugger.close()
    return {
        "added_syncs_per_step": (added_long - added_short) / 5,
        "syncs_added_per_call_at_10_steps": added_long,
        "plain_loop_under_sync_error": plain_strict,
        "watched_loop_under_sync_error": watched_strict,
    }


def ops(setup: Setup) -> dict[str, Any]:
    from .op_counts import inference_ops

    return inference_ops(setup.pipe, setup.config())


def checks(setup: Setup) -> dict[str, Any]:
    """Correctness on the device: the watched image is bitwise the plain one; a real out-of-memory
    error (an allocation far beyond the card) is named at its block and leaves no memory held; a
    memory snapshot writes the allocator's pickle."""
    out: dict[str, Any] = {}
    plain = setup.call(output_type="pt").images
    for probes in ("sentinel", "full"):
        with DiffusionModelDebugger(setup.pipe, setup.config(probes=probes)):
            watched = setup.call(output_type="pt").images
        same = bool(((plain == watched) | (plain.isnan() & watched.isnan())).all())
        out[f"image_bitwise_equal_{probes}"] = same
    out["image_has_nonfinite"] = bool((~plain.isfinite()).any())

    block = setup.pipe.unet.up_blocks[1]
    huge = 1 << 46 if setup.device == "cuda" else None  # 64 TiB: a real allocator error

    def allocate(module: Any, args: Any) -> None:
        if huge is None:
            raise torch.OutOfMemoryError("CUDA out of memory. (smoke: planted on the CPU)")
        torch.empty(huge, dtype=torch.uint8, device=setup.device)

    _sync()
    held_before = torch.cuda.memory_allocated() if setup.device == "cuda" else 0
    handle = block.register_forward_pre_hook(allocate)
    debugger = DiffusionModelDebugger(setup.pipe, setup.config())
    try:
        with debugger:
            setup.call(steps=2)
        out["oom"] = "not raised"
    except torch.OutOfMemoryError as error:
        found = [a for a in debugger.report().anomalies if a.kind == "out_of_memory"]
        out["oom_raised"] = str(error).splitlines()[0][:160]
        out["oom_anomaly"] = (
            {"component": found[0].component, "module": found[0].module, "message": found[0].message[:300]}
            if found
            else None
        )
    finally:
        handle.remove()
    _sync()
    if setup.device == "cuda":
        out["cuda_mb_held_after_oom"] = (torch.cuda.memory_allocated() - held_before) / 2**20
    if setup.device == "cuda":  # diffusion_debug.memory reads the allocator's figures in one call
        from diffusion_debug.memory import memory_sample

        sample, mb = memory_sample(), 2**20
        out["memory_sample_matches_torch"] = (
            sample["cuda_allocated_mb"] * mb == torch.cuda.memory_allocated(),
            sample["cuda_reserved_mb"] * mb == torch.cuda.memory_reserved(),
            sample["cuda_peak_mb"] * mb == torch.cuda.max_memory_allocated(),
        )
    snapshot = debugger.memory_snapshot("gpu-check")
    out["memory_snapshot_files"] = snapshot["files"]
    out["memory_snapshot_bytes"] = {f: (debugger.record.run_dir / f).stat().st_size for f in snapshot["files"]}
    debugger.close()
    return out


def training(setup: Setup, mixed_precision: str, repeats: int | None = None) -> Comparison:
    """One UNet training step (batch 2, 64x64 latents at real size, clipped as diffusers' scripts
    clip) under Accelerate's mixed precision: plain vs the TrainingDebugger's default vs
    ``torch.autograd.detect_anomaly``, the step ``benchmarks.user_path`` times on the CPU. One UNet,
    not twins (860M parameters with AdamW): the plain cases run detached (``plain_vs_watched``)."""
    step, debugger, title = _training_case(setup, mixed_precision)
    try:
        return plain_vs_watched(title, [step], debugger, rounds=repeats or setup.repeats, warmup=1, anomaly_mode=True)
    finally:
        debugger.close()
        reset_accelerate()  # the process's next Accelerator starts afresh


def training_step(setup: Setup, mixed_precision: str) -> tuple[Callable[..., None], TrainingDebugger, str]:
    """``step(monitor=False)``: one training step of a fresh UNet under Accelerate (the training
    case's); the debugger that ``step(True)`` reports to; the case's title (``benchmarks.gpu_where``)."""
    step, debugger, title = _training_case(setup, mixed_precision)

    def run(monitor: bool = False) -> None:
        step(debugger if monitor else None)

    return run, debugger, title


def _training_case(setup: Setup, mixed_precision: str) -> tuple[AccelerateStep, TrainingDebugger, str]:
    if setup.smoke:
        unet, size, context_len = copy.deepcopy(setup.pipe.unet).float().train(), 8, 8
    else:
        unet, size, context_len = sd15_unet().train(), 64, 77
    shape = dict(device=setup.device, size=size, context_len=context_len, max_grad_norm=CLIP)
    (step,) = accelerate_steps([unet], mixed_precision, **shape)
    debugger = TrainingDebugger(step.model, accelerator=step.accelerator, config=setup.config())
    title = f"SD1.5 UNet training step, batch 2, {size}x{size} latents, Accelerate {mixed_precision}, clip {CLIP}"
    return step, debugger, title


def compiled(setup: Setup) -> dict[str, Any]:
    from .compiled import run as compiled_run

    backend = "aot_eager" if setup.smoke else "inductor"
    started = time.perf_counter()
    result, counts = compiled_run(
        setup.pipe, steps=setup.steps, repeats=max(3, setup.repeats - 2), output_dir=setup.out, backend=backend
    )
    return {"comparison": result, **counts, "seconds_with_compile": round(time.perf_counter() - started, 1)}


def offload(setup: Setup) -> dict[str, Any]:
    """``enable_model_cpu_offload`` (accelerate's hooks move each model to the GPU for its call),
    watched: the image is the plain offloaded one, and the debugger saw every step. The offload
    hooks are removed and the pipeline moved back to the device afterwards."""
    if setup.device != "cuda":
        return {"note": "CUDA only"}
    pipe = setup.pipe
    pipe.enable_model_cpu_offload()
    try:
        plain = setup.call(pipe, steps=4, output_type="pt").images
        debugger = DiffusionModelDebugger(pipe, setup.config())
        with debugger:
            watched = setup.call(pipe, steps=4, output_type="pt").images
        report = debugger.report()
        debugger.close()
    finally:
        pipe.remove_all_hooks()
        pipe.to(setup.device)
    return {
        "image_bitwise_equal": bool(((plain == watched) | (plain.isnan() & watched.isnan())).all()),
        "steps_recorded": len(report.steps),
        "anomaly_kinds": sorted({a.kind for a in report.anomalies}),
    }


def run(output_dir: str | None = None, *, smoke: bool = False, sections=SECTIONS, write=None) -> dict[str, Any]:
    """Every section in ``sections``; ``write(name, result)`` is called as each ends. A section
    that raises is recorded as its error and the run goes on."""
    setup = make_setup(smoke, output_dir)
    jobs: dict[str, Callable[[], Any]] = {
        "inference": lambda: inference(setup),
        "inference_bf16": lambda: inference(in_bf16(setup)),
        "one_step": lambda: one_step(setup),
        "syncs": lambda: syncs(setup),
        "ops": lambda: ops(setup),
        "checks": lambda: checks(setup),
        "training": lambda: {
            "fp16": training(setup, "no" if smoke else "fp16"),
            "bf16": training(setup, "bf16", repeats=1 if smoke else 5),
        },
        "compiled": lambda: compiled(setup),
        "offload": lambda: offload(setup),
    }
    results: dict[str, Any] = {}
    with smoke_warm_ups() if smoke else contextlib.nullcontext():  # smoke: checks, not figures
        for name in sections:
            started = time.perf_counter()
            try:
                results[name] = jobs[name]()
            except Exception:  # noqa: BLE001 -- a benchmark section's failure is a result
                results[name] = {"error": traceback.format_exc(limit=8)}
            results[name] = {**_as_dict(results[name]), "section_seconds": round(time.perf_counter() - started, 1)}
            if write is not None:
                write(name, results[name])
    return results


def _as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {"comparison": value}


def markdown(results: dict[str, Any]) -> str:
    """Each section: its timings as tables, an error as a traceback, the rest as JSON."""
    parts = []
    for name, result in results.items():
        tables, rest = _split(result)
        parts.append(f"### {name}\n")
        parts += [table.markdown() + "\n" for table in tables]
        if "error" in rest:
            parts.append(f"```\n{rest.pop('error')}```\n")
        parts.append("```json\n" + json.dumps(rest, indent=1, default=str) + "\n```\n")
    return "\n".join(parts)


def _split(result: dict[str, Any]) -> tuple[list[Comparison | Split], dict[str, Any]]:
    """The Comparisons and Splits in ``result`` (one level of nesting too), and what is left."""
    tables: list[Comparison | Split] = []
    rest: dict[str, Any] = {}
    for key, value in result.items():
        if isinstance(value, (Comparison, Split)):
            tables.append(value)
        elif isinstance(value, dict) and any(isinstance(v, (Comparison, Split)) for v in value.values()):
            inner_tables, inner_rest = _split(value)
            tables += inner_tables
            if inner_rest:
                rest[key] = inner_rest
        else:
            rest[key] = value
    return tables, rest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny pipeline on the CPU: checks, not figures")
    parser.add_argument("--out", type=Path, help="write the Markdown here, section by section")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu needs a CUDA GPU (or --smoke).")
    header = f"machine: {machine()}\n\n"
    done: dict[str, Any] = {}

    def write(name: str, result: dict[str, Any]) -> None:
        done[name] = result
        text = header + markdown(done)
        print(markdown({name: result}), flush=True)
        if args.out:
            args.out.write_text(text)

    print(header, flush=True)
    run(smoke=args.smoke, sections=args.sections, write=write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
