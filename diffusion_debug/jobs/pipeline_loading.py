"""Loading the pipeline a command works on, and the checks of a command's values before anything loads.

Each bad value is one clear :class:`~diffusion_debug.errors.DiffusionDebugError` (the CLI prints it on
one line, exit 2), raised before the pipeline loads or a run directory is made where it can be.
Messages of other libraries are flattened to one line (:func:`one_line`).

Limits: ``load_pipeline`` loads local directories only (``local_files_only``); a model id of the Hub
is not downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import DiffusionDebugError

DTYPES = ("float32", "float16", "bfloat16")

MAX_SIDE = 8192
"""The largest --height / --width accepted (pixels): beyond it a run only fails slowly."""


def one_line(text: str, limit: int = 300) -> str:
    """``text`` on one line, cut to ``limit`` characters (messages of other libraries)."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def disk_reason(error: OSError) -> str:
    """Why a write failed, on one line (``No space left on device``)."""
    return one_line(error.strerror or str(error) or type(error).__name__)


def torch_dtype(name: str):
    import torch

    if name not in DTYPES:  # never getattr(torch, <anything>) from a file
        raise DiffusionDebugError(f"dtype {name!r} is not one of {', '.join(DTYPES)}.")
    return getattr(torch, name)


def check_device(name: str | None) -> str:
    """The device to run on; an unknown or unavailable one is one clear error, before loading."""
    import torch

    if not name:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise DiffusionDebugError(f"--device {name!r} is not a device (e.g. cpu, cuda, cuda:1).") from None
    if device.type == "cpu" or device.type == "meta":
        if device.type == "meta":
            raise DiffusionDebugError("--device 'meta' holds no data; use cpu or cuda.")
        return name
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        raise DiffusionDebugError(f"--device {name!r}: {device.type} is not available on this machine.")
    count = getattr(backend, "device_count", None)
    if device.index is not None and count is not None and device.index >= count():
        raise DiffusionDebugError(f"--device {name!r}: this machine has {count()} {device.type} device(s).")
    return name


def check_output_dir(path: str | Path, option: str = "--output-dir") -> None:
    """An output directory that cannot be written is one clear error before anything loads
    (``option``: the setting the message names)."""
    import tempfile

    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise DiffusionDebugError(f"{option} {str(path)!r} cannot be written: {reason}.") from None


def model_index(model: str) -> dict[str, Any]:
    """``model_index.json`` of a pipeline directory, checked to be a JSON object."""
    from ..record import load_json

    index = Path(model) / "model_index.json"
    if not index.is_file():
        raise DiffusionDebugError(f"--model {model!r} is not a diffusers pipeline directory (no model_index.json).")
    try:
        listed = load_json(index)
    except (OSError, ValueError, RecursionError) as error:
        reason = one_line(f"{type(error).__name__}: {error}")
        raise DiffusionDebugError(f"--model {model!r}: model_index.json is not valid JSON ({reason}).") from None
    if not isinstance(listed, dict) or not isinstance(listed.get("_class_name", ""), str):
        raise DiffusionDebugError(
            f"--model {model!r}: model_index.json is not a pipeline index (a JSON object with a _class_name)."
        )
    return listed


def dtype_keyword() -> str:
    """``from_pretrained``'s dtype argument: ``dtype`` since diffusers 0.40, ``torch_dtype`` (now
    deprecated) before."""
    import diffusers
    from packaging.version import Version

    return "dtype" if Version(diffusers.__version__).release >= (0, 40) else "torch_dtype"


def load_pipeline(model: str | None, kind: str = "sd", dtype: str = "float32", device: str | None = None):
    """A local diffusers pipeline directory (``from_pretrained``), or the tiny built-in one."""
    dtype_ = torch_dtype(dtype)
    where = check_device(device)  # an unavailable device fails before loading
    if model is None:
        from ..testing import tiny_pipeline

        pipe = tiny_pipeline(kind, dtype=dtype_)
    else:
        listed = model_index(model)
        from diffusers import DiffusionPipeline

        extra: dict[str, Any] = {}
        for optional in ("text_encoder_3", "tokenizer_3"):  # SD3 saved without T5
            if optional not in listed and "StableDiffusion3" in listed.get("_class_name", ""):
                extra[optional] = None
        try:
            extra[dtype_keyword()] = dtype_
            pipe = DiffusionPipeline.from_pretrained(model, local_files_only=True, **extra)
        except Exception as error:  # a damaged directory: the library's reason, on one line
            reason = one_line(f"{type(error).__name__}: {error}")
            raise DiffusionDebugError(f"--model {model!r} could not be loaded: {reason}") from None
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(where)


def write_invocation(run_dir: str | Path, command: str, model: str | None, kind: str, dtype: str) -> None:
    """``invocation.json``: what :func:`load_pipeline` loaded for a run (a resolved ``--model``
    directory, or the tiny ``kind``), so the report's replay command names it (bundles hold no
    weights). Written as soon as the run directory exists, so every saved run has it."""
    from ..record import dumps, write_atomic

    model = str(Path(model).resolve()) if model else None
    used = {"command": command, "model": model, "kind": None if model else kind, "dtype": dtype}
    write_atomic(Path(run_dir) / "invocation.json", dumps(used, indent=1))


def size_factor(pipe: Any) -> int:
    """What height and width must be multiples of: the VAE's downscale factor (times the
    transformer's patch size, for a patched transformer such as SD3's)."""
    factor = int(getattr(pipe, "vae_scale_factor", None) or 8)
    config = getattr(getattr(pipe, "transformer", None), "config", None)
    patch = getattr(config, "patch_size", None) if config is not None else None
    return factor * int(patch) if isinstance(patch, int) and patch > 1 else factor


def check_steps(steps: int, scheduler_config: Any) -> None:
    """--steps against the scheduler's training timesteps (a diffusers scheduler refuses more, late)."""
    train_steps = scheduler_config.get("num_train_timesteps") if hasattr(scheduler_config, "get") else None
    if isinstance(train_steps, int) and steps > train_steps:
        raise DiffusionDebugError(
            f"--steps {steps} is more than the scheduler's {train_steps} training timesteps (at most {train_steps})."
        )


def saved_scheduler_config(model: str | None, kind: str = "sd") -> Any:
    """The scheduler's config before the pipeline loads: the tiny pipeline's, or a model directory's
    ``scheduler/scheduler_config.json`` (empty when unreadable; loading then says what is wrong)."""
    if model is None:
        from ..testing import tiny_pipeline

        return tiny_pipeline(kind).scheduler.config
    from ..record import load_json

    try:
        config = load_json(Path(model) / "scheduler" / "scheduler_config.json")
    except (OSError, ValueError, RecursionError):
        return {}
    return config if isinstance(config, dict) else {}


def check_run_values(pipe: Any, steps: int, height: int | None, width: int | None) -> None:
    """Values the pipeline would reject (or choke on) late, checked before the run starts."""
    check_steps(steps, getattr(getattr(pipe, "scheduler", None), "config", None) or {})
    factor = size_factor(pipe)
    for flag, value in (("--height", height), ("--width", width)):
        if value is None:
            continue
        if value % factor:
            raise DiffusionDebugError(
                f"{flag} {value} is not a multiple of {factor} (this pipeline's VAE factor); "
                f"e.g. {max(factor, value - value % factor)}."
            )
        if value > MAX_SIDE:
            raise DiffusionDebugError(f"{flag} {value} is larger than {MAX_SIDE} pixels.")
