"""diffusion-debug: debug diffusers pipelines and their fine-tuning runs.

Commands: demo, run, train, doctor, report, inspect, replay, serve (``diffusion-debug COMMAND --help``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from .config import LEVELS, POLICIES, DebugConfig, read_config_file
from .errors import DiffusionDebugError

DTYPES = ("float32", "float16", "bfloat16")


# -- shared helpers --------------------------------------------------------------------------


def _config(args: argparse.Namespace) -> DebugConfig:
    """--config's keys, with --level / --policy / --output-dir on top."""
    data = read_config_file(args.config) if args.config else {}
    for key in ("level", "policy", "output_dir"):
        if getattr(args, key):
            data[key] = getattr(args, key)
    return DebugConfig.from_dict(data)


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="a YAML or JSON DebugConfig file (e.g. configs/advanced.yaml)")
    parser.add_argument("--level", choices=LEVELS, help="basic | advanced | extreme (default: the config's)")
    parser.add_argument("--policy", choices=POLICIES, help="what an error-severity anomaly does (default: record)")
    parser.add_argument("--output-dir", help="where run directories go (default: debug_output)")


def _torch_dtype(name: str):
    import torch

    if name not in DTYPES:  # never getattr(torch, <anything>) from a file
        raise DiffusionDebugError(f"dtype {name!r} is not one of {', '.join(DTYPES)}.")
    return getattr(torch, name)


def _device(name: str | None) -> str:
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


def _check_output_dir(path: str | Path) -> None:
    """An output directory that cannot be written is one clear error before anything loads."""
    import tempfile

    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise DiffusionDebugError(f"--output-dir {str(path)!r} cannot be written: {reason}.") from None


def _model_index(model: str) -> dict[str, Any]:
    """``model_index.json`` of a pipeline directory, checked to be a JSON object."""
    from .record import load_json

    index = Path(model) / "model_index.json"
    if not index.is_file():
        raise DiffusionDebugError(f"--model {model!r} is not a diffusers pipeline directory (no model_index.json).")
    try:
        listed = load_json(index)
    except (OSError, ValueError, RecursionError) as error:
        reason = _one_line(f"{type(error).__name__}: {error}")
        raise DiffusionDebugError(f"--model {model!r}: model_index.json is not valid JSON ({reason}).") from None
    if not isinstance(listed, dict) or not isinstance(listed.get("_class_name", ""), str):
        raise DiffusionDebugError(
            f"--model {model!r}: model_index.json is not a pipeline index (a JSON object with a _class_name)."
        )
    return listed


def _one_line(text: str, limit: int = 300) -> str:
    """``text`` on one line, cut to ``limit`` characters (messages of other libraries)."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def load_pipeline(model: str | None, kind: str = "sd", dtype: str = "float32", device: str | None = None):
    """A local diffusers pipeline directory (``from_pretrained``), or the tiny built-in one."""
    torch_dtype = _torch_dtype(dtype)
    where = _device(device)  # an unavailable device fails before loading
    if model is None:
        from .testing import tiny_pipeline

        pipe = tiny_pipeline(kind, dtype=torch_dtype)
    else:
        listed = _model_index(model)
        from diffusers import DiffusionPipeline

        extra: dict[str, Any] = {}
        for optional in ("text_encoder_3", "tokenizer_3"):  # SD3 saved without T5
            if optional not in listed and "StableDiffusion3" in listed.get("_class_name", ""):
                extra[optional] = None
        try:
            pipe = DiffusionPipeline.from_pretrained(model, torch_dtype=torch_dtype, local_files_only=True, **extra)
        except Exception as error:  # a damaged directory: the library's reason, on one line
            reason = _one_line(f"{type(error).__name__}: {error}")
            raise DiffusionDebugError(f"--model {model!r} could not be loaded: {reason}") from None
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(where)


def size_factor(pipe: Any) -> int:
    """What height and width must be multiples of: the VAE's downscale factor (times the
    transformer's patch size, for a patched transformer such as SD3's)."""
    factor = int(getattr(pipe, "vae_scale_factor", None) or 8)
    config = getattr(getattr(pipe, "transformer", None), "config", None)
    patch = getattr(config, "patch_size", None) if config is not None else None
    return factor * int(patch) if isinstance(patch, int) and patch > 1 else factor


MAX_SIDE = 8192
"""The largest --height / --width accepted (pixels): beyond it a run only fails slowly."""


def check_run_values(pipe: Any, steps: int, height: int | None, width: int | None) -> None:
    """Values the pipeline would reject (or choke on) late, checked before the run starts."""
    config = getattr(getattr(pipe, "scheduler", None), "config", None) or {}
    train_steps = config.get("num_train_timesteps") if hasattr(config, "get") else None
    if isinstance(train_steps, int) and steps > train_steps:
        raise DiffusionDebugError(
            f"--steps {steps} is more than the scheduler's {train_steps} training timesteps (at most {train_steps})."
        )
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


# -- demo --------------------------------------------------------------------------------------


def _demo(args: argparse.Namespace) -> int:
    from .jobs.demo import run_demo

    _check_output_dir(args.output_dir or "debug_output")
    run_demo(args.output_dir or "debug_output", steps=args.steps, level=args.level)
    return 0


# -- run ---------------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
    """Every value is checked before the pipeline runs; once it ran, the image is written first
    (then the report), and a pipeline that raises still leaves a run directory for ``report``."""
    import logging

    import torch

    from .diffusion import DiffusionModelDebugger

    config = _config(args)  # bad config fails before the pipeline loads
    _check_output_dir(config.output_dir)
    pipe = load_pipeline(args.model, args.kind, args.dtype, args.device)
    check_run_values(pipe, args.steps, args.height, args.width)
    debugger = DiffusionModelDebugger(pipe, config)
    kwargs: dict[str, Any] = dict(
        num_inference_steps=args.steps,
        guidance_scale=args.guidance_scale,
        generator=torch.Generator("cpu").manual_seed(args.seed),
    )
    if args.negative_prompt:
        kwargs["negative_prompt"] = args.negative_prompt
    if args.height:
        kwargs["height"] = args.height
    if args.width:
        kwargs["width"] = args.width

    # the table printed after the run lists every anomaly; log lines during it would repeat them
    ours = logging.getLogger("diffusion_debug")
    level = ours.level
    ours.setLevel(logging.CRITICAL)
    try:
        with debugger:
            images = pipe(args.prompt, **kwargs).images
    except DiffusionDebugError as error:
        if error.anomaly is None:
            raise
        print(_one_line(f"diffusion-debug: stopped by policy '{config.policy}': {error}"), file=sys.stderr)
        if error.run_dir:
            _print_run(error.run_dir)
        return 1
    except (Exception, KeyboardInterrupt) as error:  # the pipeline failed: keep what was seen
        run_dir = _save_quietly(debugger)
        what = "interrupted" if isinstance(error, KeyboardInterrupt) else _one_line(f"{type(error).__name__}: {error}")
        kept = (
            f"the run so far is in {run_dir} (diffusion-debug report DIR)" if run_dir else "no report could be saved"
        )
        print(f"diffusion-debug run: the pipeline failed: {what}; {kept}.", file=sys.stderr)
        return 130 if isinstance(error, KeyboardInterrupt) else 1
    finally:
        ours.setLevel(level)
        debugger.close()
    run_dir = debugger.record.run_dir
    image = run_dir / "image.png"
    try:  # the image first: a full disk must not cost the user the picture for the report
        if images is not None and len(images) and hasattr(images[0], "save"):
            images[0].save(image)
        else:
            image = None
    except OSError as error:
        print(f"diffusion-debug run: error: image.png could not be written: {_disk_reason(error)}.", file=sys.stderr)
        _save_quietly(debugger)
        return 1
    try:
        debugger.report().save(html=False)
        _save_invocation(run_dir, args)
        _write_html(run_dir)  # with the image and the replay command's --model
    except OSError as error:
        kept = f"; the image is kept: {image}" if image is not None else ""
        print(
            f"diffusion-debug run: error: the report could not be saved: {_disk_reason(error)}{kept}.",
            file=sys.stderr,
        )
        return 1
    _print_run(run_dir)
    print(f"\nreport: {run_dir / 'report.html'}")
    return 0


def _disk_reason(error: OSError) -> str:
    return _one_line(error.strerror or str(error) or type(error).__name__)


def _write_html(run_dir: Path) -> None:
    from .report import write_html

    write_html(run_dir)


def _print_run(run_dir: str | Path) -> None:
    from .record import load_run
    from .report.terminal import render_terminal

    print(render_terminal(load_run(run_dir)))


def _save_quietly(debugger: Any) -> Path | None:
    """Save what the debugger saw (the run directory ``report`` reads); None if even that failed
    (``events.jsonl`` then still holds every line streamed, for ``report`` to rebuild from)."""
    try:
        return debugger.report().save()
    except Exception:
        events = debugger.record.events_path
        return events.parent if events.is_file() else None


def _save_invocation(run_dir: Path, args: argparse.Namespace) -> None:
    """What ``run`` loaded, for the report's replay command (bundles hold no weights)."""
    from .record import dumps, write_atomic

    model = str(Path(args.model).resolve()) if args.model else None
    used = {"command": "run", "model": model, "kind": None if model else args.kind, "dtype": args.dtype}
    write_atomic(run_dir / "invocation.json", dumps(used, indent=1))


# -- train -------------------------------------------------------------------------------------


def _train(args: argparse.Namespace) -> int:
    from .jobs.finetune import FinetuneOptions, Injection, run_finetune
    from .record import load_run
    from .report.terminal import render_terminal

    config = _config(args)
    _check_output_dir(config.output_dir)
    options = FinetuneOptions(
        model=args.model,
        data=args.data,
        steps=args.steps,
        batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        mixed_precision=args.mixed_precision,
        cpu=args.cpu,
        seed=args.seed,
        snr_gamma=args.snr_gamma,
        ema=args.ema,
        injections=[Injection.parse(text) for text in args.inject],
        config=config,
    )
    try:
        summary = run_finetune(options)
    except DiffusionDebugError as error:
        if error.anomaly is None:
            raise
        print(f"diffusion-debug: stopped by policy 'raise': {error}", file=sys.stderr)
        return 1
    if "run_dir" in summary:  # the main process
        print(render_terminal(load_run(summary["run_dir"])))
        print(f"\nreport: {Path(summary['run_dir']) / 'report.html'}")
    return 0


# -- doctor ------------------------------------------------------------------------------------


def _doctor(args: argparse.Namespace) -> int:
    from .jobs.doctor import doctor_table, run_doctor

    dtypes = tuple(name.strip() for name in args.dtypes.split(",") if name.strip())
    unknown = [name for name in dtypes if name not in DTYPES]
    if unknown:
        raise DiffusionDebugError(f"--dtypes: unknown dtype {unknown[0]!r}; choose from {', '.join(DTYPES)}.")
    if args.model is not None:
        _model_index(args.model)  # the one clear error, before any run starts
    _device(args.device)
    _check_output_dir(args.output_dir or "debug_output")
    result = run_doctor(
        lambda dtype: load_pipeline(args.model, args.kind, dtype, args.device),
        args.output_dir or "debug_output",
        dtypes=dtypes,
        compile=args.compile,
        prompt=args.prompt,
        steps=args.steps,
        seed=args.seed,
    )
    print(doctor_table(result))
    print(f"\nrecommended: {result['recommendation']}")
    print(f"details: {Path(result['run_dir']) / 'doctor.json'}")
    return 0


# -- report / inspect / replay -----------------------------------------------------------------


def _report(args: argparse.Namespace) -> int:
    from .record import load_run
    from .report import write_html
    from .report.terminal import render_terminal

    run = load_run(args.run_dir)
    print(render_terminal(run))
    if not args.no_html:
        print(f"\nreport: {write_html(args.run_dir)}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from .diffusion.components import analyze_pipeline
    from .record import dumps
    from .report.terminal import components_table, table

    pipe = load_pipeline(args.model, args.kind, args.dtype, args.device)
    analysis = analyze_pipeline(pipe)
    if args.json:
        print(dumps(analysis, indent=1))
        return 0
    components = {k: v for k, v in analysis.items() if isinstance(v, dict) and "parameters" in v}
    print(f"{type(pipe).__name__}: {analysis['total_parameters']:,} parameters")
    print(components_table(components))
    scheduler = analysis.get("scheduler") or {}
    if scheduler:
        print(f"\nscheduler {scheduler.get('class', '')}")
        options = sorted((scheduler.get("config") or {}).items())
        # str(): False and None are values here, not blanks
        print(table(["option", "value"], [(k, str(v) if v is None or isinstance(v, bool) else v) for k, v in options]))
    return 0


def _replay(args: argparse.Namespace) -> int:
    from .diffusion.bundle import read_bundle, replay

    meta, _ = read_bundle(args.bundle)  # a damaged bundle is one line, before the pipeline loads
    pipe = load_pipeline(args.model, args.kind, meta.get("parameter_dtype") or "float32", args.device)
    component = meta["component"]
    module = getattr(pipe, component, None) if component.isidentifier() else None
    if not isinstance(module, torch_module()):
        raise DiffusionDebugError(f"The pipeline has no component {component[:80]!r} to replay the bundle on.")
    result = replay(args.bundle, module)
    where = f"(step {meta.get('step')}, timestep {meta.get('timestep')})"
    if result["module"] is not None:
        print(f"first non-finite value: {component} {result['module'] or '(its own forward)'} {where}")
        return 0
    if result["first_nonfinite"] is not None:
        print(
            f"the saved inputs are already non-finite; first module passing it on: {component} "
            f"{result['first_nonfinite']} {where}"
        )
        return 0
    print("the replay stayed finite: the fault does not reproduce with these weights (pass the --model it came from)")
    return 1


def torch_module() -> type:
    from torch import nn

    return nn.Module


def _serve(args: argparse.Namespace) -> int:
    from .jobs.serve import make_server

    server = make_server(args.directory, args.port, args.host)
    print(f"serving {args.directory} at {server.url}/ (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


# -- parser --------------------------------------------------------------------------------------


def _add_pipeline_options(parser: argparse.ArgumentParser, *, dtype: bool = True) -> None:
    parser.add_argument("--model", help="a local diffusers pipeline directory (default: the built-in tiny pipeline)")
    parser.add_argument("--kind", choices=("sd", "sdxl", "sd3"), default="sd", help="which built-in tiny pipeline")
    if dtype:
        parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--device", help="e.g. cpu, cuda, cuda:1 (default: cuda if available)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text[:40]!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text[:40]!r}") from None
    if not 0 <= value <= 2**64 - 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 2**64-1, not {text[:40]}")
    return value


def _finite_float(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, not {text[:40]!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text[:40]}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block): ``PROG: error: MESSAGE``, exit 2."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (--help for usage)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="diffusion-debug", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    demo = commands.add_parser("demo", help="the tiny built-in pipeline: a clean run and planted faults")
    demo.add_argument("--steps", type=_positive_int, default=8)
    demo.add_argument("--level", choices=LEVELS)
    demo.add_argument("--output-dir")
    demo.set_defaults(func=_demo)

    run = commands.add_parser("run", help="debug one pipeline call")
    _add_pipeline_options(run)
    run.add_argument("--prompt", default="a photo of an astronaut riding a horse")
    run.add_argument("--negative-prompt")
    run.add_argument("--steps", type=_positive_int, default=20)
    run.add_argument("--guidance-scale", type=_finite_float, default=7.5)
    run.add_argument("--height", type=_positive_int)
    run.add_argument("--width", type=_positive_int)
    run.add_argument("--seed", type=_seed, default=0)
    _add_config_options(run)
    run.set_defaults(func=_run)

    train = commands.add_parser("train", help="a UNet fine-tuning debug job (works under accelerate launch)")
    train.add_argument("--model", help="a local diffusers pipeline directory whose UNet is trained (default: tiny)")
    train.add_argument("--data", help="a folder of images with captions (metadata.jsonl or .txt); default: synthetic")
    train.add_argument("--steps", type=_positive_int, default=20, help="optimizer steps")
    train.add_argument("--batch-size", type=_positive_int, default=2)
    train.add_argument("--gradient-accumulation-steps", type=_positive_int, default=1)
    train.add_argument("--learning-rate", type=float, default=1e-4)
    train.add_argument("--mixed-precision", choices=("no", "fp16", "bf16"), default="no")
    train.add_argument("--cpu", action="store_true", help="run on CPU even where a GPU exists")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--snr-gamma", type=float, help="min-SNR loss weighting with this gamma (e.g. 5.0)")
    train.add_argument("--ema", action="store_true", help="keep an EMA copy of the UNet")
    train.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="KIND@STEP",
        help="plant a fault (repeatable): nan-grad, lr-spike, nan-loss-rank1, nan-input or loss-spike @STEP",
    )
    _add_config_options(train)
    train.set_defaults(func=_train)

    doctor = commands.add_parser(
        "doctor", help="one call in float32, float16 and bfloat16: which dtype each part needs"
    )
    _add_pipeline_options(doctor, dtype=False)
    doctor.add_argument("--dtypes", default="float32,float16,bfloat16", help="comma-separated (float32 always runs)")
    doctor.add_argument(
        "--compile", action="store_true", help="also run each dtype with torch.compile on the denoiser"
    )
    doctor.add_argument("--prompt", default="a photo of an astronaut riding a horse")
    doctor.add_argument("--steps", type=_positive_int, default=4)
    doctor.add_argument("--seed", type=_seed, default=0)
    doctor.add_argument("--output-dir", help="where the doctor directory goes (default: debug_output)")
    doctor.set_defaults(func=_doctor)

    report = commands.add_parser("report", help="summarise a saved run and rebuild its report.html")
    report.add_argument("run_dir", type=Path)
    report.add_argument("--no-html", action="store_true", help="only print the terminal summary")
    report.set_defaults(func=_report)

    inspect = commands.add_parser("inspect", help="the components of a pipeline")
    _add_pipeline_options(inspect)
    inspect.add_argument("--json", action="store_true")
    inspect.set_defaults(func=_inspect)

    replay = commands.add_parser("replay", help="re-run a saved repro bundle with full probes")
    replay.add_argument("bundle", type=Path)
    replay.add_argument("--model", help="the pipeline directory the bundle came from (bundles hold no weights)")
    replay.add_argument(
        "--kind", choices=("sd", "sdxl", "sd3"), default="sd", help="built-in tiny pipeline, without --model"
    )
    replay.add_argument("--device")
    replay.set_defaults(func=_replay)

    serve = commands.add_parser("serve", help="a read-only web server over an output directory's runs")
    serve.add_argument("directory", type=Path, nargs="?", default=Path("debug_output"))
    serve.add_argument("--port", type=int, default=8765, help="0: a free port (printed)")
    serve.add_argument("--host", default="127.0.0.1", help="the address to bind (default: loopback only)")
    serve.set_defaults(func=_serve)
    return parser


def _quiet_libraries() -> None:
    """diffusers' and transformers' warnings and loading bars are not ours to show; ours stay."""
    import logging
    import os
    import warnings

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name in ("diffusers", "transformers", "huggingface_hub", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.set_verbosity_error()
        diffusers_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - diffusers is a dependency
        pass
    for module in ("diffusers", "transformers", "huggingface_hub", "accelerate"):
        warnings.filterwarnings("ignore", module=module)
    warnings.filterwarnings("ignore", message=".*__array__ implementation doesn't accept a copy keyword")
    warnings.filterwarnings("default", message="diffusion-debug")  # ours, wherever they are raised from


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "serve":
        _quiet_libraries()
    try:
        return args.func(args)
    except DiffusionDebugError as error:
        print(f"diffusion-debug {args.command}: error: {_one_line(str(error), 2000)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"diffusion-debug {args.command}: interrupted.", file=sys.stderr)
        return 130
    except OSError as error:  # a failing disk or a vanished file, after the inputs were checked
        if isinstance(error, BrokenPipeError):
            return _closed_pipe()
        where = f" ({error.filename})" if getattr(error, "filename", None) else ""
        print(f"diffusion-debug {args.command}: error: {_disk_reason(error)}{where}.", file=sys.stderr)
        return 1
    except Exception as error:  # a bug of ours or a library's: one line, the traceback on request
        if os.environ.get("DIFFUSION_DEBUG_TRACEBACK"):
            raise
        reason = _one_line(f"{type(error).__name__}: {error}")
        print(
            f"diffusion-debug {args.command}: internal error: {reason} (DIFFUSION_DEBUG_TRACEBACK=1 shows where)",
            file=sys.stderr,
        )
        return 1


def _closed_pipe() -> int:
    # the reader went away (``report RUN | head -1``): no traceback, and none at exit either
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1


if __name__ == "__main__":
    sys.exit(main())
