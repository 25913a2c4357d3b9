"""The job behind ``diffusion-debug run``: one pipeline call with a :class:`DiffusionModelDebugger` attached.

Every value is checked before the pipeline runs; ``invocation.json`` (what was loaded, for the
report's replay command) is written as soon as the run directory exists, so every run directory
has it (also one saved by policy ``raise``); once the pipeline ran, ``image.png`` is written first
(then the report and ``report.html``), and a pipeline that raises or is interrupted still leaves a
run directory for ``diffusion-debug report``. Messages go to stderr on one line;
:func:`run_pipeline` returns the command's exit code.

Limits: one prompt, one image (the first the pipeline returns is saved); the generator is a CPU
generator seeded with ``seed``, so the image matches a plain call with the same generator.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import DebugConfig
from ..errors import DiffusionDebugError
from . import pipeline_loading as loading  # looked up at call time: tests plant a failing loader there
from .launch_end import saved_line
from .outcome_lines import each_warning_once, print_replay_commands, repeat_verdict, stop_line
from .pipeline_loading import disk_reason, one_line
from .progress import denoising_bar_config


@dataclass
class RunOptions:
    """What ``run`` was asked for (the CLI's flags)."""

    model: str | None = None
    kind: str = "sd"
    dtype: str = "float32"
    device: str | None = None
    prompt: str = "a photo of an astronaut riding a horse"
    negative_prompt: str | None = None
    steps: int = 20
    guidance_scale: float = 7.5
    height: int | None = None
    width: int | None = None
    seed: int = 0
    repeat: int = 1
    """Run the same call this many times with the same seed; a different image is ``nondeterministic``."""
    profile: int | None = None
    """Profile this denoising step of the (first) call: a trace, a CUDA memory snapshot, the top modules."""
    progress: bool = False
    """Show the pipeline's own bar of denoising steps on stderr (the CLI: a terminal, without --quiet)."""
    html: bool = True
    """Write report.html (``--no-html``: the run directory, image.png and the terminal summary without it)."""


def run_pipeline(options: RunOptions, config: DebugConfig) -> int:
    """Load, check, run with the debugger, write ``image.png`` and the report; the exit code."""
    import logging

    from ..diffusion import DiffusionModelDebugger

    if options.profile is not None and options.profile >= options.steps:
        raise DiffusionDebugError(
            f"--profile {options.profile} is not a denoising step of a {options.steps}-step run "
            f"(steps count from 0; at most {options.steps - 1})."
        )
    pipe = loading.load_pipeline(options.model, options.kind, options.dtype, options.device)
    loading.check_run_values(pipe, options.steps, options.height, options.width)
    _check_profile(pipe, options)
    debugger = DiffusionModelDebugger(pipe, config)
    try:  # before the call: policy 'raise' saves the run (and its report's replay command) mid-call
        save_invocation(debugger.record.run_dir, options)
    except OSError:
        pass  # written again with the results, where a full disk is said in one line
    profiler = _profiler(pipe, options, debugger.record.run_dir)
    if debugger.server_url:  # config serve_port
        print(f"serving the live run at {debugger.server_url}/debug/summary", flush=True)
    kwargs: dict[str, Any] = dict(
        num_inference_steps=options.steps,
        guidance_scale=options.guidance_scale,
    )
    if options.negative_prompt:
        kwargs["negative_prompt"] = options.negative_prompt
    if options.height:
        kwargs["height"] = options.height
    if options.width:
        kwargs["width"] = options.width
    if profiler is not None:
        kwargs["callback_on_step_end"] = profiler.callback

    # the table printed after the run lists every anomaly; log lines during it would repeat them
    ours = logging.getLogger("diffusion_debug")
    level = ours.level
    ours.setLevel(logging.CRITICAL)
    verdict = None
    try:
        with debugger, each_warning_once():
            if profiler is not None:
                profiler.begin()
            outputs = []
            for index in range(options.repeat):
                label = "run" if options.repeat == 1 else f"run {index + 1}/{options.repeat}"
                pipe.set_progress_bar_config(**denoising_bar_config(options.progress, label))
                outputs.append(pipe(options.prompt, **_seeded(kwargs, options.seed)).images)
        images = outputs[0]
        if options.repeat > 1:
            verdict = repeat_verdict(_check_determinism(debugger, outputs), options.repeat, options.seed)
    except DiffusionDebugError as error:
        if error.anomaly is None:
            _finish_profile(profiler)  # nothing stays hooked or recording
            raise
        # whole: the run directory's path is at its end
        print(one_line(f"diffusion-debug: stopped by policy '{config.policy}': {error}", 20_000), file=sys.stderr)
        if profiler is not None:  # the policy saved the run before the profile was written: again, with it
            save_quietly(debugger, _finish_profile(profiler))
        if error.run_dir:
            print_run(error.run_dir)
            print_replay_commands(error.run_dir)
        return 1
    except (Exception, KeyboardInterrupt) as error:  # the pipeline failed: keep what was seen
        run_dir = save_quietly(debugger, _finish_profile(profiler))
        what = "interrupted" if isinstance(error, KeyboardInterrupt) else one_line(f"{type(error).__name__}: {error}")
        kept = (
            f"the run so far is in {run_dir} (diffusion-debug report DIR)" if run_dir else "no report could be saved"
        )
        print(f"diffusion-debug run: the pipeline failed: {what}; {kept}.", file=sys.stderr)
        return 130 if isinstance(error, KeyboardInterrupt) else 1
    finally:
        ours.setLevel(level)
        pipe.set_progress_bar_config(disable=True)
        debugger.close()
    return _write_results(debugger, images, options, _finish_profile(profiler), verdict)


def _check_profile(pipe: Any, options: RunOptions) -> None:
    """--profile STEP needs a pipeline that reports the end of each step."""
    from ..diffusion.profiling import takes_step_callback

    if options.profile is not None and not takes_step_callback(pipe):
        raise DiffusionDebugError(
            f"--profile needs a pipeline whose call takes callback_on_step_end; {type(pipe).__name__} does not."
        )


def _profiler(pipe: Any, options: RunOptions, run_dir: Path) -> Any:
    """The step profiler of --profile, over every nn.Module component of the pipeline; None without it."""
    import torch
    from torch import nn

    from ..diffusion.profiling import StepProfiler

    if options.profile is None:
        return None
    from ..diffusion.components.inventory import find_components, is_loop_role

    components = {k: v for k, v in getattr(pipe, "components", {}).items() if isinstance(v, nn.Module)}
    loop = [c.module for c in find_components(pipe) if is_loop_role(c.role)]
    # where the denoiser runs: with enable_model_cpu_offload pipe.device says cpu, the execution device cuda
    device = torch.device(getattr(pipe, "_execution_device", None) or getattr(pipe, "device", "cpu"))
    return StepProfiler(options.profile, components, run_dir, device, loop)


def _finish_profile(profiler: Any) -> dict[str, Any] | None:
    """Write the profile's files; the summary's ``profile`` entry (None without --profile)."""
    if profiler is None:
        return None
    try:
        return profiler.finish()
    except Exception as error:  # a profile that cannot be written must not cost the run its report
        return {"step": profiler.step, "note": one_line(f"the profile failed: {type(error).__name__}: {error}")}


def _report(debugger: Any, profile: dict[str, Any] | None) -> Any:
    """The debugger's report, with the profile's entry in its summary."""
    report = debugger.report()
    if profile is not None:
        report.summary["profile"] = profile
    return report


def _seeded(kwargs: dict[str, Any], seed: int) -> dict[str, Any]:
    """The call's arguments with a fresh CPU generator seeded with ``seed`` (one per repeat)."""
    import torch

    return dict(kwargs, generator=torch.Generator("cpu").manual_seed(seed))


def _check_determinism(debugger: Any, outputs: list[Any]) -> list[Any]:
    """Compare each repeat with the first: their recorded step rows and their first image; the
    ``nondeterministic`` anomalies found (also recorded)."""
    from ..diffusion.determinism import compare_runs

    rows: dict[Any, list[dict[str, Any]]] = {}
    for row in debugger.report().steps:
        rows.setdefault(row.get("run"), []).append(row)
    runs = list(rows.values())
    found = []
    for index in range(1, min(len(runs), len(outputs))):
        for anomaly in compare_runs(runs[0], runs[index], outputs[0][0], outputs[index][0]):
            anomaly.details["runs"] = [1, index + 1]
            debugger.sink.emit(anomaly)
            found.append(anomaly)
    return found


def _write_results(
    debugger: Any, images: Any, options: RunOptions, profile: dict[str, Any] | None = None, verdict: str | None = None
) -> int:
    """image.png first (a full disk must not cost the user the picture for the report), then the rest."""
    from ..report import write_html

    run_dir = debugger.record.run_dir
    image = run_dir / "image.png"
    try:
        if images is not None and len(images) and hasattr(images[0], "save"):
            images[0].save(image)
        else:
            image = None
    except OSError as error:
        print(f"diffusion-debug run: error: image.png could not be written: {disk_reason(error)}.", file=sys.stderr)
        save_quietly(debugger, profile)
        return 1
    try:
        _report(debugger, profile).save(html=False)
        save_invocation(run_dir, options)
        if options.html:
            write_html(run_dir)  # with the image and the replay command's --model
    except OSError as error:
        kept = f"; the image is kept: {image}" if image is not None else ""
        print(
            f"diffusion-debug run: error: the report could not be saved: {disk_reason(error)}{kept}.",
            file=sys.stderr,
        )
        return 1
    print_run(run_dir)
    for line in (verdict, stop_line(run_dir)):
        if line:
            print(line)
    print(f"\n{saved_line(run_dir, options.html, '--no-html')}")
    return 0


def print_run(run_dir: str | Path) -> None:
    """The terminal summary of a saved run."""
    from ..record import load_run
    from ..report.terminal import render_terminal

    print(render_terminal(load_run(run_dir)))


def save_quietly(debugger: Any, profile: dict[str, Any] | None = None) -> Path | None:
    """Save what the debugger saw (the run directory ``report`` reads); None if even that failed
    (``events.jsonl`` then still holds every line streamed, for ``report`` to rebuild from)."""
    try:
        return _report(debugger, profile).save()
    except Exception:
        events = debugger.record.events_path
        return events.parent if events.is_file() else None


def save_invocation(run_dir: Path, options: RunOptions) -> None:
    """What ``run`` loaded, for the report's replay command (bundles hold no weights)."""
    loading.write_invocation(run_dir, "run", options.model, options.kind, options.dtype)
