"""Tiny layers with quantized weights, as diffusers' quantizers leave them, offline and on the CPU.

:func:`quantized_stack` makes a ``Sequential`` of two ``Linear(32, 32)`` whose weights are stored as
one of :data:`QUANTIZED_KINDS`: torchao int8 or float8 weight-only (``quantize_``, what diffusers'
``TorchAoConfig`` runs), a GGUF Q8_0 ``GGUFLinear`` (what ``GGUFQuantizationConfig`` loads),
bitsandbytes NF4 and int8 (``Linear4bit``/``Linear8bitLt``, quantized on the CPU: diffusers'
``BitsAndBytesConfig`` asks for a GPU) and optimum-quanto float8 (``QuantoConfig``'s ``quantize`` and
``freeze``). :func:`plant_nan_in_weight` puts a NaN in one layer's stored scales, as a corrupt
checkpoint would: the layer's output is NaN although every input is finite. Each kind needs its
package (:data:`PACKAGES`, the ``quant`` extra).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["PACKAGES", "QUANTIZED_KINDS", "plant_nan_in_weight", "quantized_stack"]

PACKAGES = {
    "torchao_int8": "torchao",
    "torchao_float8": "torchao",
    "gguf_q8_0": "gguf",
    "bnb_nf4": "bitsandbytes",
    "bnb_int8": "bitsandbytes",
    "quanto_float8": "optimum.quanto",
}
"""Each kind's package, for ``pytest.importorskip``."""

QUANTIZED_KINDS = tuple(PACKAGES)


def _gguf_linear(layer: nn.Linear, dtype: torch.dtype) -> nn.Module:
    import gguf
    from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter

    q8 = gguf.GGMLQuantizationType.Q8_0
    data = gguf.quants.quantize(layer.weight.detach().float().numpy(), q8)
    out = GGUFLinear(layer.in_features, layer.out_features, bias=True, compute_dtype=dtype)
    out.weight = GGUFParameter(torch.from_numpy(data), quant_type=q8)
    out.bias = nn.Parameter(layer.bias.detach().to(dtype), requires_grad=False)
    return out


def _bnb_linear(layer: nn.Linear, dtype: torch.dtype, four_bit: bool) -> nn.Module:
    import bitsandbytes as bnb

    weight = layer.weight.detach().float().clone()
    if four_bit:  # (cast to the compute dtype, then quantized, as diffusers' loading does)
        weight = weight.to(dtype)
        out = bnb.nn.Linear4bit(layer.in_features, layer.out_features, compute_dtype=dtype, quant_type="nf4")
        out.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", compress_statistics=False)
    else:
        out = bnb.nn.Linear8bitLt(layer.in_features, layer.out_features, has_fp16_weights=False)
        out.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    out.bias = nn.Parameter(layer.bias.detach().to(dtype), requires_grad=False)
    return out.to("cpu")  # (quantizes it)


def quantized_stack(kind: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> nn.Sequential:
    """Two ``Linear(32, 32)`` with a GELU between, their weights stored as ``kind``, computing in ``dtype``."""
    torch.manual_seed(seed)
    stack = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32)).requires_grad_(False)
    if kind.startswith("torchao"):
        from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

        config = Int8WeightOnlyConfig() if kind == "torchao_int8" else Float8WeightOnlyConfig()
        quantize_(stack.to(dtype), config)
    elif kind == "quanto_float8":
        from optimum.quanto import freeze, qfloat8, quantize

        quantize(stack.to(dtype), weights=qfloat8)
        freeze(stack)
    else:
        for index in (0, 2):
            if kind == "gguf_q8_0":
                stack[index] = _gguf_linear(stack[index], dtype)
            else:
                stack[index] = _bnb_linear(stack[index], dtype, four_bit=kind == "bnb_nf4")
    return stack


def plant_nan_in_weight(layer: nn.Module) -> None:
    """Make the first scale of ``layer``'s quantized weight NaN (its first block or row computes NaN;
    a 4-bit bitsandbytes weight: every scale)."""
    weight = layer.weight
    with torch.no_grad():
        if hasattr(weight, "quant_type") and not hasattr(
            weight, "quant_state"
        ):  # GGUF Q8_0: each block of 34 bytes opens with its fp16 scale
            weight.data.view(-1)[:2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # fp16 NaN, little-endian
        elif getattr(weight, "quant_state", None) is not None:  # bitsandbytes 4-bit: every block's absmax
            # (all of them: bitsandbytes 0.50.2's CPU dequantize_4bit scales every block by the first's)
            weight.quant_state.absmax.fill_(float("nan"))
        elif hasattr(weight, "SCB"):  # bitsandbytes int8: absmax per row, on the layer after its first forward
            (weight.SCB if weight.SCB is not None else layer.state.SCB).view(-1)[0] = float("nan")
        elif hasattr(weight, "_scale"):  # quanto
            weight._scale.view(-1)[0] = float("nan")
        else:  # torchao
            weight.scale.view(-1)[0] = float("nan")
