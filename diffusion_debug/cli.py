"""diffusion-debug: debug diffusers pipelines and their fine-tuning runs.

Commands: demo, run, train, launch, doctor, report, inspect, replay, why, diff, compare, serve,
export (``diffusion-debug COMMAND --help``).

Each command here parses and checks its flags, then calls the job that does the work
(``diffusion_debug.jobs``); ``main`` turns every failure into one line and an exit code.
Long because the parser is one object that declares every command's flags, and ``main`` also
puts back what a command quietened (``_quiet_libraries``) for a process that goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Iterator

from .config import LEVELS, POLICIES, DebugConfig, read_config_file
from .errors import DiffusionDebugError
from .jobs import pipeline_loading
from .jobs.cli_arguments import (
    COMMAND_DESCRIPTIONS,
    NO_HTML_HELP,
    HelpLayout,
    OneLineParser,
    add_call_options,
    port,
    positive_int,
    seed_below,
    step_index,
    torch_seed,
)
from .jobs.compare import add_compare_commands
from .jobs.export import EXPORT_FORMATS
from .jobs.outcome_lines import training_stop_line
from .jobs.pipeline_loading import (
    DTYPES,
    MAX_SIDE,
    check_device,
    check_output_dir,
    check_run_values,
    check_steps,
    disk_reason,
    load_pipeline,
    model_index,
    one_line,
    saved_scheduler_config,
    size_factor,
)
from .jobs.progress import DoctorProgress, shows_progress
from .jobs.why import add_why_command

__all__ = ["DTYPES", "MAX_SIDE", "build_parser", "check_run_values", "load_pipeline", "main", "size_factor"]


def _config(args: argparse.Namespace) -> DebugConfig:
    """--config's keys, with --level / --policy / --output-dir on top."""
    data = read_config_file(args.config) if args.config else {}
    for key in ("level", "policy", "output_dir"):
        if getattr(args, key):
            data[key] = getattr(args, key)
    return DebugConfig.from_dict(data)


def _add_config_options(parser: argparse.ArgumentParser, policies: tuple[str, ...] = POLICIES) -> None:
    parser.add_argument("--config", type=Path, help="a YAML or JSON DebugConfig file (e.g. configs/advanced.yaml)")
    parser.add_argument("--level", choices=LEVELS, help="basic | advanced | extreme (default: the config's)")
    parser.add_argument("--policy", choices=policies, help="what an error-severity anomaly does (default: record)")
    parser.add_argument("--output-dir", help="where run directories go (default: debug_output)")


def _add_quiet_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quiet", action="store_true", help="no progress bar on stderr (one is drawn only when stderr is a terminal)"
    )


# -- the commands: check the flags, call the job -----------------------------------------------


def _demo(args: argparse.Namespace) -> int:
    from .jobs.demo import run_demo

    check_output_dir(args.output_dir or "debug_output")
    check_steps(args.steps, saved_scheduler_config(None))  # the demo's tiny pipeline
    run_demo(
        args.output_dir or "debug_output", steps=args.steps, level=args.level, progress=shows_progress(args.quiet)
    )
    return 0


def _run(args: argparse.Namespace) -> int:
    from .jobs.run import RunOptions, run_pipeline

    config = _config(args)  # bad config fails before the pipeline loads
    check_output_dir(config.output_dir)
    options = RunOptions(
        model=args.model,
        kind=args.kind,
        dtype=args.dtype,
        device=args.device,
        prompt=args.prompt,
        negative_prompt=args.negative_prompt,
        steps=args.steps,
        guidance_scale=args.guidance_scale,
        height=args.height,
        width=args.width,
        seed=args.seed,
        repeat=args.repeat,
        profile=args.profile,
        progress=shows_progress(args.quiet),
        html=not args.no_html,
    )
    return run_pipeline(options, config)


def _train(args: argparse.Namespace) -> int:
    from .jobs.finetune import FinetuneOptions, Injection, run_finetune
    from .jobs.launch_end import saved_line
    from .record import load_run
    from .report.terminal import render_terminal

    config = _config(args)
    check_output_dir(config.output_dir)
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
        progress=shows_progress(args.quiet),
        html=not args.no_html,
    )
    try:
        summary = run_finetune(options)
    except DiffusionDebugError as error:
        if error.anomaly is None:
            raise
        print(f"diffusion-debug: stopped by policy 'raise': {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as error:  # as `run` says it: where the run so far is
        run_dir = getattr(error, "run_dir", None)
        kept = f"the run so far is in {run_dir} (diffusion-debug report DIR)" if run_dir else "no report was saved"
        print(f"diffusion-debug train: interrupted; {kept}.", file=sys.stderr)
        return 130
    if "run_dir" in summary:  # the main process
        print(render_terminal(load_run(summary["run_dir"])))
        if summary.get("stopped_by_policy"):
            print(training_stop_line(summary))
        print(f"\n{saved_line(summary['run_dir'], options.html, '--no-html')}")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from .jobs.doctor import doctor_table, run_doctor

    dtypes = tuple(name.strip() for name in args.dtypes.split(",") if name.strip())
    unknown = [name for name in dtypes if name not in DTYPES]
    if unknown:
        raise DiffusionDebugError(f"--dtypes: unknown dtype {unknown[0]!r}; choose from {', '.join(DTYPES)}.")
    if args.model is not None:
        model_index(args.model)  # the one clear error, before any run starts
    check_steps(args.steps, saved_scheduler_config(args.model, args.kind))
    check_device(args.device)
    check_output_dir(args.output_dir or "debug_output")
    progress = DoctorProgress(dtypes, args.compile, args.quiet)
    try:
        result = run_doctor(
            # looked up at call time, where tests plant a loader
            lambda dtype: pipeline_loading.load_pipeline(args.model, args.kind, dtype, args.device),
            args.output_dir or "debug_output",
            dtypes=dtypes,
            compile=args.compile,
            progress=progress,
            loaded_from=(args.model, args.kind),
            prompt=args.prompt,
            steps=args.steps,
            seed=args.seed,
        )
    finally:
        progress.close()
    print(doctor_table(result))
    print(f"\nrecommended: {result['recommendation']}")
    print(f"details: {Path(result['run_dir']) / 'doctor.json'}")
    if not any(run["status"] == "ok" for run in result["runs"]):
        print("diffusion-debug doctor: no dtype's run finished (the table's notes say why).", file=sys.stderr)
        return 1
    return 0


def _report(args: argparse.Namespace) -> int:
    from .record import load_run
    from .report import write_html
    from .report.terminal import render_terminal

    run = load_run(args.run_dir)
    # the page first: a reader that goes away early (``report RUN | head``) must not leave it unbuilt
    try:
        html = None if args.no_html else write_html(args.run_dir)
    except OSError:
        print(render_terminal(run))  # the summary still shows; main says why the page was not written
        raise
    print(render_terminal(run))
    if html is not None:
        print(f"\nreport: {html}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from .jobs.inspect import inspect_pipeline

    return inspect_pipeline(args.model, args.kind, args.dtype, args.device, as_json=args.json)


def _replay(args: argparse.Namespace) -> int:
    from .jobs.replay import replay_bundle

    return replay_bundle(args.bundle, args.model, args.kind, args.device, progress=shows_progress(args.quiet))


def _export(args: argparse.Namespace) -> int:
    from .jobs.export import export_run

    for path in export_run(args.run_dir, args.format, args.out):
        print(path)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .report.server import make_server

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
        parser.add_argument("--dtype", choices=DTYPES, default="float32", help="the dtype the pipeline is loaded in")
    parser.add_argument("--device", help="e.g. cpu, cuda, cuda:1 (default: cuda if available)")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="diffusion-debug", description=__doc__.splitlines()[0], formatter_class=HelpLayout)
    parser.add_argument("--version", action=_VersionAction, help="the version, and those of the libraries under it")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        """A subcommand: ``summary`` in the command list, :data:`COMMAND_DESCRIPTIONS` on its own --help."""
        return commands.add_parser(
            name, help=summary, description=COMMAND_DESCRIPTIONS[name], formatter_class=HelpLayout
        )

    demo = command("demo", "the tiny built-in pipeline: a clean run and planted faults")
    demo.add_argument("--steps", type=positive_int, default=8, help="denoising steps per run")
    demo.add_argument("--level", choices=LEVELS, help="the debug level (default: advanced)")
    demo.add_argument("--output-dir", help="where the run directories go (default: debug_output)")
    _add_quiet_option(demo)
    demo.set_defaults(func=_demo)

    run = command("run", "debug one pipeline call")
    _add_pipeline_options(run)
    add_call_options(run)
    run.add_argument(
        "--repeat", type=positive_int, default=1, help="run the call N times with the same seed (determinism check)"
    )
    run.add_argument(
        "--profile",
        type=step_index,
        metavar="STEP",
        help="profile denoising step STEP (from 0): a Chrome trace, a CUDA memory snapshot, the top modules and "
        "operators",
    )
    run.add_argument("--no-html", action="store_true", help=NO_HTML_HELP)
    _add_config_options(run, policies=tuple(p for p in POLICIES if p != "skip"))  # a pipeline has no step to skip
    _add_quiet_option(run)
    run.set_defaults(func=_run)

    train = command("train", "a UNet fine-tuning debug job (works under accelerate launch)")
    train.add_argument("--model", help="a local diffusers pipeline directory whose UNet is trained (default: tiny)")
    train.add_argument("--data", help="a folder of images with captions (metadata.jsonl or .txt); default: synthetic")
    train.add_argument("--steps", type=positive_int, default=20, help="optimizer steps")
    train.add_argument("--batch-size", type=positive_int, default=2, help="images per batch, per process")
    train.add_argument(
        "--gradient-accumulation-steps", type=positive_int, default=1, help="micro-batches per optimizer step"
    )
    train.add_argument("--learning-rate", type=float, default=1e-4, help="AdamW's learning rate")
    train.add_argument(
        "--mixed-precision", choices=("no", "fp16", "bf16"), default="no", help="Accelerate's (fp16 needs a CUDA GPU)"
    )
    train.add_argument("--cpu", action="store_true", help="run on CPU even where a GPU exists")
    train.add_argument("--seed", type=seed_below(32), default=0, help="the seed given to Accelerate's set_seed")
    train.add_argument("--snr-gamma", type=float, help="min-SNR loss weighting with this gamma (e.g. 5.0)")
    train.add_argument("--ema", action="store_true", help="keep an EMA copy of the UNet")
    train.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="KIND@STEP",
        help="plant a fault (repeatable, one per step): nan-grad, lr-spike, lr-jump, nan-loss-rank1 (2+ processes), "
        "nan-input or loss-spike @STEP (from 0, below --steps)",
    )
    train.add_argument("--no-html", action="store_true", help=NO_HTML_HELP)
    _add_config_options(train)
    _add_quiet_option(train)
    train.set_defaults(func=_train)

    doctor = command("doctor", "one call in float32, float16 and bfloat16: which dtype each part needs")
    _add_pipeline_options(doctor, dtype=False)
    doctor.add_argument(
        "--dtypes", default="float32,float16,bfloat16", help="comma-separated dtypes to try (float32 always runs)"
    )
    doctor.add_argument(
        "--compile",
        action="store_true",
        help="also run each dtype with torch.compile on the denoiser (timed warm; the compile time apart)",
    )
    doctor.add_argument("--prompt", default="a photo of an astronaut riding a horse", help="the prompt")
    doctor.add_argument("--steps", type=positive_int, default=4, help="denoising steps per dtype")
    doctor.add_argument("--seed", type=torch_seed, default=0, help="seed of the call's CPU generator")
    doctor.add_argument("--output-dir", help="where the doctor directory goes (default: debug_output)")
    _add_quiet_option(doctor)
    doctor.set_defaults(func=_doctor)

    report = command("report", "summarise a saved run and rebuild its report.html")
    report.add_argument("run_dir", type=Path, help="a run directory (e.g. debug_output/run-...)")
    report.add_argument("--no-html", action="store_true", help="only print the terminal summary")
    report.set_defaults(func=_report)

    inspect = command("inspect", "the components of a pipeline")
    _add_pipeline_options(inspect)
    inspect.add_argument("--json", action="store_true", help="print the components and the scheduler as JSON")
    inspect.set_defaults(func=_inspect)

    replay = command("replay", "re-run a saved repro bundle with full probes")
    replay.add_argument("bundle", type=Path, help="a bundle directory (RUN_DIR/bundles/NAME)")
    replay.add_argument("--model", help="the pipeline directory the bundle came from (bundles hold no weights)")
    replay.add_argument(
        "--kind", choices=("sd", "sdxl", "sd3"), default="sd", help="built-in tiny pipeline, without --model"
    )
    replay.add_argument("--device", help="e.g. cpu, cuda, cuda:1 (default: cuda if available)")
    _add_quiet_option(replay)
    replay.set_defaults(func=_replay)
    add_why_command(command)
    add_compare_commands(command, _add_pipeline_options)

    serve = command("serve", "a read-only web server over an output directory's runs")
    serve.add_argument(
        "directory",
        type=Path,
        nargs="?",
        default=Path("debug_output"),
        help="the output directory whose runs it serves",
    )
    serve.add_argument("--port", type=port, default=0, help="the port to listen on (default 0: a free one, printed)")
    serve.add_argument("--host", default="127.0.0.1", help="the address to bind (default: loopback only)")
    serve.set_defaults(func=_serve)

    export = command("export", "a saved run's steps, anomalies and per-rank rows as CSV or parquet tables")
    export.add_argument("run_dir", type=Path, help="a run directory (e.g. debug_output/run-...)")
    export.add_argument("--format", choices=EXPORT_FORMATS, default="csv", help="csv, or parquet (needs pyarrow)")
    export.add_argument("--out", type=Path, help="the folder the tables go to (default: the run directory)")
    export.set_defaults(func=_export)

    launch = command("launch", "run an unmodified training script under accelerate launch, with the debugger")
    launch.add_argument("--debug-output-dir", help="where the run directory goes (default: debug_output)")
    launch.add_argument("--debug-config", type=Path, help="a YAML or JSON DebugConfig file")
    launch.add_argument("--level", choices=LEVELS, help="basic | advanced | extreme (default: the config's)")
    launch.add_argument("--policy", choices=POLICIES, help="what an error-severity anomaly does (default: record)")
    launch.add_argument(
        "accelerate_arguments",
        nargs=argparse.REMAINDER,
        metavar="[accelerate launch options] SCRIPT [SCRIPT ARGS]",
        help="exactly what accelerate launch takes",
    )
    return parser


def _launch(arguments: list[str]) -> int:
    from .jobs.launch import run_launch

    return run_launch(arguments)


@contextlib.contextmanager
def _quiet_libraries(loads_pipelines: bool = True) -> Iterator[None]:
    """diffusers' and transformers' warnings and loading bars are not ours to show; ours stay.
    A command that loads no pipeline (``report``, ``export``) does not import diffusers for it
    (seconds of a command that reads a run directory); its variables quiet it if it comes later.
    Put back as they were when the command returns: ``main`` called in a process that goes on (a
    test, a notebook) leaves its variables, loggers, loading bars and warning filters as it found them."""
    import logging
    import warnings

    variables = {name: os.environ.get(name) for name in _QUIET_VARIABLES}
    levels = {name: logging.getLogger(name).level for name in _QUIET_LOGGERS}
    bars: list[Any] = []  # the libraries whose loading bar was on: turned on again
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # transformers sets its logger's level when it first logs, from this variable: a level set
    # before that is overwritten (and it may be imported only later, by a pipeline's loading)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        try:
            if loads_pipelines or "diffusers" in sys.modules:  # its loading bar has no variable: set once imported
                from diffusers.utils import logging as diffusers_logging

                diffusers_logging.set_verbosity_error()
                bars += [diffusers_logging] if diffusers_logging.is_progress_bar_enabled() else []
                diffusers_logging.disable_progress_bar()
            if "transformers" in sys.modules:  # imported already (a test, a notebook): the variables above came late
                from transformers.utils import logging as transformers_logging

                bars += [transformers_logging] if transformers_logging.is_progress_bar_enabled() else []
                transformers_logging.disable_progress_bar()  # its "Loading weights" bar
            for module in _QUIET_LOGGERS:
                warnings.filterwarnings("ignore", module=module)
            warnings.filterwarnings("ignore", message=".*__array__ implementation doesn't accept a copy keyword")
            warnings.filterwarnings("default", message="diffusion-debug")  # ours, wherever they are raised from
            yield
        finally:
            for name, value in variables.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)
            for library in bars:
                library.enable_progress_bar()


_QUIET_VARIABLES = ("HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY", "DIFFUSERS_VERBOSITY")
# torchao and bitsandbytes log at import, when diffusers imports them, that their kernels for another
# torch or GPU did not load, and torch that torchao's pytree registrations are deprecated: a
# library's noise on every command's stderr where they are installed (the quant extra)
_QUIET_LOGGERS = (
    "diffusers",
    "transformers",
    "huggingface_hub",
    "accelerate",
    "torchao",
    "bitsandbytes",
    "torch.utils._pytree",
)


def version_line() -> str:
    """``diffusion-debug 0.1.0 (python 3.11.7, torch 2.13.0+cpu, diffusers 0.42.1, ...)``: what a bug
    report needs, as a run's summary records it."""
    from .record.run_record import versions

    found = versions()
    names = ("python", "torch", "diffusers", "transformers", "accelerate", "cuda")
    under = ", ".join(f"{name} {found[name]}" for name in names if name in found)
    return f"diffusion-debug {found.get('diffusion_debug', 'unknown')} ({under})"


class _VersionAction(argparse.Action):
    """Prints :func:`version_line` as one line (argparse's own version action wraps it to the terminal)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(version_line())
        parser.exit()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"] and argv[1:2] not in (["-h"], ["--help"]):
        # its options are accelerate's, after ours: argparse would take them for its own (a bare
        # `launch` too: the launcher says in one line what it needs)
        args = argparse.Namespace(command="launch", func=lambda _: _launch(argv[1:]))
    else:
        args = parser.parse_args(argv)
    quiet = args.command not in ("serve", "launch")  # launch runs no library here: its processes keep their own
    try:
        with _quiet_libraries(args.command not in ("report", "export")) if quiet else contextlib.nullcontext():
            return args.func(args)
    except DiffusionDebugError as error:
        print(f"diffusion-debug {args.command}: error: {one_line(str(error), 2000)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"diffusion-debug {args.command}: interrupted.", file=sys.stderr)
        return 130
    except OSError as error:  # a failing disk or a vanished file, after the inputs were checked
        if isinstance(error, BrokenPipeError):
            return _closed_pipe()
        where = f" ({error.filename})" if getattr(error, "filename", None) else ""
        print(f"diffusion-debug {args.command}: error: {disk_reason(error)}{where}.", file=sys.stderr)
        return 1
    except Exception as error:  # a bug of ours or a library's: one line, the traceback on request
        if os.environ.get("DIFFUSION_DEBUG_TRACEBACK"):
            raise
        reason = one_line(f"{type(error).__name__}: {error}")
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
