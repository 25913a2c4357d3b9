"""What the installed diffusers offers above the declared floor (``pyproject.toml``), for tests.

A test of a feature the floor stack lacks skips by naming the feature, never a version number: the
same suite runs on the floor (``make floor``) and on the newest stack, where nothing here is missing.
The runtime's own checks live in :mod:`diffusion_debug.installed`; these are the test-side ones.

>>> kind_missing("sd") is None
True
"""

from __future__ import annotations

import importlib.util
import os

import diffusers
import torch

from .pipelines import _BUILDERS

__all__ = [
    "CLIP_TEXT_PREFIX",
    "CPU_RANKS_JOIN_UNASKED",
    "FSDP2_ON_CPU",
    "HALF_REPLICATE_PAD_ON_CPU",
    "HAS_CACHE_HOOKS",
    "HAS_GROUP_OFFLOAD",
    "HAS_LAYERWISE_CASTING",
    "HAS_MODULAR",
    "HAS_REPEATED_BLOCKS",
    "QWEN_TOKENIZER_IN_MEMORY",
    "SAME_NOISE_IN_HALF",
    "SDPA_KEEPS_NAN",
    "clip_name",
    "kind_missing",
]


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


#: ``diffusers.hooks`` with its caching configs (``FirstBlockCacheConfig``; diffusers 0.35).
HAS_CACHE_HOOKS = _has_module("diffusers.hooks") and hasattr(diffusers, "FirstBlockCacheConfig")

#: ``ModelMixin.compile_repeated_blocks`` (regional compilation; diffusers 0.35).
HAS_REPEATED_BLOCKS = hasattr(diffusers.ModelMixin, "compile_repeated_blocks")

#: ``ModelMixin.enable_group_offload`` (diffusers' ModelHook registry on each block; diffusers 0.33).
HAS_GROUP_OFFLOAD = hasattr(diffusers.ModelMixin, "enable_group_offload")

#: ``ModelMixin.enable_layerwise_casting`` (weights stored in fp8, computed in another dtype; diffusers 0.33).
HAS_LAYERWISE_CASTING = hasattr(diffusers.ModelMixin, "enable_layerwise_casting")

#: ``ModelMixin.set_attention_backend`` (diffusers' attention dispatch: native, flex, flash, sage...; diffusers 0.35).
HAS_ATTENTION_BACKENDS = hasattr(diffusers.ModelMixin, "set_attention_backend")

#: Modular pipelines, ``diffusers.modular_pipelines`` (diffusers 0.35).
HAS_MODULAR = _has_module("diffusers.modular_pipelines")


def _qwen_tokenizer_in_memory() -> bool:
    import inspect

    from transformers import Qwen2Tokenizer

    return "vocab" in inspect.signature(Qwen2Tokenizer).parameters


#: Whether ``Qwen2Tokenizer`` takes its vocabulary in memory (transformers 5); before, it reads files.
QWEN_TOKENIZER_IN_MEMORY = _qwen_tokenizer_in_memory()


def _same_noise_in_half() -> bool:
    from diffusers.utils.torch_utils import randn_tensor

    def noise(dtype):
        return randn_tensor((64,), generator=torch.Generator().manual_seed(0), dtype=dtype)

    return all(torch.equal(noise(torch.float32).to(half), noise(half)) for half in (torch.float16, torch.bfloat16))


#: Whether one seed draws the same initial noise in float16 and bfloat16 as in float32 (rounded): torch
#: < 2.6 on a CPU draws half-precision noise another way, so such a pipeline starts from other latents.
SAME_NOISE_IN_HALF = _same_noise_in_half()


def _cpu_ranks_join_unasked() -> bool:
    from unittest import mock

    from accelerate.state import PartialState

    try:  # a private method, asked as a launched rank 0 of 2 would, with ACCELERATE_USE_CPU not set
        with mock.patch.dict(os.environ, {"LOCAL_RANK": "0", "WORLD_SIZE": "2"}):
            return PartialState._prepare_backend(object(), cpu=False)[0] == "gloo" and not torch.cuda.is_available()
    except Exception:
        return False


#: Whether accelerate joins launched CPU processes into one process group though the user did not ask
#: for CPU (ACCELERATE_USE_CPU): accelerate 1.2 does, later ones leave each process to train alone.
CPU_RANKS_JOIN_UNASKED = _cpu_ranks_join_unasked()


def _sdpa_keeps_nan() -> bool:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=generator) for _ in range(3))
    q[..., 0] = float("nan")
    return bool(torch.nn.functional.scaled_dot_product_attention(q, k, v).isnan().any())


#: Whether a NaN in every query makes the CPU attention kernel's output NaN, at the tiny SD's attention
#: shape (64 tokens, 2 heads of 16): torch 2.5's kernel drops it, so the run stays finite.
SDPA_KEEPS_NAN = _sdpa_keeps_nan()


def _fsdp2_on_cpu() -> bool:
    import importlib
    import inspect

    for name in (
        "torch.distributed.fsdp._fully_shard._fsdp_param_group",
        "torch.distributed._composable.fsdp._fsdp_param_group",  # torch 2.5
    ):
        try:
            lazy_init = importlib.import_module(name).FSDPCommContext.lazy_init
        except (ImportError, AttributeError):
            continue
        try:
            return "requires CUDA" not in inspect.getsource(lazy_init)
        except (OSError, TypeError):
            return True
    return False


#: Whether FSDP2 (``fully_shard``) trains on CPU processes (gloo): torch 2.5's asks for CUDA streams.
FSDP2_ON_CPU = _fsdp2_on_cpu()


def _half_replicate_pad_on_cpu() -> bool:
    try:
        torch.nn.functional.pad(torch.zeros(1, 1, 1, 1, 1, dtype=torch.float16), (1,) * 6, mode="replicate")
    except RuntimeError:
        return False
    return True


#: Whether a CPU pads a float16 5-d tensor by replication (Mochi's VAE convs): torch 2.5's has no Half
#: ``replication_pad3d`` kernel, so an fp16 Mochi cannot decode on a CPU there, watched or not.
HALF_REPLICATE_PAD_ON_CPU = _half_replicate_pad_on_cpu()


def _clip_text_prefix() -> str:
    from transformers import CLIPTextModel

    from .text_encoders import clip_text_config

    first = next(name for name, _ in CLIPTextModel(clip_text_config()).named_modules() if name)
    return "text_model." if first == "text_model" else ""


#: Where a CLIP text encoder's modules sit: transformers < 5 nests them in ``text_model``
#: (``text_model.encoder.layers.0``), 5 does not (``encoder.layers.0``).
CLIP_TEXT_PREFIX = _clip_text_prefix()


def clip_name(name: str) -> str:
    """A module or parameter of a ``CLIPTextModel``, named as this transformers names it.

    >>> clip_name("encoder.layers.0.mlp.fc1").endswith("encoder.layers.0.mlp.fc1")
    True
    """
    return CLIP_TEXT_PREFIX + name


def kind_missing(kind: str) -> str | None:
    """Why :func:`~diffusion_debug.testing.tiny_pipeline` cannot build ``kind`` here, or ``None``.

    >>> kind_missing("no such kind")
    "no tiny pipeline kind 'no such kind'"
    """
    if kind not in _BUILDERS:
        return f"no tiny pipeline kind {kind!r}"
    class_name = _BUILDERS[kind][0]
    if not hasattr(diffusers, class_name):
        return f"this diffusers has no {class_name} (tiny kind {kind!r})"
    return None
