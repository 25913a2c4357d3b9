"""The precision doctor behind ``diffusion-debug doctor``: one pipeline call per dtype, compared.

:func:`run_doctor` loads the pipeline once per dtype (float32, float16, bfloat16; optionally also
compiled with ``torch.compile``), runs the same prompt with the same seed under a
:class:`~diffusion_debug.DiffusionModelDebugger`, and reports per component: finite or not, the
first non-finite module (the debugger's producer), the largest finite |activation| against the
dtype's largest value, and the time; per run: the image's PSNR against the float32 image. Then it
recommends a dtype per component (:func:`recommend`). Everything goes into one run-like
directory: ``doctor.json`` (strict JSON) and one debugger run directory per dtype.

Limits:

* Each dtype is a whole-pipeline run; a mixed configuration (UNet fp16 with VAE fp32) is
  recommended from those runs, not run itself.
* The max |x| is read by a full probe (``probes.apply_probes``, ``signal="absmax"``) on each
  ``nn.Module`` component: one abs-max per module output, kept on the device until the call
  ends. It costs time, which is why the doctor runs few steps by default; its timings are
  therefore comparable between dtypes, not with an undebugged pipeline. An output holding a
  NaN/Inf marks its component non-finite and adds nothing to its max |x|; activations such as
  SiLU, which cannot exceed their input by much, are not read (as in every full probe).
* float32 is loaded first, before the doctor directory is made: a model that cannot load in
  float32 is no precision finding, and its error propagates (the CLI: one line, exit 2). A
  float16/bfloat16 the device cannot run (an error while loading or running) is reported as
  failed with the error; ``torch.compile`` that cannot build (no C++ compiler, an unsupported
  backend) is reported as skipped with the reason.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import DebugConfig
from ..diffusion import DiffusionModelDebugger
from ..diffusion.components.compiled import compile_state
from ..diffusion.components.inventory import stable_diffusion_vae
from ..diffusion.components.vae_details import sdxl_scaling
from ..probes import ProbeConfig, apply_probes
from ..record import dumps, new_run_name, prepare_run_dir, write_atomic
from .pipeline_loading import write_invocation

__all__ = ["DOCTOR_DTYPES", "ComponentCheck", "DoctorRun", "recommend", "run_doctor", "doctor_table"]

DOCTOR_DTYPES = ("float32", "float16", "bfloat16")
# Above this share of the dtype's max, an activation is one large input away from Inf.
_RISK_FRACTION = 0.5


@dataclass
class ComponentCheck:
    """One component in one run."""

    finite: bool
    first_nonfinite: str | None  # the producer module ("" = the component itself), None when finite
    max_abs: float | None  # largest finite |value| of any module output of the component
    dtype_max: float
    time_s: float | None
    sdxl_vae: bool = False
    """SDXL's VAE (:func:`sdxl_vae`): the fp16-fixed SDXL VAE is advice for it only (not SD 1.5's, SD x4 upscale's,
    another latent space each, nor a Wan or Flux VAE)."""

    @property
    def range_fraction(self) -> float | None:
        return None if self.max_abs is None else self.max_abs / self.dtype_max

    @property
    def clean(self) -> bool:
        return self.finite and (self.range_fraction or 0.0) < _RISK_FRACTION


@dataclass
class DoctorRun:
    """One pipeline call in one dtype (``compiled``: with ``torch.compile``)."""

    dtype: str
    compiled: bool = False
    status: str = "ok"  # ok | failed | skipped
    note: str = ""
    time_s: float | None = None
    """The watched call; for a compiled run a warm one (the compiled code already built)."""
    compile_s: float | None = None
    """A compiled run: its first, unwatched call, which builds the compiled code."""
    image_finite: bool | None = None
    psnr_db: float | None = None  # against the float32 image; inf when identical
    components: dict[str, ComponentCheck] = field(default_factory=dict)
    run_dir: str | None = None

    @property
    def label(self) -> str:
        return self.dtype + ("+compile" if self.compiled else "")


class _RangeProbes:
    """A full probe on every component that is not compiled, reading the abs-max of each module
    output in every dtype (``signal="absmax"``), kept on the device until :meth:`collect`."""

    def __init__(self, components: dict[str, torch.nn.Module]):
        config = ProbeConfig("full", measure_inputs=False, signal="absmax")
        self.names = list(components)
        self.handles = {
            name: apply_probes(module, config)
            for name, module in components.items()
            if compile_state(module) is None  # no hook inside compiled code: the debugger's readings only
        }

    def remove(self) -> None:
        for handle in self.handles.values():
            handle.remove()

    def collect(self) -> dict[str, tuple[float | None, bool]]:
        """Per component: the largest abs-max of a finite module output (``None``: none read), and
        whether any output was non-finite."""
        out: dict[str, tuple[float | None, bool]] = {name: (None, False) for name in self.names}
        for name, handle in self.handles.items():
            readings = handle.state.collect()
            peaks = [r.output_absmax for r in readings if r.output_finite and r.output_absmax is not None]
            out[name] = (max(peaks) if peaks else None, any(not r.output_finite for r in readings))
        return out


def _components(pipe) -> dict[str, torch.nn.Module]:
    return {name: value for name, value in pipe.components.items() if isinstance(value, torch.nn.Module)}


def _psnr(image: Any, reference: Any) -> float | None:
    import numpy as np

    if image is None or reference is None or image.shape != reference.shape:
        return None
    a, b = np.asarray(image, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return None
    mse = float(np.mean((a - b) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def _compile(pipe, call: Callable[[Any], Any], backend: str) -> tuple[str | None, float | None]:
    """Compile the denoiser in place (``nn.Module.compile`` keeps the component's type, so the
    debugger still recognises it) and build it with one unwatched call: ``(the reason when it
    cannot, the seconds that call took)``."""
    denoiser = getattr(pipe, "unet", None) or getattr(pipe, "transformer", None)
    if denoiser is None or not hasattr(denoiser, "compile"):
        return "no denoiser with nn.Module.compile", None
    try:
        denoiser.compile(backend=backend)
        start = time.perf_counter()
        call(pipe)
        return None, time.perf_counter() - start
    except Exception as error:  # noqa: BLE001 - any failure to build means "skipped"
        return (
            f"torch.compile failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
            None,
        )


def _one_run(
    run: DoctorRun,
    load: Callable[[str], Any],
    call: Callable[[Any], Any],
    out_dir: Path,
    plant: Callable[[Any], Any] | None,
    backend: str = "inductor",
    loaded_from: tuple[str | None, str] | None = None,
) -> Any:
    """Fill ``run``; return the image array (or None)."""
    try:
        pipe = load(run.dtype)
    except Exception as error:  # noqa: BLE001 - a dtype the device cannot load is a result
        run.status, run.note = "failed", f"could not load in {run.dtype}: {type(error).__name__}: {error}"
        return None
    if run.compiled:
        reason, run.compile_s = _compile(pipe, call, backend)
        if reason:
            run.status, run.note = "skipped", reason
            return None
    components = _components(pipe)
    config = DebugConfig(output_dir=str(out_dir), run_name=run.label, log_level="error")
    debugger = DiffusionModelDebugger(pipe, config)
    if loaded_from is not None:  # the run's report then names the model in its replay command
        write_invocation(debugger.record.run_dir, "doctor", *loaded_from, run.dtype)
    fault = plant(pipe) if plant else None
    ranges = _RangeProbes(components)
    image = None
    quiet = logging.getLogger("diffusion_debug")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # the doctor's table says it all, once
    try:
        with debugger:
            start = time.perf_counter()
            output = call(pipe)
            run.time_s = time.perf_counter() - start
        image = getattr(output, "images", None)
    except Exception as error:  # noqa: BLE001 - e.g. an op without a kernel for this dtype
        kind = "skipped" if run.compiled else "failed"
        run.status, run.note = kind, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    finally:
        quiet.setLevel(level)
        ranges.remove()
        if fault is not None:
            fault.remove()
    report = debugger.report()
    run.run_dir = str(report.save())
    debugger.close()
    producers: dict[str, str] = {}
    for anomaly in report.anomalies:
        if anomaly.kind == "nonfinite" and anomaly.component and anomaly.component not in producers:
            producers[anomaly.component] = anomaly.module
    dtype_max = float(torch.finfo(getattr(torch, run.dtype)).max)
    for name, (peak, nonfinite) in ranges.collect().items():
        info = report.components.get(name) or {}
        finite = not nonfinite and name not in producers
        run.components[name] = ComponentCheck(
            finite=finite,
            first_nonfinite=None if finite else producers.get(name, ""),
            max_abs=peak,
            dtype_max=dtype_max,
            time_s=info.get("total_time_s"),
            sdxl_vae=sdxl_vae(components.get(name)),
        )
    if image is not None:
        import numpy as np

        image = np.asarray(image)
        run.image_finite = bool(np.isfinite(image).all())
    return image


def run_doctor(
    load: Callable[[str], Any],
    output_dir: str | Path = "debug_output",
    *,
    dtypes: tuple[str, ...] = DOCTOR_DTYPES,
    compile: bool = False,
    backend: str = "inductor",
    progress: Callable[[str], None] | None = None,
    prompt: str = "a photo of an astronaut riding a horse",
    steps: int = 4,
    seed: int = 0,
    plant: Callable[[Any], Any] | None = None,
    loaded_from: tuple[str | None, str] | None = None,
) -> dict[str, Any]:
    """Run the pipeline once per dtype and compare. ``load(dtype_name)`` returns a fresh
    pipeline in that dtype (the CLI passes its ``load_pipeline``); ``plant(pipe)`` may plant a
    fault and return its handle (tests, demos); ``compile``: each dtype once more with the
    denoiser compiled (``backend``), timed on a warm call with the compile time apart;
    ``progress(line)`` hears of each run as it starts; ``loaded_from`` (``--model``, ``--kind``:
    what ``load`` loads) goes into each run directory's ``invocation.json``. Returns the result
    that ``doctor.json`` holds: ``runs`` (one per dtype, per component checks),
    ``recommendation`` and ``run_dir``.

    ``load("float32")`` runs before the doctor directory is made, and what it raises propagates:
    a model that does not load in float32 is no dtype's finding."""
    unknown = [d for d in dtypes if d not in DOCTOR_DTYPES]
    if unknown:
        raise ValueError(f"Unknown dtype {unknown[0]!r}; choose from {', '.join(DOCTOR_DTYPES)}.")
    loaded = {"float32": load("float32")}

    def load_once(dtype: str) -> Any:
        """The float32 pipeline loaded above for its first run, a fresh load for every other."""
        pipe = loaded.pop(dtype, None)
        return load(dtype) if pipe is None else pipe

    run_dir = prepare_run_dir(output_dir, new_run_name("doctor"), exclusive=True)
    order = ["float32"] + [d for d in dtypes if d != "float32"]  # float32 first: the reference image

    def call(pipe):
        generator = torch.Generator("cpu").manual_seed(seed)
        return pipe(prompt, num_inference_steps=steps, generator=generator, output_type="np")

    runs: list[DoctorRun] = []
    reference = None
    for dtype in order:
        for compiled in (False, True) if compile else (False,):
            run = DoctorRun(dtype, compiled)
            if progress is not None:
                progress(f"doctor: {run.label}" + (" (compiling, then one watched call)" if compiled else ""))
            image = _one_run(run, load_once, call, run_dir, plant, backend, loaded_from)
            if dtype == "float32" and not compiled:
                reference = image
            run.psnr_db = _psnr(image, reference)
            runs.append(run)
    result = {
        "run_dir": str(run_dir),
        "prompt": prompt,
        "steps": steps,
        "seed": seed,
        "runs": [_run_dict(run) for run in runs],
        "recommendation": recommend(runs),
    }
    write_atomic(run_dir / "doctor.json", dumps(result, indent=1))
    return result


def _run_dict(run: DoctorRun) -> dict[str, Any]:
    data = asdict(run)
    for name, check in run.components.items():
        data["components"][name]["range_fraction"] = check.range_fraction
    data["label"] = run.label
    return data


def sdxl_vae(module: Any) -> bool:
    """Whether ``module`` is SDXL's ``AutoencoderKL`` (its scaling factor ``vae_details.SDXL_SCALING``), the VAE of
    the fp16-fixed one."""
    config = getattr(module, "config", None)
    return stable_diffusion_vae(module) and sdxl_scaling(getattr(config, "scaling_factor", None))


def recommend(runs: list[DoctorRun]) -> str:
    """One sentence: the cheapest dtype each component ran clean in (finite, below half the
    dtype's max), and why the others were not chosen.

    >>> ok = ComponentCheck(True, None, 10.0, 65504.0, 0.1)
    >>> bad = ComponentCheck(False, "decoder.up_blocks.0", None, 65504.0, 0.1, sdxl_vae=True)
    >>> fp32 = ComponentCheck(True, None, 1e5, 3.4e38, 0.1)
    >>> runs = [DoctorRun("float32", components={"unet": fp32, "vae": fp32}),
    ...         DoctorRun("float16", components={"unet": ok, "vae": bad})]
    >>> print(recommend(runs))
    unet float16, vae float32 (float16: non-finite at decoder.up_blocks.0; or the fp16-fix VAE)
    """
    plain = [run for run in runs if not run.compiled and run.status == "ok"]
    reference = next((run for run in plain if run.dtype == "float32"), None)
    if reference is not None:
        broken = [name for name, check in reference.components.items() if not check.finite]
        if broken:
            return (
                f"float32 is not finite either ({', '.join(broken)}): the fault is not precision; "
                "check the weights and inputs with `diffusion-debug run`"
            )
    names = list(dict.fromkeys(name for run in plain for name in run.components))
    if not names:
        return "no run finished; see the notes"
    parts = []
    for name in names:
        why = []
        choice = "float32"
        for dtype in ("float16", "bfloat16"):
            run = next((run for run in plain if run.dtype == dtype), None)
            check = run.components.get(name) if run else None
            if check is None:
                continue
            if check.clean:
                choice = dtype
                break
            if not check.finite:
                why.append(f"{dtype}: non-finite at {check.first_nonfinite or name}")
            else:
                why.append(f"{dtype}: |x| reaches {check.range_fraction:.0%} of its max")
        sdxl = any(check.sdxl_vae for run in plain for check in [run.components.get(name)] if check)
        if sdxl and any(text.startswith("float16") for text in why):
            why.append("or the fp16-fix VAE")
        parts.append(f"{name} {choice}" + (f" ({'; '.join(why)})" if why else ""))
    return ", ".join(parts)


def doctor_table(result: dict[str, Any]) -> str:
    """The terminal table of a :func:`run_doctor` result (also readable from ``doctor.json``)."""
    from ..report.terminal import table

    rows = []
    for run in result["runs"]:
        psnr = run.get("psnr_db")
        psnr_text = "" if psnr is None else ("identical" if psnr == math.inf or psnr == "inf" else f"{psnr:.1f} dB")
        seconds = _seconds(run.get("time_s"))
        if run.get("compile_s") is not None:
            seconds += f" (compile {run['compile_s']:.1f} s)"
        head = [run["label"], "(pipeline)", _yes(run.get("image_finite")), "", "", "", seconds]
        if run["status"] != "ok":
            rows.append([*head[:2], run["status"], run["note"], "", "", "", ""])
            continue
        rows.append([*head, psnr_text])
        for name, check in run["components"].items():
            fraction = check.get("range_fraction")
            rows.append(
                [
                    "",
                    name,
                    _yes(check["finite"]),
                    "" if check["finite"] else (check["first_nonfinite"] or "(not localized)"),
                    "" if check["max_abs"] is None else f"{check['max_abs']:.3g}",
                    # a component that went NaN/Inf passed its dtype's range: the share of its largest
                    # *finite* value (0.11% for an fp16 VAE that overflowed) would read as safe
                    "NaN/Inf" if not check["finite"] else ("" if fraction is None else f"{fraction:.2%}"),
                    _seconds(check.get("time_s")),
                    "",
                ]
            )
    headers = ["run", "component", "finite", "first non-finite", "max |x|", "of dtype max", "time", "PSNR vs fp32"]
    return table(headers, rows, wrap={3: 40})


def _yes(value: Any) -> str:
    return "" if value is None else ("yes" if value else "NO")


def _seconds(value: Any) -> str:
    return "" if value is None else f"{value:.3f} s"
