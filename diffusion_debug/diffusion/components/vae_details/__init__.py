"""What the advice of a VAE anomaly needs to know, read once: whether the pipeline reads
``vae.config.force_upcast`` (:func:`upcast_details`, per pipe) and what the VAE computed in (:func:`vae_details`,
:func:`autocast_details`: the details every kind's VAE advice shares; ``record/advice.py`` writes the text).

The flag upcasts a float16 VAE (and the latents) for the decode only in the pipelines whose call reads it (SDXL's
family, Kolors, AuraFlow, SD upscale; a Modular SDXL pipeline's decode step); Stable Diffusion 1.5's
``StableDiffusionPipeline`` and its kin (img2img, inpaint, ControlNet, AnimateDiff) never do.

>>> from diffusion_debug.testing import tiny_pipeline
>>> reads_force_upcast(tiny_pipeline("sd")), reads_force_upcast(tiny_pipeline("sdxl"))
(False, True)

Decided once per class (kept weakly), from the source of the ``__call__`` it runs: a subclass that keeps its parent's
is its parent's. Not known (None), and advised both ways: a ``ComponentsManager`` (whichever pipeline calls its
components), an override of ``__call__`` over a base whose ``__call__`` reads it (it may defer to
``super().__call__``), a class whose source cannot be read, any error reading it. A read outside ``__call__`` is no
read for the decode, rightly where it is AnimateDiff video2video's (``prepare_latents`` upcasts the VAE for the encode
of the input video and casts it back: the decode runs in float16 whatever the flag). Limit: a Modular pipeline whose
blocks are not under ``sub_blocks`` (an older diffusers') counts as not reading it.

From the same one read (parsed with :mod:`ast`, :func:`call_facts`): whether the latents the call hands
``self.vae.decode`` are cast to the VAE's dtype on every path to it (:func:`cast_details`: where they are,
``pipe.vae.to(torch.float32)`` alone decodes in float32; where not, a float32 VAE raises on float16 latents).

>>> import diffusers
>>> call_facts(diffusers.HunyuanVideoPipeline).casts_latents, call_facts(diffusers.FluxPipeline).casts_latents
(True, False)

A cast dominates a decode where it is made on every path to it: one in a sibling branch (SDXL's ``force_upcast``
branch, whose ``elif`` casts the VAE on Apple MPS alone) does not, nor one undone before it (``.half()``, another
dtype). A cast is a ``.to(...)`` to the VAE's dtype: ``self.vae.dtype`` and any ``self.vae....dtype``
(``next(iter(self.vae.post_quant_conv.parameters())).dtype``), a name bound to one (``vae_dtype = self.vae.dtype``)
or the ``.dtype`` of a value so cast, positional or ``dtype=``, on one line or many; ``.float()`` and
``.to(torch.float32)`` decode in float32 too. A value made from a cast one (arithmetic, a slice, a method or a call
given it: ``latents / latents_std + latents_mean``, ``self._unpack_latents(latents, ...)``) keeps its cast (torch's
type promotion keeps the wider float32). Read lazily: the localizer's details are a :class:`LazyUpcast`, read where a
VAE anomaly's advice is built, never on a clean call. A method of the pipeline the call hands its latents
(``self.decode_latents(latents)``: AnimateDiff's, CogVideoX's) is read where it decodes (two calls deep at most), its
parameters bound to what it is given; where every decode is in one, the user's float32 decode is that method's
(``CallFacts.decoder``). Limits: a loop's body is read twice (its second pass from what the first left); a value kept
in an attribute or a container (``self._latents``) is not followed (not cast); a function made in the call is read
where it is made. The reading itself is :mod:`.call_read`'s, which also says whether the call reaches the VAE's
encode (``CallFacts.input``: a casting call's input image may still reach the float32 VAE in float16).

Not read: a Modular pipeline's decode step (``components.vae.decode(block_state.latents)``): its blocks name the VAE
``components.vae``, and the recipes said where its latents are uncast are a ``DiffusionPipeline``'s
(``output_type="latent"``, ``pipe._unpack_latents``), which a ``ModularPipeline`` has not (it picks its outputs with
``output=``): not known (None).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

from torch import nn

from ..autocast import autocast_on
from ..inventory import watchable_kind
from ..roles import has_check
from .call_read import Flow

#: The scaling factor of SDXL's VAE, the one VAE the fp16-fixed SDXL VAE (madebyollin/sdxl-vae-fp16-fix) replaces:
#: SD 1.5's (0.18215) and SD x4 upscale's (0.08333) are other latent spaces.
SDXL_SCALING = 0.13025


def sdxl_scaling(scaling_factor: Any) -> bool:
    """Whether ``scaling_factor`` (a VAE config's) is SDXL's VAE's :data:`SDXL_SCALING`."""
    return isinstance(scaling_factor, (int, float)) and abs(scaling_factor - SDXL_SCALING) < 1e-6


def upcast_details(pipe: Any) -> dict[str, Any]:
    """``reads_force_upcast`` (True, False or None: not known), ``sdxl_vae`` where its ``vae`` is SDXL's (the
    fp16-fixed VAE is advice for it alone) and, where the flag is not read and the pipeline decodes its (video)
    latents with its own ``decode_latents`` (AnimateDiff, PIA, I2VGen-XL...), ``decode_latents``."""
    reads = reads_force_upcast(pipe)
    try:
        video = reads is False and hasattr(pipe, "video_processor") and callable(getattr(pipe, "decode_latents", 0))
        sdxl = sdxl_scaling(getattr(getattr(getattr(pipe, "vae", None), "config", None), "scaling_factor", None))
    except Exception:  # (a property that raises)
        video = sdxl = False
    return {
        "reads_force_upcast": reads,
        **({"sdxl_vae": True} if sdxl else {}),
        **({"decode_latents": True} if video else {}),
    }


def cast_details(pipe: Any) -> dict[str, Any]:
    """Where ``pipe`` is no Modular pipeline and its call's ``vae.decode`` is read (:func:`call_facts`):
    ``casts_latents`` and, where it hands the VAE its latents uncast and the decode is one an expression says,
    ``latent_decode``: what decodes ``latents`` (``output_type="latent"``'s) in float32, as its call does (its own
    ``decode_latents`` where it decodes there; Flux's unpacked, every one unscaled, shifted where its VAE is), to
    follow ``pipe.vae.to(torch.float32)``; Mochi's de-normalized by its VAE's ``latents_mean`` and ``latents_std``
    as its call does (``CallFacts.denormalized``); none where another call normalizes them so (LTX's: unpacked
    too, to the call's frame count and size, noised for a timestep-conditioned VAE's decode), the latents are packed
    otherwise or unpacked to a size the call does not default to
    ``pipe.default_sample_size * pipe.vae_scale_factor`` (Kontext's, its input image's resized). ``input_image``
    where the call casts them and reaches ``self.vae.encode`` (``CallFacts.input``): its encode of the input image or
    video may not be cast."""
    try:
        if getattr(pipe, "blocks", None) is not None or watchable_kind(pipe) == "manager":
            return {}
        facts = call_facts(type(pipe))
        casts, decoder = facts.casts_latents, facts.decoder
        if casts is not False:
            return {} if casts is None else {"casts_latents": True, **({"input_image": True} if facts.input else {})}
        if decoder is not None:  # (its own decode of the latents, handed them in float32)
            return {"casts_latents": False, "latent_decode": f"pipe.{decoder}(latents.float())"}
        config = pipe.vae.config
        unpack = getattr(pipe, "_unpack_latents", None)
        latents = "latents"
        if unpack is not None:
            if list(inspect.signature(unpack).parameters) != ["latents", "height", "width", "vae_scale_factor"]:
                return {"casts_latents": False}
            if not facts.sized:  # (Kontext's size is its input image's, resized: no expression says it)
                return {"casts_latents": False}
            latents = "pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)"
        if getattr(config, "scaling_factor", None) is None:
            return {"casts_latents": False}
        if getattr(config, "latents_mean", None) is not None:  # (Mochi's call's de-normalization, said)
            if not (facts.denormalized and unpack is None and getattr(config, "latents_std", None) is not None):
                return {"casts_latents": False}
            stat = "torch.tensor(pipe.vae.config.latents_{}, device=latents.device).view(1, -1, 1, 1, 1)"
            z = f"latents.float() * {stat.format('std')} / pipe.vae.config.scaling_factor + {stat.format('mean')}"
            return {"casts_latents": False, "latent_decode": f"pipe.vae.decode({z}).sample"}
        shift = " + pipe.vae.config.shift_factor" if getattr(config, "shift_factor", None) is not None else ""
        unscaled = f"({latents} / pipe.vae.config.scaling_factor{shift}).float()"
        return {"casts_latents": False, "latent_decode": f"pipe.vae.decode({unscaled}).sample"}
    except Exception:  # (a debugger error never escapes into the user's run)
        return {}


class LazyUpcast(Mapping):
    """:func:`upcast_details` and :func:`cast_details` of ``pipe``, read on their first use (a VAE anomaly's advice
    built): a clean call reads no source."""

    def __init__(self, pipe: Any) -> None:
        self._pipe: Any = pipe
        self._read: dict[str, Any] | None = None

    def _details(self) -> dict[str, Any]:
        if self._read is None:
            self._read, self._pipe = {**upcast_details(self._pipe), **cast_details(self._pipe)}, None
        return self._read

    def __getitem__(self, key: str) -> Any:
        return self._details()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._details())

    def __len__(self) -> int:
        return len(self._details())


#: The keys of :func:`cast_details`: a VAE not Stable Diffusion's is told them alone (its advice, ``vae_advice``'s).
CAST_KEYS = ("casts_latents", "latent_decode", "input_image")


def reads_force_upcast(pipe: Any) -> bool | None:
    """Whether ``pipe``'s call reads ``vae.config.force_upcast`` (None: not known); a ``ModularPipeline``'s where
    any of its blocks' does (SDXL's decode step)."""
    try:
        if watchable_kind(pipe) == "manager":
            return None
        blocks = getattr(pipe, "blocks", None)  # (a DiffusionPipeline has none: its config says so)
        if blocks is None or isinstance(blocks, nn.Module):
            return _call_reads_force_upcast(type(pipe))
        found = {_call_reads_force_upcast(cls) for cls in _block_classes(blocks)}
        return True if True in found else None if None in found else False
    except Exception:  # (a debugger error never escapes into the user's construction)
        return None


def _block_classes(block: Any) -> set[type]:
    """The classes of a Modular Diffusers ``block`` and of every block under it (``sub_blocks``)."""
    subs = getattr(block, "sub_blocks", None) or {}
    subs = subs.values() if isinstance(subs, dict) else subs
    return {type(block)}.union(*(_block_classes(sub) for sub in subs))


class CallFacts(NamedTuple):
    """What a pipeline class's ``__call__`` does with its VAE (None: not known)."""

    reads_force_upcast: bool | None
    casts_latents: bool | None
    decoder: str | None = None
    """The method of the pipeline every decode is in where it is not the call (``decode_latents``)."""
    sized: bool = False
    """The call's ``height`` and ``width`` default to ``self.default_sample_size * self.vae_scale_factor`` and are
    not resized from an input image (``_auto_resize``: Kontext's)."""
    input: bool = False
    """The call casts its latents and reaches ``self.vae.encode`` (an input image's or video's), itself or in a
    method it calls (:func:`reaches_encode`; read only where it casts, the one advice that says it)."""
    denormalized: bool = False
    """The call de-normalizes 5-D latents by the VAE config's ``latents_mean`` and ``latents_std`` before its
    decode, as Mochi's does (``latents * latents_std / self.vae.config.scaling_factor + latents_mean``)."""


_READS: weakref.WeakKeyDictionary[type, CallFacts] = weakref.WeakKeyDictionary()


def call_facts(cls: type) -> CallFacts:
    """:class:`CallFacts` of ``cls``, read once (kept weakly) from one read of the source of the ``__call__`` it
    runs, parsed once; the methods that call hands its latents (``decode_latents``) are ``cls``'s own, a subclass's
    overrides read where it has them."""
    if cls not in _READS:
        _READS[cls] = _read_call(cls)
    return _READS[cls]


def _call_reads_force_upcast(cls: type) -> bool | None:
    return call_facts(cls).reads_force_upcast


def _call_source(cls: type) -> tuple[type | None, str | None]:
    """The class whose ``__call__`` ``cls`` runs and that call's source (None: none, a ComponentsManager's; a class
    made in a REPL or by ``exec``, a .pyc alone)."""
    owner = next((base for base in cls.__mro__ if "__call__" in vars(base)), None)
    try:
        return owner, textwrap.dedent(inspect.getsource(owner.__call__))
    except Exception:
        return owner, None


def reaches_encode(cls: type, flow: Flow | None = None) -> bool:
    """Whether the ``__call__`` ``cls`` runs reaches the VAE's encode (:meth:`~.call_read.Flow.encodes`; False:
    not, or not known). :func:`call_facts` reads it only where the call casts its latents (``CallFacts.input``)."""
    try:
        function = ast.parse(_call_source(cls)[1]).body[0]
        return (flow or Flow(cls)).encodes(function, 0)
    except Exception:  # (no source, one that does not parse alone, a method's that raises: not known)
        return False


def _read_call(cls: type) -> CallFacts:
    owner, source = _call_source(cls)
    if owner is None or source is None:
        return CallFacts(None, None)
    reads: bool | None = True
    if "config.force_upcast" not in source:
        above = next((base for base in owner.__mro__[1:] if "__call__" in vars(base)), None)
        reads = False if above is None or _call_reads_force_upcast(above) is False else None
    flow = Flow(cls)
    try:
        function = ast.parse(source).body[0]
        casts = flow.decodes_cast(function) if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        decoder = next(iter(flow.helpers)) if len(flow.helpers) == 1 and not flow.direct else None
    except Exception:  # (a source that does not parse alone: not known)
        casts = decoder = None
    encodes = casts is True and reaches_encode(cls, flow)  # (its own try: an error there leaves casts as read)
    sized = _DEFAULT_SIZE in source and "_auto_resize" not in source
    denormalized = _DENORMALIZED in source and _FIVE_D in source
    return CallFacts(reads, casts, decoder, sized, encodes, denormalized)


_DEFAULT_SIZE = "height = height or self.default_sample_size * self.vae_scale_factor"
_DENORMALIZED = "latents = latents * latents_std / self.vae.config.scaling_factor + latents_mean"
_FIVE_D = ", 1, 1, 1).to(latents.device, latents.dtype)"  # (Mochi's mean and std viewed 5-D: SDXL's are 4-D)


def vae_details(
    role: str, sd_vae: bool, dtype: str | None, autocast: str | None, upcast: dict[str, Any] | None
) -> dict[str, Any]:
    """What the advice of a VAE-role component's anomaly needs: whether it is one, whether it is Stable Diffusion's
    (with ``upcast``: :func:`upcast_details`, said for one), the dtype its weights are in (``vae_dtype``, when
    known) and the ``autocast`` dtype it ran under (``vae_autocast``)."""
    if not has_check(role, "vae"):
        return {"vae_role": False}
    ran = {"vae_autocast": autocast} if autocast else {}
    upcast = upcast or {}  # (an SD VAE's advice is its upcast's, and the cast where no force_upcast is read;
    if sd_vae:  # another's, whether the call casts its latents)
        ran |= {k: v for k, v in upcast.items() if k not in CAST_KEYS}
        if upcast.get("reads_force_upcast") is False and upcast.get("casts_latents"):  # (PixArt-Sigma's)
            ran |= {k: upcast[k] for k in CAST_KEYS if k in upcast}
    else:
        ran |= {k: upcast[k] for k in CAST_KEYS if k in upcast}
    return {"vae_role": True, "sd_vae": sd_vae, **({"vae_dtype": dtype} if dtype else {}), **ran}


def autocast_details(weights_dtype: str | None, dtype: str | None) -> dict[str, str]:
    """``weights_dtype`` where the module's weights are not of the ``dtype`` its output came in while an autocast
    region is open (:func:`~..checks.overflow_risk`); the message then advises about autocast, not the weights'."""
    return {"weights_dtype": weights_dtype} if weights_dtype not in (None, dtype) and autocast_on(dtype) else {}
