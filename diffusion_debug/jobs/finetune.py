"""The fine-tuning debug job behind ``diffusion-debug train``.

A real diffusers-style UNet fine-tuning loop (noise-prediction objective with the scheduler's
``prediction_type``, optional min-SNR weighting and EMA) with :class:`TrainingDebugger`
watching, on one process or many under ``accelerate launch``, on CPU or GPU, in fp32, fp16 or
bf16.  Planted faults (``--inject``) show what a detection looks like. With ``--policy stop`` the
loop ends at the step whose anomaly is an error, on every rank alike (the debugger decides it
from every rank's figures).

Limits: trains the UNet only (VAE and text encoders frozen); images are resized to a square;
the synthetic dataset is noise with captions, good for debugging, not for learning.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..config import DebugConfig
from ..errors import DiffusionDebugError
from . import pipeline_loading
from .pipeline_loading import model_index
from .progress import TrainingProgress

INJECTIONS = ("nan-grad", "lr-spike", "lr-jump", "nan-loss-rank1", "nan-input", "loss-spike")
"""nan-grad: a NaN in one mid-block gradient; lr-spike: one optimizer step at 1000x the learning
rate; lr-jump: the learning rate 10000x from this step on (a scheduler gone wrong);
nan-loss-rank1: rank 1's loss is NaN; nan-input: a NaN pixel in the batch; loss-spike: the
step's noise target is 30x too large (a bad batch)."""
_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}

MAX_BATCH_SIZE = 1024
"""The largest --batch-size accepted: the synthetic data is eight batches made up front, so a
larger one only fills memory before the first step."""


@dataclass(frozen=True)
class Injection:
    """A planted fault: ``kind`` at training step ``step``."""

    kind: str
    step: int

    def __str__(self) -> str:
        return f"{self.kind}@{self.step}"

    @classmethod
    def parse(cls, text: str) -> "Injection":
        match = re.fullmatch(r"([a-z0-9-]+)@(\d+)", text.strip())
        if not match or match.group(1) not in INJECTIONS:
            raise DiffusionDebugError(
                f"--inject {text!r} is not understood: use KIND@STEP with KIND one of {', '.join(INJECTIONS)}."
            )
        return cls(match.group(1), int(match.group(2)))


@dataclass
class FinetuneOptions:
    model: str | None = None
    data: str | None = None
    steps: int = 20
    batch_size: int = 2
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-4
    mixed_precision: str = "no"
    cpu: bool = False
    seed: int = 0
    snr_gamma: float | None = None
    ema: bool = False
    max_grad_norm: float = 1.0
    injections: list[Injection] = field(default_factory=list)
    config: DebugConfig = field(default_factory=DebugConfig)
    progress: bool = False
    """A bar of optimizer steps on stderr, on the main process (the CLI: a terminal, without --quiet)."""
    html: bool = True
    """Whether the saved run has its report.html (``--no-html``: summary.json and events.jsonl only)."""


def check_options(options: FinetuneOptions) -> None:
    """Bad options are one clear error before anything starts."""
    if options.model is not None:
        listed = model_index(options.model)
        if "unet" not in listed:
            raise DiffusionDebugError(
                f"--model {options.model!r} has no UNet (a {listed.get('_class_name') or 'pipeline'}); train "
                "fine-tunes the UNet of a Stable Diffusion 1.x/2.x pipeline."
            )
    if options.data is not None and not Path(options.data).is_dir():
        raise DiffusionDebugError(f"--data {options.data!r} is not a directory of images.")
    for name in ("steps", "batch_size", "gradient_accumulation_steps"):
        if getattr(options, name) < 1:
            raise DiffusionDebugError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(options, name)}.")
    if options.batch_size > MAX_BATCH_SIZE:
        raise DiffusionDebugError(f"--batch-size {options.batch_size} is more than {MAX_BATCH_SIZE}.")
    for flag, value in (
        ("--learning-rate", options.learning_rate),
        ("--snr-gamma", options.snr_gamma),
        ("--max-grad-norm", options.max_grad_norm),
    ):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise DiffusionDebugError(f"{flag} must be a positive finite number, not {value}.")
    seen: dict[int, Injection] = {}
    for injection in options.injections:
        if injection.step >= options.steps:
            raise DiffusionDebugError(
                f"--inject {injection}: the run's steps are 0 to {options.steps - 1} (--steps {options.steps}), "
                f"so step {injection.step} never comes."
            )
        if injection.step in seen:
            raise DiffusionDebugError(
                f"--inject {seen[injection.step]} and {injection} are at the same step; plant one fault per step."
            )
        seen[injection.step] = injection
    if options.mixed_precision not in ("no", "fp16", "bf16"):
        raise DiffusionDebugError(f"--mixed-precision must be no, fp16 or bf16, not {options.mixed_precision!r}.")
    if options.mixed_precision == "fp16" and (options.cpu or not torch.cuda.is_available()):
        where = "with --cpu" if options.cpu else "on this machine (no CUDA GPU)"
        raise DiffusionDebugError(f"--mixed-precision fp16 needs a CUDA GPU {where}; use bf16 or no.")


def load_pipeline(model: str | None, seed: int):
    """The pipeline whose UNet is trained: a local directory (loaded on the CPU, as ``run`` loads
    it: a directory that does not load is one error naming --model), or the tiny built-in one."""
    if model is None:
        from ..testing import tiny_pipeline

        return tiny_pipeline("sd", seed=seed)
    pipe = pipeline_loading.load_pipeline(model, dtype="float32", device="cpu")
    missing = [name for name in _TRAINED_WITH if getattr(pipe, name, None) is None]
    if missing:
        raise DiffusionDebugError(
            f"--model {model!r} has no {missing[0]} (a {type(pipe).__name__}); train fine-tunes the UNet of a "
            "Stable Diffusion 1.x/2.x pipeline."
        )
    added = pipe.unet.config.get("addition_embed_type")
    if added is not None:
        raise DiffusionDebugError(
            f"--model {model!r}: its UNet needs added conditions ({added!r}, as SDXL's); train feeds it text "
            "embeddings only (a Stable Diffusion 1.x/2.x pipeline)."
        )
    return pipe


_TRAINED_WITH = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")
"""The components the training loop uses."""


def load_dataset(
    data: str | None, tokenizer, size: int, count: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(pixels in [-1, 1], input ids) pairs from a folder, or ``count`` synthetic ones.

    A folder holds images with captions either in ``metadata.jsonl`` (``{"file_name": ...,
    "text": ...}`` per line, as 🤗 datasets' imagefolder) or in a ``.txt`` file of the same stem.
    """
    if data is None:
        g = torch.Generator().manual_seed(seed)
        words = ["a red square", "a photo of a cat", "a blue circle on white", "a dog running on grass"]
        pixels = [torch.rand(3, size, size, generator=g) * 2 - 1 for _ in range(count)]
        captions = [words[i % len(words)] for i in range(count)]
    else:
        pixels, captions = _read_folder(Path(data), size)
    ids = tokenizer(
        captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt"
    ).input_ids
    return list(zip(pixels, ids))


def _read_folder(folder: Path, size: int) -> tuple[list[torch.Tensor], list[str]]:
    import numpy as np
    from PIL import Image

    captions: dict[str, str] = {}
    metadata = folder / "metadata.jsonl"
    if metadata.is_file():
        try:
            lines = metadata.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise DiffusionDebugError(f"--data: {str(metadata)!r} cannot be read ({type(error).__name__}).") from None
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError:
                    row = None
                if not (isinstance(row, dict) and isinstance(row.get("file_name"), str)):
                    raise DiffusionDebugError(
                        f"--data: metadata.jsonl line {number} is not a JSON object with a file_name "
                        '(e.g. {"file_name": "a.png", "text": "a cat"}).'
                    )
                captions[row["file_name"]] = str(row.get("text", ""))
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES)
    if not files:
        raise DiffusionDebugError(f"--data {str(folder)!r} holds no images ({', '.join(sorted(_IMAGE_SUFFIXES))}).")
    pixels, texts = [], []
    for path in files:
        try:
            image = Image.open(path).convert("RGB").resize((size, size), Image.BICUBIC)
        except (OSError, ValueError, Image.DecompressionBombError) as error:  # damaged, truncated, not an image
            reason = " ".join(str(error).split())[:120]
            raise DiffusionDebugError(f"--data: {path.name!r} is not a readable image ({reason}).") from None
        array = torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)
        pixels.append(array)
        sidecar = path.with_suffix(".txt")
        texts.append(
            captions.get(path.name) or (sidecar.read_text(encoding="utf-8").strip() if sidecar.is_file() else "")
        )
    return pixels, texts


def hide_cuda() -> None:
    """Make this process see no GPU, before anything asks CUDA for its devices.

    ``--cpu`` must mean CPU whatever the machine holds: under a multi-process launch on a machine
    with one GPU, a rank that can see CUDA picks ``cuda:<local rank>`` in its first collective and
    rank 1 dies with "invalid device ordinal". CUDA reads ``CUDA_VISIBLE_DEVICES`` once, when it
    is first initialised, so this is done before the Accelerator (or anything else) touches it.
    """
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if torch.cuda.is_initialized():
        raise DiffusionDebugError(
            "--cpu was asked for after CUDA was initialised in this process; start a new process "
            "(or set CUDA_VISIBLE_DEVICES='' before it starts)."
        )


def run_finetune(options: FinetuneOptions) -> dict[str, Any]:
    """Run the job; returns the training summary (with ``run_dir`` on the main process)."""
    check_options(options)
    if options.cpu:
        hide_cuda()
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from diffusers import DDPMScheduler
    from diffusers.training_utils import EMAModel, compute_snr

    from ..training import TrainingDebugger

    accelerator = Accelerator(
        gradient_accumulation_steps=options.gradient_accumulation_steps,
        mixed_precision=options.mixed_precision,
        cpu=options.cpu,
    )
    rank1 = next((i for i in options.injections if i.kind == "nan-loss-rank1"), None)
    if rank1 is not None and accelerator.num_processes < 2:
        raise DiffusionDebugError(
            f"--inject {rank1} needs 2 or more processes (accelerate launch --num_processes 2 ...); "
            f"this run has {accelerator.num_processes}."
        )
    set_seed(options.seed)
    pipe = load_pipeline(options.model, options.seed)
    unet, vae, text_encoder, tokenizer = pipe.unet, pipe.vae, pipe.text_encoder, pipe.tokenizer
    noise_scheduler = DDPMScheduler.from_config(pipe.scheduler.config)
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    unet.train()

    size = unet.config.sample_size * pipe.vae_scale_factor
    dataset = load_dataset(options.data, tokenizer, size, count=8 * options.batch_size, seed=options.seed)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=options.batch_size, shuffle=True, generator=torch.Generator().manual_seed(options.seed)
    )
    optimizer = torch.optim.AdamW(unet.parameters(), lr=options.learning_rate)
    ema = EMAModel(unet.parameters(), model_cls=type(unet), model_config=unet.config) if options.ema else None
    unet, optimizer, loader = accelerator.prepare(unet, optimizer, loader)
    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)
    vae.to(accelerator.device, dtype=weight_dtype)
    text_encoder.to(accelerator.device, dtype=weight_dtype)
    if ema is not None:
        ema.to(accelerator.device)

    debugger = TrainingDebugger(unet, accelerator=accelerator, config=options.config)
    if debugger.server_url:  # serve_port: the main process serves the run live until the end of the job
        print(f"serving the live run at {debugger.server_url}/debug/training/summary", flush=True)
    faults = {i.step: i for i in options.injections}
    target_parameter = _fault_parameter(accelerator.unwrap_model(unet))
    prediction_type = noise_scheduler.config.prediction_type
    global_step = 0
    progress = TrainingProgress(options.steps, options.progress and accelerator.is_main_process)
    interrupted: KeyboardInterrupt | None = None
    try:
        while global_step < options.steps and not debugger.should_stop:
            for pixels, input_ids in loader:
                fault = faults.get(global_step)
                if fault and fault.kind == "nan-input":
                    pixels = pixels.clone()
                    pixels.view(-1)[0] = math.nan
                with accelerator.accumulate(unet):
                    with torch.no_grad():
                        latents = vae.encode(pixels.to(weight_dtype)).latent_dist.sample() * vae.config.scaling_factor
                        context = text_encoder(input_ids)[0]
                    noise = torch.randn_like(latents)
                    timesteps = torch.randint(
                        0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device
                    )
                    noisy = noise_scheduler.add_noise(latents, noise, timesteps)
                    if prediction_type == "v_prediction":
                        target = noise_scheduler.get_velocity(latents, noise, timesteps)
                    else:
                        target = noise
                    if fault and fault.kind == "loss-spike":
                        target = target * 30.0
                    prediction = unet(noisy, timesteps, context).sample
                    if options.snr_gamma is None:
                        loss = F.mse_loss(prediction.float(), target.float())
                    else:
                        snr = compute_snr(noise_scheduler, timesteps)
                        weights = torch.clamp(snr, max=options.snr_gamma)
                        weights = weights / (snr + 1 if prediction_type == "v_prediction" else snr)
                        per_sample = F.mse_loss(prediction.float(), target.float(), reduction="none").mean(
                            dim=(1, 2, 3)
                        )
                        loss = (per_sample * weights).mean()
                    if fault and fault.kind == "nan-loss-rank1" and accelerator.process_index == 1:
                        loss = loss * math.nan
                    accelerator.backward(loss)
                    if fault and fault.kind == "nan-grad" and accelerator.sync_gradients:
                        target_parameter.grad.view(-1)[0] = math.nan
                    spike = fault is not None and fault.kind == "lr-spike" and accelerator.sync_gradients
                    if fault is not None and fault.kind == "lr-jump" and accelerator.sync_gradients:
                        for group in optimizer.param_groups:  # and it stays
                            group["lr"] = options.learning_rate * 1e4
                    if spike:  # one optimizer step at 1000x the learning rate
                        for group in optimizer.param_groups:
                            group["lr"] = options.learning_rate * 1e3
                    measured = debugger.monitor_training_step(
                        loss,
                        optimizer=optimizer,
                        step=global_step,
                        timesteps=timesteps,
                        inputs={"pixel_values": pixels},
                        max_grad_norm=options.max_grad_norm,
                    )
                    progress.saw(measured)
                    if debugger.should_stop:  # policy stop: decided from every rank's figures, so on every rank
                        break
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(unet.parameters(), options.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad()
                    if spike:
                        for group in optimizer.param_groups:
                            group["lr"] = options.learning_rate
                if accelerator.sync_gradients:
                    if ema is not None:
                        ema.step(unet.parameters())
                    global_step += 1
                    progress.step_done()
                    if global_step >= options.steps:
                        break
    except KeyboardInterrupt as error:  # Ctrl-C: the run so far is saved below, and its place told
        interrupted = error
        raise
    finally:
        progress.close()  # before the summary is printed
        try:
            debugger._steps.judge_last_skip()  # the last step's skip, in the summary saved (close finds it judged)
            summary = debugger.get_summary()
            report = debugger.report()
            if accelerator.is_main_process:
                summary["run_dir"] = str(report.save(html=options.html))
                if interrupted is not None:
                    interrupted.run_dir = summary["run_dir"]  # type: ignore[attr-defined]
                summary["fault_parameter"] = _parameter_name(accelerator.unwrap_model(unet), target_parameter)
                if debugger.should_stop:
                    summary["stopped_by_policy"] = True
                    summary["stop_reason"] = debugger.stop_reason
        finally:
            debugger.close()  # hooks off, anomaly mode restored, event stream closed
        accelerator.wait_for_everyone()
    accelerator.end_training()
    return summary


def _fault_parameter(unet: torch.nn.Module) -> torch.nn.Parameter:
    """A deep trainable weight to plant ``nan-grad`` in (the first ``mid_block`` weight)."""
    named = [(n, p) for n, p in unet.named_parameters() if p.requires_grad]
    for name, parameter in named:
        if name.startswith("mid_block") and name.endswith("weight"):
            return parameter
    return named[0][1]


def _parameter_name(model: torch.nn.Module, parameter: torch.nn.Parameter) -> str:
    return next((n for n, p in model.named_parameters() if p is parameter), "")
