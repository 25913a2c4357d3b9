"""The jobs behind ``diffusion-debug diff RUN_A RUN_B`` (two saved runs compared as far as their
records allow) and ``diffusion-debug compare`` (two setups of a pipeline run and compared, as ``run``
runs one), and both commands' flags.

Each prints the first divergence (or ``equal within ...``), the modules of the first diverging
call, made there or received, and writes ``comparison.json`` and ``report.html`` into a new
directory under ``--output-dir`` (``diff-...`` / ``compare-...``). Exit code 0: equal within the
tolerance, 1: they diverge, 2: bad input (one line, before anything loads or is compared).

``compare``'s two sides share ``run``'s flags; ``--a`` / ``--b KEY=VALUE`` (repeatable) set one
side's :data:`SIDE_KEYS` over them. Two sides that load alike share one pipeline, and a side's
``compile`` is applied around its calls and undone.

Limits: ``compare`` compiles the denoiser only; diffusers' hooks (casting, caching) and LoRA are the
Python API's (``compare_pipelines(pipe, pipe, b=change)``).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import DiffusionDebugError
from . import pipeline_loading as loading  # looked up at call time: tests plant a loader there
from .cli_arguments import add_call_options
from .pipeline_loading import DTYPES

SIDE_KEYS = ("model", "kind", "dtype", "device", "compile")
"""What ``--a`` / ``--b`` set for one side: a pipeline directory, a built-in tiny ``kind``, the dtype it
loads in, its device, and ``compile=BACKEND`` (``torch.compile`` of the denoiser; ``off``: eager)."""
KINDS = ("sd", "sdxl", "sd3")
MODULES_PRINTED = 10


# -- printing and writing, both commands --------------------------------------------------------------


def _write(comparison: Any, output_dir: str, prefix: str) -> Path:
    from ..record import new_run_name, prepare_run_dir

    return comparison.save(prepare_run_dir(output_dir, new_run_name(prefix), exclusive=True))


def print_comparison(comparison: Any, out: Path) -> int:
    """The headline, the first diverging call's modules and where the report is; the exit code."""
    from ..report.terminal import table

    print(comparison.summary())
    modules = comparison.modules[:MODULES_PRINTED]
    if modules:
        print(f"\n{modules[0].component}: the modules of {comparison.modules_from}")
        drift = {True: "made there", False: "received"}
        rows = [(m.module or "(the component)", drift[m.made_here], m.relative_error, m.input_error) for m in modules]
        print(table(("module", "drift", "output error", "input error"), rows))
    print(f"\nreport: {out / 'report.html'}")
    return 0 if comparison.first_divergence is None else 1


# -- diff -----------------------------------------------------------------------------------------------


def diff_runs(run_a: Path, run_b: Path, output_dir: str) -> int:
    """Compare two saved runs; print and write the comparison; the exit code."""
    from ..diffusion.compare.saved_runs import checked_runs, compare_run_dirs

    checked_runs(run_a, run_b)  # one sentence before the output directory is made
    loading.check_output_dir(output_dir)
    comparison = compare_run_dirs(run_a, run_b)
    return print_comparison(comparison, _write(comparison, output_dir, "diff"))


# -- compare ----------------------------------------------------------------------------------------------


def side_settings(option: str, pairs: list[str], base: dict[str, Any]) -> dict[str, Any]:
    """One side's settings: ``base`` (the shared flags) with ``KEY=VALUE`` pairs over it, checked.

    >>> side_settings("--b", ["dtype=float16"], {"model": None, "kind": "sd", "dtype": "float32"})["dtype"]
    'float16'
    """
    settings = dict(base)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key, value = key.strip().replace("-", "_"), value.strip()
        if not sep or not key:
            raise DiffusionDebugError(f"{option} takes KEY=VALUE (e.g. {option} dtype=float16), not {pair[:60]!r}.")
        if key not in SIDE_KEYS:
            close = difflib.get_close_matches(key, SIDE_KEYS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise DiffusionDebugError(f"{option}: unknown key {key[:40]!r}; {hint}choose from {', '.join(SIDE_KEYS)}.")
        choices = {"dtype": DTYPES, "kind": KINDS}.get(key)
        if choices and value not in choices:
            raise DiffusionDebugError(f"{option} {key}: {value[:40]!r} is not one of {', '.join(choices)}.")
        settings[key] = value or None
    backend = settings.get("compile") or "off"
    if backend != "off":
        from torch._dynamo import list_backends

        known = list_backends(exclude_tags=())
        if backend not in known:
            raise DiffusionDebugError(
                f"{option} compile: {backend[:40]!r} is not a torch.compile backend; choose off or one of "
                f"{', '.join(sorted(known))}."
            )
    settings["compile"] = backend
    return settings


def _describe(settings: dict[str, Any]) -> str:
    where = f"model={settings['model']}" if settings.get("model") else f"kind={settings['kind']}"
    device = f" device={settings['device']}" if settings.get("device") else ""
    return f"{where} dtype={settings['dtype']}{device} compile={settings['compile']}"


def _compiled(backend: str) -> Callable[[Any], Callable[[], None]] | None:
    """The change ``compile=backend`` makes on a pipeline (its denoiser compiled), returning its undo."""
    if backend == "off":
        return None

    def change(pipe: Any) -> Callable[[], None]:
        import torch

        from ..diffusion.components.inventory import find_components

        name = next((c.name for c in find_components(pipe) if c.role == "denoiser"), None)
        if name is None:
            raise DiffusionDebugError(f"compile: {type(pipe).__name__} has no denoiser to compile.")
        eager = getattr(pipe, name)
        setattr(pipe, name, torch.compile(eager, backend=backend))
        return lambda: setattr(pipe, name, eager)

    return change


def compare_setups(args: argparse.Namespace) -> int:
    """The ``compare`` command: both sides checked, loaded, called and compared."""
    from ..diffusion.compare import compare_pipelines

    base = dict(model=args.model, kind=args.kind, dtype=args.dtype, device=args.device, compile="off")
    sides = [side_settings(option, pairs, base) for option, pairs in (("--a", args.a), ("--b", args.b))]
    loads = []
    for settings in sides:
        if settings["model"] is not None:
            loading.model_index(settings["model"])
        loading.check_steps(args.steps, loading.saved_scheduler_config(settings["model"], settings["kind"]))
        loading.check_device(settings["device"])
        loads.append(tuple(settings[k] for k in ("model", "kind", "dtype", "device")))
    output_dir = args.output_dir or "debug_output"
    loading.check_output_dir(output_dir)
    pipes = [loading.load_pipeline(*loads[0])]
    pipes.append(pipes[0] if loads[1] == loads[0] else loading.load_pipeline(*loads[1]))
    for pipe in pipes:
        loading.check_run_values(pipe, args.steps, args.height, args.width)
        pipe.set_progress_bar_config(disable=True)
    call: dict[str, Any] = dict(prompt=args.prompt, num_inference_steps=args.steps, guidance_scale=args.guidance_scale)
    for key in ("negative_prompt", "height", "width"):
        if getattr(args, key):
            call[key] = getattr(args, key)
    for name, settings in zip("AB", sides):
        print(f"{name}: {_describe(settings)}")
    sys.stdout.flush()
    changes = [_compiled(s["compile"]) for s in sides]
    comparison = compare_pipelines(pipes[0], pipes[1], seed=args.seed, a=changes[0], b=changes[1], **call)
    return print_comparison(comparison, _write(comparison, output_dir, "compare"))


# -- the two subcommands ------------------------------------------------------------------------------------


def add_compare_commands(
    command: Callable[[str, str], argparse.ArgumentParser],
    add_pipeline_options: Callable[[argparse.ArgumentParser], None],
) -> None:
    """``diff`` and ``compare``, made by the CLI's ``command(name, summary)``; ``compare`` takes
    ``run``'s pipeline flags (``add_pipeline_options``)."""
    diff = command("diff", "compare two saved runs: the first component, step and module where they drift apart")
    diff.add_argument("run_a", type=Path, help="the first run directory (e.g. debug_output/run-...)")
    diff.add_argument("run_b", type=Path, help="the second run directory, of the same pipeline and step count")
    diff.add_argument("--output-dir", default="debug_output", help="where the diff directory goes")
    diff.set_defaults(func=lambda args: diff_runs(args.run_a, args.run_b, args.output_dir))

    compare = command("compare", "run two setups of a pipeline on one call and seed: where do they drift apart")
    add_pipeline_options(compare)
    compare.add_argument(
        "--a",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"a setting of side A over the shared flags (repeatable): {', '.join(SIDE_KEYS)}",
    )
    compare.add_argument("--b", action="append", default=[], metavar="KEY=VALUE", help="a setting of side B, as --a")
    add_call_options(compare)
    compare.add_argument("--output-dir", help="where the comparison directory goes (default: debug_output)")
    compare.set_defaults(func=compare_setups)
