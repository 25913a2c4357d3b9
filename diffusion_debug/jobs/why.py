"""The job behind ``diffusion-debug why RUN_DIR``: the run's origin call replayed with one factor
changed at a time, on the pipeline the run used.

The run directory is read (its origin's repro bundle, and ``invocation.json`` for the pipeline
``run`` or the demo loaded) before anything loads; ``--model`` names another pipeline directory.
The table and the verdict are printed and written to ``why.json`` / ``why.md`` in the run
directory, and ``report.html`` is rebuilt to link to them.

Limits: bundles hold no weights, and a loaded pipeline has none of the live one's hooks, adapters
or compilation: those factors apply only to :meth:`DebugReport.why` on the live pipeline.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import DiffusionDebugError
from . import pipeline_loading as loading  # looked up at call time: tests plant a loader there


def why_run(run_dir: Path, model: str | None = None, kind: str | None = None, device: str | None = None) -> int:
    """Print the table and the verdict of the run's origin; exit code 0 (1 when it did not reproduce)."""
    from ..diffusion.bundle import read_bundle
    from ..diffusion.why import explain_run, origin_bundle
    from ..record import load_json, load_run
    from ..report import write_html

    run = load_run(run_dir)
    origin = origin_bundle(run.anomalies)
    if origin is None:
        raise DiffusionDebugError(f"{str(run_dir)!r} has no repro bundle: the run had no NaN/Inf error to replay.")
    meta, _ = read_bundle(run_dir / origin[1])  # a damaged bundle is one line, before the pipeline loads
    invocation = run_dir / "invocation.json"
    used = load_json(invocation) if invocation.is_file() else {}
    used = used if isinstance(used, dict) else {}
    if model is None and kind is None:
        model, kind = used.get("model"), used.get("kind")
    if model is None and kind is None:
        raise DiffusionDebugError(
            "the run does not say which pipeline it used (no invocation.json): "
            "pass --model DIR (bundles hold no weights)."
        )
    dtype = meta.get("parameter_dtype") or used.get("dtype") or "float32"
    pipe = loading.load_pipeline(model, kind or "sd", dtype, device)
    result = explain_run(run_dir, run.anomalies, pipe)
    print(result.markdown())
    write_html(run_dir)
    return 1 if result.baseline.finite else 0


def add_why_command(commands: argparse._SubParsersAction) -> None:
    """The ``why`` subcommand of the CLI."""
    why = commands.add_parser("why", help="replay a run's first NaN/Inf with one factor changed at a time")
    why.add_argument("run_dir", type=Path)
    why.add_argument("--model", help="the pipeline directory (default: the one in the run's invocation.json)")
    why.add_argument("--kind", choices=("sd", "sdxl", "sd3"), help="built-in tiny pipeline, without --model")
    why.add_argument("--device")
    why.set_defaults(func=lambda args: why_run(args.run_dir, args.model, args.kind, args.device))
