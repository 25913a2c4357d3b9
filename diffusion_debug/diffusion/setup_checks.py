"""The checks of a pipeline's set-up: what is wrong before a step runs (a prompt longer than its
tokenizer keeps, a scheduler configuration that cannot work, component dtypes that do not fit
together). Like :mod:`.checks` they measure nothing: each returns anomalies (possibly empty).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Iterable

from torch import nn

from ..probes.tracing import compile_wrapper, compiled_in_place
from ..record import Anomaly, make_anomaly
from .checks import HALF_DTYPES
from .components.compiled import HALF_METHODS, ORIG, called_through_halves
from .components.inventory import Component, find_components
from .components.roles import has_check
from .components.vae_details import sdxl_scaling, upcast_details

# -- prompts ----------------------------------------------------------------------------------


def count_dropped_tokens(tokenizer: Any, text: str, max_length: int) -> tuple[int, str]:
    """Tokens of ``text`` beyond ``max_length`` (special tokens included, as the pipeline pads
    and truncates them) and the text they spell. A text too short to fill ``max_length`` is not
    tokenized (:func:`fits_for_sure`): the check runs on every call.

    >>> from diffusion_debug.testing.text_encoders import clip_tokenizer
    >>> count_dropped_tokens(clip_tokenizer(), "a cat " * 20, 16)
    (26, 'a cat a cat a cat a cat a cat a cat a cat a cat a cat a cat a cat a cat a cat')
    """
    if fits_for_sure(tokenizer, text, max_length):
        return 0, ""
    ids = tokenizer(text, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
    if len(ids) <= max_length:
        return 0, ""
    eos = getattr(tokenizer, "eos_token_id", None)
    tail = 1 if eos is not None and ids and ids[-1] == eos else 0
    dropped = ids[max_length - tail : len(ids) - tail]
    return len(dropped), tokenizer.decode(dropped, skip_special_tokens=True).strip()


def fits_for_sure(tokenizer: Any, text: str, max_length: int) -> bool:
    """Whether ``text`` cannot make more than ``max_length`` tokens, without tokenizing it: each
    token of a BPE, WordPiece or SentencePiece tokenizer spells at least one byte of the text,
    but for a word-start marker (SentencePiece's ``▁``, at most one per byte), so two tokens per
    UTF-8 byte plus the special tokens the tokenizer adds bound any of them.

    >>> from diffusion_debug.testing.text_encoders import clip_tokenizer
    >>> fits_for_sure(clip_tokenizer(), "a photo of a cat", 77), fits_for_sure(clip_tokenizer(), "a cat " * 20, 77)
    (True, False)
    """
    known = _SPECIAL_TOKENS.get(id(tokenizer))  # (no Python call when known: asked at every watched call)
    if known is not None and known[0]() is tokenizer:
        special = known[1]
    else:
        try:
            special = int(tokenizer.num_special_tokens_to_add())
        except Exception:  # not a transformers tokenizer: tokenize to know
            return False
        try:
            ref = weakref.ref(tokenizer, functools.partial(_forget_tokenizer, id(tokenizer)))
        except TypeError:  # not weakly referable: asked each time
            ref = None
        if ref is not None:
            _SPECIAL_TOKENS[id(tokenizer)] = (ref, special)
    return 2 * len(text.encode("utf-8")) + special <= max_length


_SPECIAL_TOKENS: dict[int, tuple[weakref.ref, int]] = {}
"""Per tokenizer (by id, while it lives): the special tokens it adds, asked once. A slow
tokenizer (transformers 4's ``CLIPTokenizer``, which SD checkpoints load) counts them by building
an input (23 Python calls at every watched call, where a fast one makes one). Limit: special
tokens changed on a tokenizer after its first watched call (``add_bos_token``) keep the count
first read (a prompt the bound calls short by the old count is then not tokenized; the bound
allows two tokens a byte, so such a prompt is truncated only if it is near that)."""


def _forget_tokenizer(key: int, ref: weakref.ref, known: dict = _SPECIAL_TOKENS) -> None:
    entry = known.get(key)  # no global looked up: this may run as the interpreter shuts down
    if entry is not None and entry[0] is ref:
        del known[key]


def prompt_truncated(
    component: str,
    tokenizer_name: str,
    role: str,
    index: int,
    dropped: int,
    dropped_text: str,
    max_length: int,
) -> list[Anomaly]:
    if dropped <= 0:
        return []
    return [
        make_anomaly(
            kind="prompt_truncated",
            severity="warning",
            component=component,
            details={
                "tokenizer": tokenizer_name,
                "prompt_role": role,
                "prompt_index": index,
                "dropped_tokens": dropped,
                "dropped_text": dropped_text,
                "max_length": max_length,
            },
        )
    ]


# -- configuration ------------------------------------------------------------------------------


def truncated_prompts(texts: Iterable[Any]) -> list[tuple[Anomaly, tuple]]:
    """``prompt_truncated`` (with its fold key) for each prompt text (a ``PromptText``: encoder,
    tokenizer_name, tokenizer, role, index, text, max_length) longer than its tokenizer keeps."""
    found = []
    for p in texts:
        dropped, dropped_text = count_dropped_tokens(p.tokenizer, p.text, p.max_length)
        for anomaly in prompt_truncated(
            p.encoder, p.tokenizer_name, p.role, p.index, dropped, dropped_text, p.max_length
        ):
            found.append((anomaly, ("prompt_truncated", p.tokenizer_name, p.role, p.index)))
    return found


SIGMA_SCHEDULE_KEYS = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas")
CONTINUOUS_CLASSES = ("EDM", "FlowMatch", "CMStochastic", "ScoreSdeVe", "CogVideoX")


def continuous_schedule(scheduler: Any, config: Any = None) -> bool:
    """Whether the scheduler's steps come from a sigma schedule or continuous time (Karras,
    exponential or beta sigmas, ``timestep_type="continuous"``, EDM, flow matching), where
    ``timestep_spacing`` and ``steps_offset`` do not pick the timesteps. ``config``: the
    scheduler's, where the caller has read it (``scheduler.config`` is a property: a call)."""
    if config is None:
        config = getattr(scheduler, "config", {}) or {}
    # loops, not generators: asked at every set_timesteps of a watched call (a frame a key)
    for key in SIGMA_SCHEDULE_KEYS:
        if config.get(key):
            return True
    if config.get("timestep_type") == "continuous":
        return True
    name = type(scheduler).__name__
    for part in CONTINUOUS_CLASSES:
        if part in name:
            return True
    return "sigma_schedule" in config


# pipeline class name part -> the model family whose training a scheduler rule is known for
TRAINED_FAMILIES = (
    ("StableDiffusion", "Stable Diffusion"),
    ("StableUnCLIP", "Stable Diffusion"),
    ("LatentConsistencyModel", "Stable Diffusion"),
    ("AnimateDiff", "Stable Diffusion"),
)


def trained_family(pipe: Any) -> str | None:
    """The model family a pipeline belongs to, where a scheduler rule knows how it was trained
    (None: unknown, and advice names no family)."""
    name = type(pipe).__name__
    if "StableDiffusion3" in name:
        return None
    for part, family in TRAINED_FAMILIES:  # (a loop, not a generator: once a call)
        if part in name:
            return family
    return None


def schedule_end(scheduler: Any) -> Any:
    """The last timestep of the schedule ``set_timesteps`` made, where the ``steps_offset`` rule
    could fire (a discrete, ``leading`` schedule with ``steps_offset=0``); None elsewhere, so other
    schedules pay no host read. What runs decides: ``LCMScheduler`` ignores ``steps_offset`` and
    ends at t=499 of 2 steps, DDIM ends at t=0. A 0-d tensor, unread (read with the run's first
    step, ``step_values.Schedule``: on the pipeline's device a read here would be a sync)."""
    config = getattr(scheduler, "config", {}) or {}
    leading_from_zero = config.get("timestep_spacing") == "leading" and config.get("steps_offset") == 0
    if not leading_from_zero or continuous_schedule(scheduler, config):
        return None
    timesteps = getattr(scheduler, "timesteps", None)
    return timesteps[-1] if timesteps is not None and len(timesteps) else None


def scheduler_config(
    scheduler: Any,
    *,
    num_inference_steps: int | None = None,
    first_timestep: float | None = None,
    last_timestep: float | None = None,
    family: str | None = None,
) -> list[Anomaly]:
    """A few settings known to spoil images, with the setting to change. The spacing rules hold
    for discrete schedules only (see :func:`continuous_schedule`): a Karras-sigma or
    continuous-time scheduler starts at its largest sigma whatever ``timestep_spacing`` says.
    ``first_timestep``: the first timestep that runs (an img2img schedule cut by ``strength``
    starts partly denoised on purpose: the caller leaves it out); ``last_timestep``: the last one
    (see :func:`schedule_end`; the ``steps_offset`` rule is judged on it alone, as a scheduler
    may ignore the setting); ``family``: the model family (see :func:`trained_family`): the
    ``steps_offset`` rule fires for a known family only, as other models (DeepFloyd IF's own
    scheduler) ship ``leading`` spacing with ``steps_offset=0`` and their stock runs stay quiet."""
    config = getattr(scheduler, "config", {}) or {}
    discrete = not continuous_schedule(scheduler, config)
    name = type(scheduler).__name__
    out = []

    def add(rule: str, **details: Any) -> None:  # the kind's builder words each rule
        out.append(
            make_anomaly(
                kind="scheduler_config",
                severity="warning",
                details={"rule": rule, "scheduler": name, **details},
            )
        )

    zero_snr = bool(config.get("rescale_betas_zero_snr", False))
    prediction = config.get("prediction_type")
    spacing = config.get("timestep_spacing")
    if zero_snr and prediction == "epsilon":
        add("zero_snr_epsilon", prediction_type=prediction)
    if zero_snr and spacing not in (None, "trailing"):
        add("zero_snr_spacing", timestep_spacing=spacing)
    if family and discrete and spacing == "leading" and config.get("steps_offset") == 0 and last_timestep == 0:
        add("steps_offset", steps_offset=0, family=family)
    train = config.get("num_train_timesteps")
    if (
        discrete
        and num_inference_steps
        and first_timestep is not None
        and train
        and spacing == "leading"
        and first_timestep < 0.9 * (train - 1)
    ):
        add(
            "leading_spacing_few_steps",
            num_inference_steps=num_inference_steps,
            first_timestep=first_timestep,
            num_train_timesteps=train,
        )
    return out


def static_checks(
    pipe: Any, dtypes: dict[str, str | None], components: list[Component] | None = None
) -> list[tuple[Anomaly, tuple | None]]:
    """``(anomaly, fold key)`` for the scheduler and dtype settings (once per attach); ``None``: the kind's.
    ``components``: the pipeline's, when the caller has them (finding them inspects the pipeline)."""
    scheduler = getattr(pipe, "scheduler", None)
    found = [
        (a, ("scheduler_config", a.details.get("rule")))
        for a in scheduler_config(scheduler, family=trained_family(pipe))
    ]
    denoiser = next(iter(dtypes), "")  # the denoiser comes first
    for c in components or ():  # a component compiled whole: a dict look-up each, asked further only then
        state = c.module.__dict__
        if state["_modules"].get(ORIG) is not None or state.get("_compiled_call_impl") is not None:
            found += [(a, None) for a in compile_bypassed(c)]
    return found + [(a, None) for a in dtype_mismatch(pipe, dtypes, denoiser, components)]


def compile_bypassed(component: Component) -> list[Anomaly]:
    """``compile_bypassed`` for a VAE compiled whole (``pipe.vae = torch.compile(pipe.vae)`` or
    ``vae.compile()``): that compiles its ``forward``, which a pipeline never calls (it calls
    ``vae.decode``, which runs uncompiled: :func:`~.components.compiled.compile_state`). Quiet where
    a method of it or a part is compiled (``vae.decode = torch.compile(vae.decode)``,
    ``vae.decoder.compile()``). Limit: a VAE only (a module the pipeline calls through ``decode`` /
    ``encode``); a denoiser compiled whole is called through its ``forward``."""
    module = component.module
    wrapper = compile_wrapper(module)
    original = module._orig_mod if wrapper else module
    if not called_through_halves(original):
        return []
    for owner in (module, original):  # a method compiled on the VAE or its wrapper (under our call site's patch)
        for name in HALF_METHODS.values():
            value = owner.__dict__.get(name)
            while (patch := getattr(value, "__diffusion_debug_patch__", None)) is not None:
                value = patch.previous
            if getattr(value, "_torchdynamo_orig_callable", None) is not None:
                return []
    for sub in original.modules():
        if sub is not original and (compiled_in_place(sub) or compile_wrapper(sub)):
            return []
    half = next(h for h, method in HALF_METHODS.items() if isinstance(original._modules.get(h), nn.Module))
    details = {"compiled": "wrapper" if wrapper else "in_place", "method": HALF_METHODS[half], "half": half}
    return [make_anomaly(kind="compile_bypassed", severity="warning", component=component.name, details=details)]


class StaticChecks:
    """:func:`static_checks` at every attach of one debugger, memoised on what they read: a reused
    debugger's next attach, with the same pipeline class, scheduler and scheduler config, VAE and
    VAE config (each the same object: a diffusers config is a frozen dict, replaced when it is
    changed), the VAE's in-place compile and the same component dtypes, after a pass that found
    nothing, finds nothing again and is skipped (some twenty Python calls an attach). A pass that
    found something runs again (what the sink keeps of it is the sink's), and so does any pass
    where a config read is not a diffusers one (a plain dict can change in place unseen)."""

    def __init__(self, pipe: Any, components: list[Component]):
        self.pipe, self.components = pipe, components
        self.vae = vae_component(components)[1]
        self.quiet: tuple | None = None
        """What the last pass read, when it found nothing."""

    def findings(self, dtypes: dict[str, str | None]) -> list[tuple[Anomaly, tuple | None]]:
        scheduler, vae = getattr(self.pipe, "scheduler", None), self.vae
        configs = (
            getattr(scheduler, "_internal_dict", None),
            () if vae is None else getattr(vae, "_internal_dict", None),
        )
        compiled = None if vae is None else vae.__dict__.get("_compiled_call_impl")  # vae.compile() since
        read = (
            None if None in configs else (type(self.pipe), scheduler, vae, compiled, *configs, tuple(dtypes.items()))
        )
        if read is not None and read == self.quiet:
            return []
        found = static_checks(self.pipe, dtypes, self.components)
        self.quiet = None if found else read
        return found


def vae_component(components: list[Component]) -> tuple[str, Any]:
    """The VAE-role component's name and module, whatever the pipeline calls it (Kandinsky's is
    ``movq``); ``("", None)`` without one."""
    return next(((c.name, c.module) for c in components if has_check(c.role, "vae")), ("", None))


def dtype_mismatch(
    pipe: Any, dtypes: dict[str, str | None], denoiser: str, components: list[Component] | None = None
) -> list[Anomaly]:
    """Component dtypes that are known to bite."""
    out = []
    vae_name, vae = vae_component(find_components(pipe) if components is None else components)
    vae_config = getattr(vae, "config", {}) or {}
    is_sdxl_vae = (
        sdxl_scaling(vae_config.get("scaling_factor")) or hasattr(pipe, "upcast_vae") and "XL" in type(pipe).__name__
    )
    if dtypes.get(vae_name) == "float16" and is_sdxl_vae and not vae_config.get("force_upcast", False):
        out.append(
            make_anomaly(
                kind="dtype_mismatch",
                severity="warning",
                component=vae_name,
                details={"vae_dtype": "float16", "force_upcast": False, **upcast_details(pipe)},
            )
        )
    halves = {name: d for name, d in dtypes.items() if d in HALF_DTYPES}
    if len(set(halves.values())) > 1:
        out.append(
            make_anomaly(
                kind="dtype_mismatch",
                severity="warning",
                component=denoiser,
                details={"dtypes": dtypes, "half_dtypes": halves},
            )
        )
    return out
