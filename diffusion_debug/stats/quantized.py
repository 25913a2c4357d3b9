"""Weights stored quantized, read as the values their layer computes with.

Four kinds reach diffusers users' pipelines and fine-tuning runs, none of which a plain read of the
parameter gets right:

* torchao's (``Int8Tensor``, ``Float8Tensor``, QLoRA's ``NF4Tensor``, ...) and optimum-quanto's
  (``WeightQBytesTensor``, ...) are tensor subclasses whose ``dtype`` is the compute dtype, but which
  implement few ops: torchao's have no ``abs`` or ``isfinite``, so a NaN check of one raises;
* diffusers' GGUF weights (``GGUFParameter``) are bytes (``uint8``), their scales inside the bytes;
* bitsandbytes' ``Params4bit`` are packed bytes (``uint8``, half as many elements as weights) with
  their scales in ``quant_state``, and its ``Int8Params`` are ``int8`` with a row scale ``SCB``.

A NaN in such a weight (a corrupt checkpoint, a NaN scale) is in a float inside, never in ``t`` read
as it is. :func:`dequantized` gives a plain tensor of the values (:func:`parameter_values`: of each
of a module's parameters); :func:`compute_dtype` the dtype its
layer computes in (:func:`computed_views`: GGUF's and bitsandbytes' weights as a memo of module trees
counts dtypes); :func:`weight_numel` the number of weights; :func:`stored_bytes` the bytes held.
A tensor is recognised by what it has (no optional package is imported unless the tensor is one of
its own).

>>> import torch
>>> w = torch.nn.Parameter(torch.ones(2, 3))
>>> is_quantized(w), dequantized(w) is w, compute_dtype(w), weight_numel(w), stored_bytes(w)
(False, True, torch.float32, 6, 24)

Limits: another library's subclass is recognised when it overrides ``Tensor.dequantize`` (as
torchao's and quanto's do); one that does not is read as it is.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)
PLAIN_TYPES = frozenset((*_PLAIN, type(None)))
"""The types of a module's parameters (or None) that are stored as they compute."""


def _gguf(t: torch.Tensor) -> bool:
    return hasattr(t, "quant_type") and not hasattr(t, "quant_state")  # (bitsandbytes' 4-bit has both)


def _gguf_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The weights' shape of a GGUF weight's bytes (the floor, diffusers 0.32.2, keeps no ``quant_shape``)."""
    shape = getattr(t, "quant_shape", None)
    if shape is None:
        from gguf import GGML_QUANT_SIZES

        block, size = GGML_QUANT_SIZES[t.quant_type]
        shape = (*t.shape[:-1], t.shape[-1] // size * block)
    return tuple(shape)


def _bnb_4bit(t: torch.Tensor) -> bool:
    return getattr(t, "quant_state", None) is not None and t.dtype == torch.uint8


def _bnb_8bit(t: torch.Tensor) -> bool:
    return t.dtype == torch.int8 and hasattr(t, "SCB")


def _row_scales(t: torch.Tensor, owner: torch.nn.Module | None) -> torch.Tensor | None:
    """An 8-bit bitsandbytes weight's row scales: on the weight until its layer's first forward,
    then on the layer's ``state``."""
    found = getattr(t, "SCB", None)
    return found if found is not None else getattr(getattr(owner, "state", None), "SCB", None)


def _wrapper(t: torch.Tensor) -> bool:
    return getattr(type(t), "dequantize", torch.Tensor.dequantize) is not torch.Tensor.dequantize


def is_quantized(t: torch.Tensor) -> bool:
    """Whether ``t`` is a quantized weight of one of the kinds above."""
    return type(t) not in _PLAIN and (_gguf(t) or _bnb_4bit(t) or _bnb_8bit(t) or _wrapper(t))


def dequantized(t: torch.Tensor, owner: torch.nn.Module | None = None) -> torch.Tensor:
    """The values a layer (``owner``, the module holding ``t``) computes with from ``t``, as a plain
    floating tensor; ``t`` itself when it is not quantized, or an 8-bit bitsandbytes weight whose
    scales are not found (without its ``owner``, after the layer's first forward)."""
    if type(t) in _PLAIN:
        return t
    with torch.no_grad():
        if _gguf(t):
            from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

            return dequantize_gguf_tensor(t)
        if _bnb_4bit(t):
            from bitsandbytes.functional import dequantize_4bit

            return dequantize_4bit(t.data, t.quant_state)
        if _bnb_8bit(t):
            scales = _row_scales(t, owner)
            return t if scales is None else t.data.float() * (scales.float().unsqueeze(1) / 127)
        if _wrapper(t):  # (torchao's NF4Tensor, of QLoRA runs: its dequantize is a static helper)
            original = getattr(t, "get_original_weight", None)
            return original() if callable(original) else t.dequantize()
    return t


def parameter_values(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``module.named_parameters()``, each quantized weight replaced by :func:`dequantized` values,
    made as each is reached: read each before taking the next, and no more than the one being read
    and the next are held dequantized (a 12B Flux transformer's weights, 7 GB in NF4, are 24 GB
    dequantized in bf16)."""
    named = list(module.named_parameters())
    if all(type(t) in _PLAIN for _, t in named):
        return iter(named)
    owners = parameter_owners(module)
    return ((name, dequantized(t, owners.get(id(t))) if is_quantized(t) else t) for name, t in named)


def parameter_owners(module: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The module holding each parameter of ``module`` (by the parameter's ``id``): the layer whose
    scales or compute dtype a quantized weight's values and dtype depend on."""
    return {id(t): owner for owner in module.modules() for t in owner.parameters(recurse=False)}


def compute_dtype(t: torch.Tensor, owner: torch.nn.Module | None = None) -> torch.dtype | None:
    """The dtype ``owner``'s layer computes in from ``t``, as its outputs have it: a GGUF weight's
    layer's ``compute_dtype``; a 4-bit bitsandbytes weight's own dtype before quantization (diffusers
    casts it to ``torch_dtype`` first: a ``Linear4bit`` returns its input's dtype, whatever its
    ``compute_dtype``, float32 by default, runs its matmul in), its layer's ``compute_dtype`` when that
    is not known; an 8-bit bitsandbytes weight's layer's bias's (it computes in its input's dtype), a
    torchao or quanto weight's ``dtype``; None where none of these is known and for a tensor that is
    not floating."""
    if _bnb_4bit(t):
        found = getattr(t.quant_state, "dtype", None)
        return found if isinstance(found, torch.dtype) else getattr(owner, "compute_dtype", None)
    if _gguf(t):
        found = getattr(owner, "compute_dtype", None)
        return found if isinstance(found, torch.dtype) else None
    if _bnb_8bit(t):
        bias = getattr(owner, "bias", None)
        return bias.dtype if isinstance(bias, torch.Tensor) and bias.is_floating_point() else None
    return t.dtype if t.is_floating_point() else None


def weight_numel(t: torch.Tensor) -> int:
    """The number of weights ``t`` holds (not the bytes a GGUF or 4-bit bitsandbytes weight packs them in)."""
    if _gguf(t):
        return math.prod(_gguf_shape(t))
    if _bnb_4bit(t):
        return math.prod(t.quant_state.shape)
    return t.numel()


def stored_bytes(t: torch.Tensor, owner: torch.nn.Module | None = None) -> int:
    """The bytes ``t`` holds: its inner tensors' for a torchao or quanto weight (whose ``element_size``
    is the compute dtype's), its bytes and scales for a bitsandbytes one."""
    if type(t) in _PLAIN:
        return t.numel() * t.element_size()
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None:  # (quanto's int4 data is a subclass too, packing two weights a byte)
        names = flatten()[0]
        inner = [getattr(t, name, None) for name in names]
        return sum(stored_bytes(x) for x in inner if isinstance(x, torch.Tensor))
    size = t.numel() * t.element_size()
    if _bnb_4bit(t):
        absmax = getattr(t.quant_state, "absmax", None)
        size += absmax.numel() * absmax.element_size() if isinstance(absmax, torch.Tensor) else 0
    elif _bnb_8bit(t) and (scales := _row_scales(t, owner)) is not None:
        size += scales.numel() * scales.element_size()
    return size


class ComputedView:
    """A weight stored in other than the dtype its layer computes in (GGUF's and bitsandbytes' bytes),
    read as a memo of module trees reads a parameter: ``dtype`` (its layer's compute dtype, read when
    asked: it may change), ``is_floating_point()`` and ``numel()`` (its number of weights)."""

    __slots__ = ("tensor", "owner")

    def __init__(self, tensor: torch.Tensor, owner: torch.nn.Module | None):
        self.tensor, self.owner = tensor, owner

    @property
    def dtype(self) -> torch.dtype:
        return compute_dtype(self.tensor, self.owner) or self.tensor.dtype

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def numel(self) -> int:
        return weight_numel(self.tensor)


def computed_views(parameters: list[torch.Tensor | None], modules: list[Any]) -> list[Any]:
    """``parameters`` (the parameters of ``modules``, or None), each one stored in other than its
    compute dtype replaced by its :class:`ComputedView` (torchao's and quanto's are left: their
    ``dtype`` is their compute dtype)."""
    owners = {id(p): module for module in modules if module is not None for p in module._parameters.values()}
    out: list[Any] = []
    for p in parameters:
        if p is not None and is_quantized(p) and p.dtype != compute_dtype(p, owners.get(id(p))):
            p = ComputedView(p, owners.get(id(p)))
        out.append(p)
    return out
