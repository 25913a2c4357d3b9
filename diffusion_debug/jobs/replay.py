"""The job behind ``diffusion-debug replay``: a saved repro bundle re-run on its component, full probes on.

The bundle is read (and a damaged one refused in one line) before the pipeline loads; the replay
names the first module whose output is non-finite.

Limits: bundles hold no weights: the fault reproduces only with the ``--model`` it came from (the
tiny built-in pipeline has random weights).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import DiffusionDebugError
from . import pipeline_loading as loading  # looked up at call time: tests plant a loader there
from .progress import progress_bar


def replay_bundle(
    bundle: Path, model: str | None = None, kind: str = "sd", device: str | None = None, *, progress: bool = False
) -> int:
    """Print where the replay turned non-finite; exit code 1 when it stayed finite. ``progress``:
    a bar on stderr over its two stages (loading the pipeline, the replay)."""
    from ..diffusion.replay.bundle import read_bundle, replay

    meta, _ = read_bundle(bundle)  # a damaged bundle is one line, before the pipeline loads
    bar = progress_bar(2, "replay", "stage", progress)
    try:
        bar.set_postfix_str("loading the pipeline")
        pipe = loading.load_pipeline(model, kind, meta.get("parameter_dtype") or "float32", device)
        component = meta["component"]
        module = getattr(pipe, component, None) if component.isidentifier() else None
        if not isinstance(module, torch_module()):
            raise DiffusionDebugError(f"The pipeline has no component {component[:80]!r} to replay the bundle on.")
        bar.update(1)
        bar.set_postfix_str(f"replaying {component} with full probes")
        result = replay(bundle, module)
        bar.update(1)
    finally:
        bar.close()
    # None: a call outside the denoising loop (a VAE's, a text encoder's); a timestep None: a denoiser
    # called with no scheduler step (a loop of its own)
    step, timestep = meta.get("step"), meta.get("timestep")
    shown = [f"step {step}"] if step is not None else []
    shown += [f"timestep {timestep}"] if timestep is not None else []
    where = f" ({', '.join(shown)})" if shown else ""
    if result.get("overflowed_in"):  # made from the module's near-max values: that module first
        print(
            f"values near the dtype's max made by: {component} {result['module']}, on which {component} "
            f"{result['overflowed_in']} made NaN/Inf{where}"
        )
        return 0
    if result["module"] is not None:
        print(f"first non-finite value: {component} {result['module'] or '(its own forward)'}{where}")
        return 0
    if result["first_nonfinite"] is not None:
        print(
            f"the saved inputs are already non-finite; first module passing it on: {component} "
            f"{result['first_nonfinite']}{where}"
        )
        return 0
    print("the replay stayed finite: the fault does not reproduce with these weights (pass the --model it came from)")
    return 1


def torch_module() -> type:
    """``torch.nn.Module``, imported only when a replay runs."""
    from torch import nn

    return nn.Module
