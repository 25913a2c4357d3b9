"""The stacks users train with, as diffusers' example scripts run them (train_text_to_image,
train_text_to_image_lora, train_dreambooth_lora, train_controlnet), on the tiny SD UNet: a plain loop
and Accelerate on one CPU process. Each stack is trained twice, with and without the debugger, with
one fault planted at its last step (a NaN in one module's gradient, or a NaN loss): the weights (and
the EMA's) are bitwise the same (and ``save_state``'s checkpoint byte for byte), the steps before the
fault are quiet (no warning or error), no ``debugger_error`` is recorded, and the fault is the first
error, named at its module and step. The validation pipeline's latents (watched by a
``DiffusionModelDebugger`` too) are bitwise the same, and ``save_state``'s pre-hooks that
``save_pretrained`` the UNet and its EMA write the same files.
Steps are the optimizer's (Accelerate's ``accumulate``; a plain loop says ``accumulating=``), the
update measured at a step is the one the optimizer applied since the previous step (against the
weights themselves), and a compiled UNet is not recompiled by the debugger."""

import copy
import functools
import inspect
import math

import diffusers
import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger, TrainingDebugger
from diffusion_debug.record import severity_rank

MODULE = "mid_block.resnets.0.conv1"
LORA_MODULE = "mid_block.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.default"
CONTROLNET_MODULE = "controlnet_down_blocks.1"
NORM = "mid_block.resnets.0.norm1"
"""A module whose parameters are under 128 elements: its applied update is measured exactly."""


@pytest.fixture
def accelerate_state():
    from accelerate.state import AcceleratorState, GradientState

    def reset():
        AcceleratorState._reset_state(True)
        GradientState._reset_state()

    reset()
    yield reset
    reset()


def _batch(unet):
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(2, unet.config.in_channels, 8, 8, generator=generator)
    context = torch.randn(2, 4, unet.config.cross_attention_dim, generator=generator)
    noise = torch.randn(sample.shape, generator=generator)
    return sample, torch.tensor([100, 700]), context, noise


def _lora_unet(unet, dtype):
    """train_text_to_image_lora: the base frozen (in the weight dtype), the adapter trained in float32."""
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig

    unet.requires_grad_(False).to(dtype=dtype)
    torch.manual_seed(0)  # the adapter's gaussian init
    unet.add_adapter(
        LoraConfig(
            r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["to_k", "to_q", "to_v", "to_out.0"]
        )
    )
    cast_training_params(unet, dtype=torch.float32)
    return unet


# diffusers 0.33's enable_gradient_checkpointing takes the checkpoint function; the floor's 0.32 takes none
_TAKES_CHECKPOINT_FUNCTION = (
    "gradient_checkpointing_func" in inspect.signature(diffusers.ModelMixin.enable_gradient_checkpointing).parameters
)


class _Model:
    """What a stack trains: ``module`` (its weights compared), ``watched`` (given to the debugger and
    called), ``loss(step)``, the trained parameters and the module of the planted gradient."""

    def __init__(self, sd, stack):
        unet = copy.deepcopy(sd.unet).train()
        self.planted = stack.get("planted", MODULE)
        if stack.get("lora"):
            unet = _lora_unet(unet, stack.get("weight_dtype", torch.float32))
            self.planted = LORA_MODULE
        if "checkpointing" in stack:
            checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=stack["checkpointing"])
            if _TAKES_CHECKPOINT_FUNCTION:
                unet.enable_gradient_checkpointing(checkpoint)
            elif stack["checkpointing"]:
                pytest.skip("this diffusers' enable_gradient_checkpointing takes no function: never reentrant")
            else:
                unet.enable_gradient_checkpointing()  # (before diffusers 0.33: use_reentrant=False, as asked)
            assert unet.is_gradient_checkpointing
        self.module = unet
        sample, timesteps, context, noise = self.batch = _batch(unet)
        if stack.get("controlnet"):  # train_controlnet: the UNet frozen, the ControlNet trained
            from diffusers import ControlNetModel

            torch.manual_seed(0)
            self.module = ControlNetModel.from_unet(unet).train()
            unet.requires_grad_(False)
            self.cond = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
            self.planted = CONTROLNET_MODULE
        self.unet = unet
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.watched = self.module
        self.stack = stack
        self.norm_weights = []
        self.validations = []

    def loss(self, model):
        sample, timesteps, context, noise = self.batch
        if self.stack.get("controlnet"):
            down, mid = model(sample, timesteps, context, controlnet_cond=self.cond, return_dict=False)
            pred = self.unet(
                sample, timesteps, context, down_block_additional_residuals=down, mid_block_additional_residual=mid
            ).sample
        else:
            pred = model(sample, timesteps, context).sample
        if "loss_dtype" in self.stack:  # a model returning bf16 (prepare converts a prepared model's output to fp32)
            pred = pred.to(self.stack["loss_dtype"])
        if self.stack.get("prior"):  # train_dreambooth: instance loss + prior_loss_weight x prior loss
            instance, prior = pred.chunk(2)
            noise, prior_noise = noise.to(pred.dtype).chunk(2)
            return ((instance - noise) ** 2).mean() + 1.0 * ((prior - prior_noise) ** 2).mean()
        return ((pred - noise.to(pred.dtype)) ** 2).mean()

    def optimizer(self):
        return torch.optim.AdamW(self.params, lr=1e-4, **self.stack.get("adamw", {}))

    def read_norm(self):
        """:data:`NORM`'s weights at a monitored step, when trained: the naive reference of its applied update."""
        params = [p for p in self.module.get_submodule(NORM).parameters() if p.requires_grad]
        if params:
            self.norm_weights.append(torch.cat([p.detach().reshape(-1).double() for p in params]))

    def plant_grad(self):
        parameter = next(p for p in self.module.get_submodule(self.planted).parameters() if p.requires_grad)
        parameter.grad.view(-1)[0] = math.nan


_COMPILED = {}


def _compiled(sd, stack):
    """One UNet compiled for both runs, its weights put back each time (compiling it again is 20 s)."""
    if "model" not in _COMPILED:
        model = _Model(sd, stack)
        model.initial = copy.deepcopy(model.module.state_dict())
        model.watched = torch.compile(model.module, backend="aot_eager")
        _COMPILED["model"] = model
    model = _COMPILED["model"]
    model.module.load_state_dict(model.initial)
    model.norm_weights, model.validations = [], []
    return model


def _debugger(model, watch, accelerator, tmp_path):
    if not watch:
        return None
    return TrainingDebugger(
        model, accelerator=accelerator, config=DebugConfig(output_dir=str(tmp_path), log_level="error")
    )


def _validate(sd, unet, watch, tmp_path):
    """log_validation: a pipeline around the trained UNet, two denoising steps without grad; its
    latents. Watched runs watch it with a DiffusionModelDebugger too, attached for the call only."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline(**{**sd.components, "unet": unet})
    pipe.set_progress_bar_config(disable=True)
    call = functools.partial(pipe, "a cat", num_inference_steps=2, height=32, width=32, output_type="latent")
    generator = torch.Generator().manual_seed(0)
    if not watch:
        with torch.no_grad():
            return call(generator=generator).images
    inference = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path / "validation"), log_level="error"))
    with inference, torch.no_grad():
        latents = call(generator=generator).images
    report = inference.report()
    assert len(report.steps) == 2 and [a for a in report.anomalies if a.kind == "debugger_error"] == []
    return latents


def _plain(sd, stack, watch, fault, tmp_path, reset):
    """A plain PyTorch loop; ``accumulate``: the optimizer steps every N backward calls, each
    monitored (``accumulating=`` on the N-1 that only accumulate)."""
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import EMAModel

    model = _compiled(sd, stack) if stack.get("compile") else _Model(sd, stack)
    optimizer = model.optimizer()
    scheduler = get_scheduler(
        stack.get("scheduler", "constant"), optimizer=optimizer, num_warmup_steps=3, num_training_steps=stack["steps"]
    )
    ema = EMAModel(model.module.parameters(), foreach=True) if stack.get("ema") else None
    watched = model.watched
    tdbg = _debugger(watched, watch, None, tmp_path)
    accumulate, last = stack.get("accumulate", 1), stack["steps"] - 1
    infos, before = [], None
    for call in range(stack["steps"] * accumulate):
        step, syncs = call // accumulate, (call + 1) % accumulate == 0
        loss = model.loss(watched) / accumulate
        if fault == "loss" and step == last and syncs:
            loss = loss * math.nan
        loss.backward()
        if fault == "grad" and step == last and syncs:
            model.plant_grad()
        if tdbg is not None:
            infos.append(tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, accumulating=not syncs))
        if not syncs:
            continue
        model.read_norm()
        if step == last:
            before = _weights(model, ema)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(**stack.get("zero_grad", {}))
        if ema is not None:
            ema.step(model.module.parameters())
            if step % 4 == 3:  # validation with the EMA weights, then back to the trained ones
                ema.store(model.module.parameters())
                ema.copy_to(model.module.parameters())
                model.validations.append(_validate(sd, model.module.eval(), watch, tmp_path))
                model.module.train()
                ema.restore(model.module.parameters())
    return tdbg, before, _weights(model, ema), infos, model.norm_weights


def _accelerate(sd, stack, watch, fault, tmp_path, reset):
    """An Accelerate loop as the example scripts write it: ``accumulate``, ``autocast``, clipping on
    sync steps, the prepared scheduler; ``resume_at``: save_state, weights spoilt, load_state."""
    from accelerate import Accelerator
    from diffusers.optimization import get_scheduler

    reset()
    torch.manual_seed(
        0
    )  # the RNG state save_state writes: the load hook's from_pretrained of the first run drew from it
    gas = stack.get("accumulate", 1)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=gas, mixed_precision=stack.get("mixed", "no"))
    model = _Model(sd, stack)
    optimizer = model.optimizer()
    scheduler = get_scheduler(
        stack.get("scheduler", "constant"),
        optimizer=optimizer,
        num_warmup_steps=3 * gas,
        num_training_steps=stack["steps"] * gas,
    )
    ema = _checkpoint_hooks(accelerator, model) if stack.get("ema") else None
    prepared, optimizer, scheduler = accelerator.prepare(model.module, optimizer, scheduler)
    tdbg = _debugger(prepared, watch, accelerator, tmp_path)
    step, last, infos, before = 0, stack["steps"] - 1, [], None
    while step <= last:
        with accelerator.accumulate(prepared):
            with accelerator.autocast():
                loss = model.loss(prepared)
            assert loss.dim() == 0 and loss.dtype == stack.get("loss_dtype", torch.float32)
            if fault == "loss" and step == last and accelerator.sync_gradients:
                loss = loss * math.nan
            accelerator.backward(loss)
            if fault == "grad" and step == last and accelerator.sync_gradients:
                model.plant_grad()
            if tdbg is not None:
                infos.append(tdbg.monitor_training_step(loss, optimizer=optimizer, step=step))
            if accelerator.sync_gradients:
                model.read_norm()
                accelerator.clip_grad_norm_(model.params, 1.0)
                if step == last:
                    before = _weights(model, None)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            if ema is not None:
                ema.step(prepared.parameters())
            step += 1
            if step == stack.get("freeze_at"):  # a part the script stops training (its gradients None from now)
                model.module.down_blocks.requires_grad_(False)
            if step == stack.get("resume_at"):
                accelerator.save_state(str(tmp_path / f"checkpoint-{watch}"))
                with torch.no_grad():
                    for p in model.params + (ema.shadow_params if ema is not None else []):
                        p.add_(1.0)
                accelerator.load_state(str(tmp_path / f"checkpoint-{watch}"))
    return tdbg, before, _weights(model, ema), infos, model.norm_weights


def _checkpoint_hooks(accelerator, model):
    """train_text_to_image --use_ema: the EMA of the UNet, and save_state's pre-hooks that write the
    UNet and the EMA with ``save_pretrained`` (Accelerate's own weights file left out) and read them back."""
    from diffusers import UNet2DConditionModel
    from diffusers.training_utils import EMAModel

    ema = EMAModel(model.module.parameters(), model_cls=UNet2DConditionModel, model_config=model.module.config)

    def save(models, weights, output_dir):
        ema.save_pretrained(f"{output_dir}/unet_ema")
        for unet in models:
            unet.save_pretrained(f"{output_dir}/unet")
            weights.pop()

    def load(models, input_dir):
        ema.load_state_dict(EMAModel.from_pretrained(f"{input_dir}/unet_ema", UNet2DConditionModel).state_dict())
        while models:
            unet, saved = models.pop(), UNet2DConditionModel.from_pretrained(input_dir, subfolder="unet")
            unet.register_to_config(**saved.config)
            unet.load_state_dict(saved.state_dict())

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
    return ema


def _weights(model, ema):
    out = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    out.update({f"validation.{i}": latents for i, latents in enumerate(model.validations)})
    if ema is not None:
        out.update({f"ema.{i}": p.detach().clone() for i, p in enumerate(ema.shadow_params)})
    return out


def _same(a, b):
    """Bitwise equal, NaN where the other is NaN (the planted fault's last update)."""
    assert a.keys() == b.keys()
    return [
        k
        for k in a
        if not torch.equal(a[k].isnan(), b[k].isnan()) or not torch.equal(a[k].nan_to_num(), b[k].nan_to_num())
    ]


STACKS = {
    # train_text_to_image --use_ema, with a validation pipeline run on the EMA weights every 4 steps
    "plain-ema-validation": (_plain, {"steps": 10, "ema": True}, "grad"),
    "checkpointing-reentrant": (_plain, {"steps": 10, "checkpointing": True}, "grad"),
    "checkpointing-non-reentrant": (_plain, {"steps": 10, "checkpointing": False}, "loss"),
    "plain-accumulate-4": (_plain, {"steps": 5, "accumulate": 4}, "grad"),
    "zero_grad-keep-foreach-cosine": (
        _plain,
        {"steps": 10, "zero_grad": {"set_to_none": False}, "adamw": {"foreach": True}, "scheduler": "cosine"},
        "grad",
    ),
    "fused-adamw": (_plain, {"steps": 10, "adamw": {"fused": True}}, "loss"),
    "compiled": (_plain, {"steps": 2, "compile": True}, "grad"),
    "accelerate-accumulate-4-cosine": (_accelerate, {"steps": 5, "accumulate": 4, "scheduler": "cosine"}, "grad"),
    # train_dreambooth --with_prior_preservation under bf16 autocast: the loss a 0-d bf16 tensor
    "dreambooth-prior-bf16": (
        _accelerate,
        {"steps": 10, "prior": True, "mixed": "bf16", "loss_dtype": torch.bfloat16},
        "loss",
    ),
    "lora-bf16": (_accelerate, {"steps": 10, "lora": True, "mixed": "bf16", "weight_dtype": torch.bfloat16}, "grad"),
    "controlnet": (_accelerate, {"steps": 10, "controlnet": True}, "grad"),
    # down_blocks frozen after step 3 (requires_grad_(False)) while the rest trains on: no dead module
    "freeze-mid-run": (_accelerate, {"steps": 10, "freeze_at": 3}, "grad"),
    # train_text_to_image --use_ema --checkpointing_steps: save_state's pre-hooks save_pretrained the UNet and the EMA
    "save-load-state-ema-hooks": (_accelerate, {"steps": 10, "resume_at": 4, "ema": True}, "grad"),
}


@pytest.mark.parametrize("name", list(STACKS))
def test_a_users_stack_trains_unchanged_stays_quiet_and_names_the_planted_fault(
    name, _tiny_sd, tmp_path, accelerate_state
):
    from torch._dynamo.utils import counters

    loop, stack, fault = STACKS[name]
    _, reference_before, reference, _, _ = loop(_tiny_sd, stack, False, fault, tmp_path, accelerate_state)
    graphs = counters["stats"]["unique_graphs"]
    tdbg, before, after, infos, norms = loop(_tiny_sd, stack, True, fault, tmp_path, accelerate_state)
    tdbg.close()
    assert counters["stats"]["unique_graphs"] == graphs  # compiled: no recompile of ours
    # training unchanged: bitwise before the fault, and NaN where the reference has NaN after it
    assert _same(reference_before, before) == [] and _same(reference, after) == []
    assert all(torch.equal(reference_before[k], before[k]) for k in before)
    if "resume_at" in stack:  # the checkpoint holds nothing of ours: every file as the unwatched run's, byte for byte
        saved = [(tmp_path / f"checkpoint-{watch}") for watch in (False, True)]
        saved = [
            {f.relative_to(root).as_posix(): f.read_bytes() for f in root.rglob("*") if f.is_file()} for root in saved
        ]
        assert saved[0].keys() == saved[1].keys() and len(saved[0]) >= 4
        assert [name for name in saved[0] if saved[0][name] != saved[1][name]] == []
        if stack.get("ema"):  # the UNet and its EMA written by the script's own hooks (its config as without us)
            assert {"unet/config.json", "unet_ema/config.json", "unet/diffusion_pytorch_model.safetensors"} <= set(
                saved[0]
            )
    anomalies = tdbg.report().anomalies
    assert [a for a in anomalies if a.kind == "debugger_error"] == []
    last = stack["steps"] - 1
    serious = [a for a in anomalies if severity_rank(a.severity) >= severity_rank("warning")]
    assert [(a.kind, a.step) for a in serious if a.step != last] == []  # the steps before the fault: quiet
    first = serious[0]
    if fault == "grad":
        planted = LORA_MODULE if stack.get("lora") else CONTROLNET_MODULE if stack.get("controlnet") else MODULE
        assert (first.kind, first.module, first.step, first.severity) == ("nonfinite", planted, last, "error")
    else:
        assert (first.kind, first.module, first.step, first.severity) == ("nonfinite_loss", "", last, "error")
    # steps are the optimizer's: the calls that only accumulated are micro-steps
    summary = tdbg.get_summary()
    accumulate = stack.get("accumulate", 1)
    assert (summary["total_steps"], summary["accumulating_micro_steps"]) == (
        stack["steps"],
        stack["steps"] * (accumulate - 1),
    )
    assert [i["gradients_read"] for i in infos] == ([False] * (accumulate - 1) + [True]) * stack["steps"]
    # the update measured is the optimizer step's, from one optimizer step to the next (naive: the weights)
    steps = [i for i in infos if i["gradients_read"]]
    assert [i["micro_steps"] for i in steps] == [accumulate] * stack["steps"]  # every call's loss joined its step
    expected = [
        (torch.linalg.vector_norm(b - a) / torch.linalg.vector_norm(a)).item() for a, b in zip(norms, norms[1:])
    ]
    measured = [i["applied_update_ratio"][NORM] for i in steps[1:]] if norms else []
    assert measured == pytest.approx(expected, rel=1e-6, abs=1e-12)
    if stack.get("scheduler") == "cosine":  # the warmup's lr 0 at step 0 moved nothing, and was no finding
        assert expected[0] == 0 and all(e > 0 for e in expected[1:])
    assert len(norms) in (0, stack["steps"]) and (len(norms) > 0) == (not stack.get("lora"))
