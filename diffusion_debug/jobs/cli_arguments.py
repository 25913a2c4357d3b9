"""The CLI's flag types, its one-line parse errors, its help layout and each command's description.

A flag type turns the text of a flag into its value or says in a few words why it cannot
(``argparse.ArgumentTypeError``); argparse puts that on the one error line of :class:`OneLineParser`.

>>> positive_int("3")
3
>>> seed_below(32)("-1")
Traceback (most recent call last):
...
argparse.ArgumentTypeError: must be between 0 and 2**32-1, not -1

Limits: ``--help`` shows a default only where one means something (not None, False or an empty
list); a help text that already says its default keeps its own words.
"""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

COMMAND_DESCRIPTIONS = {
    "demo": "Run the built-in tiny pipeline (random weights; a CPU is enough) once clean and once with each of "
    "three planted faults (an Inf in a UNet weight, an fp16 VAE close to overflow, a prompt over 77 tokens), and "
    "print what the debugger finds in each. Every run gets its own directory with a report.html.",
    "run": "Load a diffusers pipeline (a local directory with --model, or a built-in tiny one), run one call with "
    "the debugger attached and print what it found: the anomalies (the cause first), the denoising steps and the "
    "components. The run directory (image.png, summary.json, events.jsonl, report.html) goes under --output-dir."
    "\n\nexample: diffusion-debug run --model ./sd15 --dtype float16 --steps 30",
    "train": "A diffusers-style UNet fine-tuning loop (noise-prediction loss, AdamW, Accelerate) with the training "
    "debugger watching: loss and gradient anomalies, skipped fp16 steps, memory growth. --inject plants a fault, "
    "to see what a detection looks like."
    "\n\nexample: accelerate launch -m diffusion_debug.cli train --steps 60 --inject nan-grad@30",
    "doctor": "Run the same call (prompt, seed, steps) in float32, float16 and bfloat16 and say, per component, "
    "whether it stayed finite, how close its largest activation came to the dtype's limit, and which dtype to use. "
    "Writes doctor.json and one run directory per dtype.",
    "report": "Print the terminal summary of a saved run directory and rebuild its report.html from the saved "
    "files alone (also for a run that was killed).",
    "inspect": "List a pipeline's components (class, parameters, dtype, device, size) and its scheduler's "
    "config, without running it.",
    "replay": "Re-run the component call saved in a repro bundle (the inputs of the call where NaN/Inf first "
    "appeared) with every module probed, and print the first module whose output is non-finite. Bundles hold no "
    "weights: pass the --model the run used (the report prints the whole command).",
    "why": "Replay a saved run's first NaN/Inf call (its repro bundle) with one setting changed at a time: "
    "float32, bfloat16, the VAE upcast, the math attention kernel, the default attention processor, eager instead "
    "of compiled, each LoRA adapter off, diffusers' casting, offloading and caching hooks off, finite inputs. "
    "Prints a table and the smallest change that makes the call finite, or says that the weights or the inputs "
    "are at fault; writes why.json and why.md into the run directory."
    "\n\nexample: diffusion-debug why debug_output/run-20261125-101500-1234",
    "launch": "Run a training script exactly as accelerate launch would (same options, same processes, same exit "
    "code) with the training debugger attached in every process, and nothing in the script changed: the models and "
    "optimizers it passes to Accelerator.prepare are watched, gradients are read at each optimizer step, the loss "
    "comes from Accelerator.backward. Our options come first; everything after them is accelerate launch's. "
    "DIFFUSION_DEBUG_NO_HTML=1 in the environment saves the run without report.html (as train --no-html)."
    "\n\nexample: diffusion-debug launch --num_processes 2 --cpu train_text_to_image.py --max_train_steps 100",
    "diff": "Compare two saved runs of one pipeline (same class, same step count) as far as their records allow: "
    "each component call's module readings (runs at --level extreme), else the step rows. Prints the first "
    "component, step and module whose output drifts beyond the dtypes' tolerance, made there (its own inputs "
    "agreed) or received, or 'equal within ...'; writes comparison.json and report.html. Exit code 1 when they "
    "diverge."
    "\n\nexample: diffusion-debug diff debug_output/run-A debug_output/run-B",
    "compare": "Run one call (prompt, seed, steps) on two setups of a pipeline, as run does for one, and name the "
    "first component, step and module where they drift apart beyond the dtypes' tolerance, made there (it "
    "persists when B's component is replayed on A's inputs) or received, or say 'equal within ...'. --a and --b "
    "set one side each over the shared flags. Writes comparison.json and report.html. Exit code 1 when they "
    "diverge."
    "\n\nexample: diffusion-debug compare --model ./sd15 --a dtype=float32 --b dtype=float16 --steps 4",
    "serve": "Serve the reports of an output directory's runs over HTTP, read-only, on this machine only.",
    "export": "Write a saved run's records as tables: steps (one row per recorded step, nested statistics as "
    "columns such as latents.std), anomalies (one row each, details as JSON text) and ranks (one row per training "
    "step and rank). --format parquet needs pyarrow (pip install pyarrow).",
}
"""What each command's ``--help`` says before its options."""
NO_HTML_HELP = (
    "save the run without report.html, seconds sooner (summary.json, events.jsonl and the terminal summary as "
    "always; diffusion-debug report RUN_DIR builds the page later)"
)
"""``run --no-html``'s and ``train --no-html``'s help (a launch says it with DIFFUSION_DEBUG_NO_HTML=1)."""


def _whole_number(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text[:40]!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {value}")
    return value


def positive_int(text: str) -> int:
    return _whole_number(text, 1)


def step_index(text: str) -> int:
    return _whole_number(text, 0)


def seed_below(bits: int) -> Any:
    """A seed's type: a whole number from 0 to 2**bits-1 (torch takes 64 bits; numpy, which
    Accelerate's ``set_seed`` seeds too, 32)."""

    def seed(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, not {text[:40]!r}") from None
        if not 0 <= value <= 2**bits - 1:
            raise argparse.ArgumentTypeError(f"must be between 0 and 2**{bits}-1, not {text[:40]}")
        return value

    return seed


torch_seed = seed_below(64)
"""A seed torch takes (64 bits)."""


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 0 to 65535, not {text[:40]!r}")
    return value


def finite_float(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, not {text[:40]!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text[:40]}")
    return value


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block): ``PROG: error: MESSAGE``, exit 2."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (--help for usage)\n")


class HelpLayout(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help with its default (``(default: 20)``); descriptions wrapped paragraph by
    paragraph (a blank line in a description stays; an ``example:`` line is not wrapped)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:  # argparse's hook for the default
        help = action.help or ""
        if action.default is None or action.default is False or action.default == [] or "default" in help:
            return help
        return super()._get_help_string(action)

    def _fill_text(self, text: str, width: int, indent: str) -> str:  # argparse's hook for descriptions
        paragraphs = [" ".join(part.split()) for part in text.split("\n\n")]
        return "\n\n".join(
            indent + p  # an example stays on one line, to copy as it is
            if p.startswith("example:")
            else textwrap.fill(p, width, initial_indent=indent, subsequent_indent=indent)
            for p in paragraphs
        )


def add_call_options(parser: argparse.ArgumentParser) -> None:
    """The flags of one pipeline call (``run``, ``compare``): prompt, steps, guidance, size, seed."""
    parser.add_argument("--prompt", default="a photo of an astronaut riding a horse", help="the prompt")
    parser.add_argument("--negative-prompt", help="the negative prompt (default: none)")
    parser.add_argument("--steps", type=positive_int, default=20, help="denoising steps")
    parser.add_argument("--guidance-scale", type=finite_float, default=7.5, help="classifier-free guidance scale")
    parser.add_argument("--height", type=positive_int, help="image height in pixels (default: the pipeline's)")
    parser.add_argument("--width", type=positive_int, help="image width in pixels (default: the pipeline's)")
    parser.add_argument("--seed", type=torch_seed, default=0, help="seed of the call's CPU generator")
