"""The job behind ``diffusion-debug why RUN_DIR``: the run's origin call replayed with one factor
changed at a time, on the pipeline the run used.

The run directory is read (its origin's repro bundle, and ``invocation.json`` for the pipeline
``run`` or the demo loaded) before anything loads; ``--model`` names another pipeline directory.
The table and the verdict are printed and written to ``why.json`` / ``why.md`` in the run
directory, and ``report.html`` is rebuilt to link to them (:func:`~diffusion_debug.diffusion.replay.why.explain_run`).

Hostile run directories: the bundle must lie inside the run directory (no absolute path, ``..``
or symlink out of it), ``invocation.json``'s ``model`` and ``kind`` and the bundle's ``call_prefix``
are checked, and an as-is replay slower than 10 times the run's own call stops the rest: each is one
line, exit 2.

Limits: bundles hold no weights, and a loaded pipeline has none of the live one's adapters,
attention processors, caches or compilation: those factors apply only to
:meth:`DebugReport.why` on the live pipeline. diffusers' layerwise casting is the exception: the
bundle names its dtypes, it is applied to the loaded weights again, and "layerwise casting off"
replays the weights as loaded (the live pipeline keeps only their fp8 copy).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import DiffusionDebugError
from . import pipeline_loading as loading  # looked up at call time: tests plant a loader there


def why_run(run_dir: Path, model: str | None = None, kind: str | None = None, device: str | None = None) -> int:
    """Print the table and the verdict of the run's origin; exit code 0
    (1 when it did not reproduce or the replay as it was failed)."""
    from ..diffusion.replay.bundle import read_bundle
    from ..diffusion.replay.why import bundle_in_run, explain_run, origin_bundle
    from ..record import load_json, load_run

    run = load_run(run_dir)
    origin = origin_bundle(run.anomalies)
    if origin is None:
        raise DiffusionDebugError(_no_bundle(run_dir, run.summary, run.anomalies))
    # a damaged bundle, or one outside the run directory, is one line before the pipeline loads
    meta, _ = read_bundle(bundle_in_run(run_dir, origin[1]))
    invocation = run_dir / "invocation.json"
    used = load_json(invocation) if invocation.is_file() else {}
    used = used if isinstance(used, dict) else {}
    if model is None and kind is None:
        model, kind = used.get("model"), used.get("kind")
        _check_invocation(model, kind)
    if model is None and kind is None:
        raise DiffusionDebugError(
            "the run does not say which pipeline it used (no invocation.json): "
            "pass --model DIR (bundles hold no weights)."
        )
    dtype = meta.get("parameter_dtype") or used.get("dtype") or "float32"
    pipe = loading.load_pipeline(model, kind or "sd", dtype, device)
    unhooked = _layerwise_casting_again(getattr(pipe, meta["component"], None), meta.get("layerwise_casting"))
    reference_s = _call_time(run.summary, origin[0])
    result = explain_run(run_dir, run.anomalies, pipe, unhooked, reference_s)
    print(result.markdown())
    return 0 if result.baseline.finite is False else 1


def _no_bundle(run_dir: Path, summary: dict[str, Any], anomalies: list[Any]) -> str:
    """Why there is nothing to replay, in the run's own terms: a training run (why replays a
    pipeline call), a NaN/Inf whose run saved no bundle (``repro_bundle`` off, or an origin that is
    no component's call: an input, a callback), or no NaN/Inf."""
    first = next((a for a in anomalies if a.severity == "error" and a.kind.startswith("nonfinite")), None)
    if summary.get("kind") == "training":
        found = f" (its first NaN/Inf: {first.kind} at {first.where()})" if first else ""
        return (
            f"{str(run_dir)!r} is a training run{found}: why replays a pipeline call; "
            f"`diffusion-debug report {run_dir}` shows the training run's causes."
        )
    if first is None:
        return f"{str(run_dir)!r} has no repro bundle: the run had no NaN/Inf error to replay."
    config = summary.get("config")
    if isinstance(config, dict) and config.get("repro_bundle") is False:
        why = "repro_bundle was off (as at level basic); run it again with repro_bundle on (level advanced)"
    else:
        why = "no component call made it (a value passed in, a callback, the scheduler): there is no call to replay"
    return f"{str(run_dir)!r} has no repro bundle of its NaN/Inf at {first.where()}: {why}."


TINY_KINDS = ("sd", "sdxl", "sd3")  # what `run --kind` writes into invocation.json


def _check_invocation(model: Any, kind: Any) -> None:
    """invocation.json is a file like any other: its fields are checked before they load anything."""
    if model is not None and not isinstance(model, str):
        raise DiffusionDebugError(f"invocation.json field 'model' is {str(model)[:60]!r}, not a folder path.")
    if model is None and kind is not None and kind not in TINY_KINDS:
        raise DiffusionDebugError(
            f"invocation.json field 'kind' is {str(kind)[:60]!r}, not one of {', '.join(TINY_KINDS)}."
        )


def _call_time(summary: Any, component: str) -> float | None:
    """The run's own mean time of one call of ``component`` (None when it recorded none)."""
    import math

    found = summary.get("components", {}) if isinstance(summary, dict) else {}
    entry = found.get(component) if isinstance(found, dict) else None
    value = entry.get("mean_time_s") if isinstance(entry, dict) else None
    is_time = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    return float(value) if is_time else None


STORAGE_DTYPES = ("float8_e4m3fn", "float8_e5m2")


def _layerwise_casting_again(component: Any, casting: Any) -> dict[str, Any]:
    """Apply the layerwise casting the run had (the bundle says which) to the loaded component;
    returns the component as loaded, for the "layerwise casting off" replay."""
    import copy

    import torch

    if not isinstance(casting, dict) or not isinstance(component, torch.nn.Module):
        return {}
    storage, compute = casting.get("storage_dtype"), casting.get("compute_dtype")
    if storage not in STORAGE_DTYPES or compute not in loading.DTYPES:  # never getattr(torch, <from a file>)
        raise DiffusionDebugError(
            f"the bundle's layerwise_casting is {str(casting)[:80]}, not a pair of dtypes of ours."
        )
    loaded = copy.deepcopy(component)
    from diffusers.hooks import apply_layerwise_casting

    apply = getattr(component, "enable_layerwise_casting", None)
    if callable(apply):  # the model's own skip patterns, as the run's enable_layerwise_casting had
        apply(storage_dtype=getattr(torch, storage), compute_dtype=getattr(torch, compute))
    else:
        apply_layerwise_casting(component, getattr(torch, storage), getattr(torch, compute))
    return {"layerwise casting": loaded}


def add_why_command(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """The ``why`` subcommand of the CLI, made by the CLI's ``command(name, summary)``."""
    why = command("why", "replay a run's first NaN/Inf with one factor changed at a time")
    why.add_argument("run_dir", type=Path, help="a run directory with a repro bundle (e.g. debug_output/run-...)")
    why.add_argument("--model", help="the pipeline directory (default: the one in the run's invocation.json)")
    why.add_argument("--kind", choices=("sd", "sdxl", "sd3"), help="built-in tiny pipeline, without --model")
    why.add_argument("--device", help="e.g. cpu, cuda, cuda:1 (default: cuda if available)")
    why.set_defaults(func=lambda args: why_run(args.run_dir, args.model, args.kind, args.device))
