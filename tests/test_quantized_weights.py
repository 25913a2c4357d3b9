"""Weights stored quantized (torchao int8/float8, GGUF Q8_0, bitsandbytes NF4/int8, quanto float8),
as diffusers' quantizers leave them: every place that reads a model's weights reads the values the
layer computes with. A NaN planted in one layer's stored scales is named at that layer (by ``why``,
by ``launch``'s frozen-model check, by ``analyze_model``), nothing raises on a subclass that has no
``isfinite`` (torchao's), and a component is described in its compute dtype, with its number of
weights and the bytes it holds. Each kind skips without its package (the ``quant`` extra)."""

from __future__ import annotations

import weakref

import pytest
import torch

from diffusion_debug import analyze_model
from diffusion_debug.diffusion.components.inventory import describe_module
from diffusion_debug.diffusion.replay.factors import OriginCall
from diffusion_debug.diffusion.replay.why import explain
from diffusion_debug.jobs.launch_inputs import first_nonfinite_weight
from diffusion_debug.testing.quantized import PACKAGES, QUANTIZED_KINDS, plant_nan_in_weight, quantized_stack

NAN_WEIGHTS = {"bnb_nf4": 1024}
"""The weights :func:`plant_nan_in_weight` makes NaN: a row of 32 (a GGUF block, a per-row scale); all
of an NF4 weight."""

STORED_BYTES = {
    "torchao_int8": 2 * (1024 + 32 * 4 + 32),  # int8 data, float32 scale and int8 zero point per row
    "torchao_float8": 2 * (1024 + 32 * 4),
    "gguf_q8_0": 2 * 32 * 34,  # a Q8_0 block: an fp16 scale and 32 int8
    "bnb_nf4": 2 * (512 + 16 * 4),  # two weights a byte, a float32 absmax a block of 64
    "bnb_int8": 2 * (1024 + 32 * 4),
    "quanto_float8": 2 * (1024 + 32 * 2 + 2 * 2),  # a bfloat16 scale per row; its layer's input and output scales
}
"""The two quantized weights' bytes, by hand (the biases, 2 x 32 bfloat16, are added in the test)."""


@pytest.fixture(params=QUANTIZED_KINDS)
def kind(request):
    pytest.importorskip(PACKAGES[request.param])
    return request.param


def _stack(kind):
    stack = quantized_stack(kind)
    stack(torch.ones(1, 32, dtype=torch.bfloat16))  # (bitsandbytes int8 moves its scales to the layer here)
    return stack


def test_why_names_the_quantized_layer_whose_scales_hold_nan(kind):
    stack = _stack(kind)
    plant_nan_in_weight(stack[2])
    result = explain(OriginCall("transformer", stack, "", (torch.ones(2, 32, dtype=torch.bfloat16),), {}))
    stored = type(stack[2].weight).__name__
    assert result.baseline.finite is False and result.weights == "2" and result.fix is None
    assert result.verdict == (
        f"no setting fixes it: the weights of transformer 2 hold NaN/Inf (stored quantized, as {stored}: "
        "check the checkpoint or the quantization that made them)"
    )


def test_launch_names_the_nan_weight_of_a_frozen_quantized_model(kind):
    stack = _stack(kind)
    assert first_nonfinite_weight(weakref.ref(stack)) is None
    plant_nan_in_weight(stack[2])
    assert first_nonfinite_weight(weakref.ref(stack)) == ("2.weight", NAN_WEIGHTS.get(kind, 32))


def test_analyze_model_reads_quantized_weights_as_their_values(kind):
    stack = _stack(kind)
    analysis = analyze_model(stack)
    reference = stack[2](torch.eye(32, dtype=torch.bfloat16)) - stack[2].bias  # row i: the weights' column i
    assert analysis.nonfinite == []
    assert analysis.parameters["2.weight"].weight.numel == 1024
    assert analysis.parameters["2.weight"].weight.absmax == pytest.approx(reference.abs().max().item(), rel=1e-2)
    plant_nan_in_weight(stack[2])
    assert analyze_model(stack).nonfinite == ["2.weight"]


def test_a_quantized_component_is_described_in_its_compute_dtype(kind):
    described = describe_module(_stack(kind))
    assert (described["dtype"], described["dtypes"], described["parameters"]) == ("bfloat16", {"bfloat16": 2112}, 2112)
    assert described["bytes"] == STORED_BYTES[kind] + 2 * 32 * 2
    assert described["quantized"] == {type(quantized_stack(kind)[2].weight).__name__: 2048}


@pytest.mark.parametrize("kind", ["gguf_q8_0", "quanto_float8"])
def test_why_says_a_dtype_row_failed_because_quantized_weights_cannot_be_copied(kind):
    """GGUF's and quanto's weights refuse ``copy.deepcopy`` (upstream: a GGUFParameter rebuilt without its
    quant_type, quanto's wrapper subclass without clone), which the dtype rows replay a copy of."""
    pytest.importorskip(PACKAGES[kind])
    stack = _stack(kind)
    plant_nan_in_weight(stack[2])
    result = explain(OriginCall("transformer", stack, "", (torch.ones(2, 32, dtype=torch.bfloat16),), {}))
    row = next(r for r in result.replays if r.factor == "float32")
    stored = type(stack[2].weight).__name__
    assert row.finite is None and row.error.startswith(
        f"RuntimeError: its quantized weights ({stored}) cannot be copied to replay it: "
    )


def test_analyze_tensor_measures_a_quantized_weight_dequantized(kind):
    from diffusion_debug import analyze_tensor

    stack = quantized_stack(kind)  # (no forward yet: an 8-bit bitsandbytes weight holds its scales)
    analysis = analyze_tensor(stack[2].weight, "w")
    reference = stack[2](torch.eye(32, dtype=torch.bfloat16)) - stack[2].bias
    stored = type(stack[2].weight).__name__
    assert repr(analysis).startswith(f"w: tensor[32, 32] {analysis.dtype} cpu ({stored}, dequantized) min=")
    assert analysis.max - analysis.min > 0 and analysis.nan == 0
    assert max(-analysis.min, analysis.max) == pytest.approx(reference.abs().max().item(), rel=1e-2)
    plant_nan_in_weight(stack[2])
    after = analyze_tensor(stack[2].weight)
    if kind == "bnb_int8":  # its scales are on its layer since the forward: read as stored
        assert after.quantized == "Int8Params, as stored" and after.nan == 0
    else:
        assert after.nan == NAN_WEIGHTS.get(kind, 32)


@pytest.mark.parametrize("kind", QUANTIZED_KINDS)
def test_the_dtype_a_quantized_component_runs_in_counts_its_quantized_weights(kind):
    """A GGUF Wan in fp16 keeps its norms and scale-shift table in float32 (``_keep_in_fp32_modules``):
    its floating parameters, its quantized weights left out, were mostly float32, so its fp16 sentinel
    was never placed and an fp16 overflow in it went unwarned. Here: fp16 layers beside a float32 norm
    larger than their biases."""
    from diffusion_debug.diffusion.components.inventory import module_dtype
    from diffusion_debug.diffusion.components.structure import TreeMemo

    pytest.importorskip(PACKAGES[kind])
    component = torch.nn.Sequential(quantized_stack(kind, torch.float16), torch.nn.LayerNorm(96))
    memo = TreeMemo()
    memo.refresh([component])
    assert (memo.dtype(component), module_dtype(component)) == (torch.float16, torch.float16)
    if kind != "quanto_float8":  # (quanto's weights refuse a dtype change)
        component.to(torch.bfloat16)  # in place: read at every attach
        assert memo.dtype(component) == module_dtype(component)


def test_an_fp16_overflow_in_a_gguf_wan_is_warned_of_at_its_module_and_step(tmp_path):
    """The tiny Wan 2.2 with both experts loaded from a GGUF file (Q8_0, computing in fp16) as users
    load them (``from_single_file``): its norms and scale-shift table stay float32, the unquantized rest
    is fp16. An output at 61% of fp16's largest value from the first expert's step 0 (its second call,
    the unconditional pass) is warned of there, as on the unquantized fp16 Wan."""
    gguf = pytest.importorskip("gguf")
    from diffusion_debug.testing.features import kind_missing

    if missing := kind_missing("wan22"):
        pytest.skip(missing)
    from diffusers import GGUFQuantizationConfig, WanTransformer3DModel

    from diffusion_debug import DebugConfig, DiffusionModelDebugger
    from diffusion_debug.testing import plant_overflow, tiny_pipeline
    from diffusion_debug.testing.zoo_video_audio import WAN22_CALL, WAN_TRANSFORMER

    torch.manual_seed(0)
    plain = WanTransformer3DModel(**dict(WAN_TRANSFORMER, attention_head_dim=16, ffn_dim=64))  # widths of 32: Q8_0
    plain.save_pretrained(tmp_path / "transformer")
    writer = gguf.GGUFWriter(str(tmp_path / "wan.gguf"), arch="wan")
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, tensor in plain.state_dict().items():
        values = tensor.float().numpy()
        if values.ndim == 2 and values.shape[-1] % 32 == 0:
            writer.add_tensor(name, gguf.quants.quantize(values, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    pipe = tiny_pipeline("wan22", dtype=torch.float16)
    config = GGUFQuantizationConfig(compute_dtype=torch.float16)
    for expert in ("transformer", "transformer_2"):
        loaded = WanTransformer3DModel.from_single_file(
            str(tmp_path / "wan.gguf"),
            config=str(tmp_path),
            subfolder="transformer",
            quantization_config=config,
            torch_dtype=torch.float16,
        )
        setattr(pipe, expert, loaded)
    assert {p.dtype for p in pipe.transformer.parameters()} == {torch.uint8, torch.float16, torch.float32}
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=tmp_path, log_level="error"))
    with plant_overflow(pipe.transformer.proj_out, fraction=0.61, from_call=1), dbg:
        pipe(**WAN22_CALL(), num_inference_steps=2, generator=torch.Generator().manual_seed(0))
    first = dbg.report().anomalies[0]
    assert (first.kind, first.component, first.module, first.step) == ("overflow_risk", "transformer", "proj_out", 0)
    assert first.details["dtype_max_fraction"] == pytest.approx(0.61, abs=1e-3)


def test_quantized_weights_are_read_dequantized_one_or_two_at_a_time(kind, monkeypatch):
    """A 12B Flux transformer in NF4 holds about 7 GB, its weights dequantized in bf16 24 GB:
    analyze_model and launch's frozen-model check held every weight dequantized until the last was
    read (here 6 at once), where one at a time (two while the next is made) is what the reads need."""
    from diffusion_debug.stats import quantized

    alive, peak = [0], [0]
    real = quantized.dequantized

    def dropped():
        alive[0] -= 1

    def counted_once(t, owner=None):
        out = real(t, owner)
        if out is not t:
            alive[0] += 1
            peak[0] = max(peak[0], alive[0])
            weakref.finalize(out, dropped)
        return out

    monkeypatch.setattr(quantized, "dequantized", counted_once)
    model = torch.nn.Sequential(*(_stack(kind) for _ in range(3)))  # 6 quantized weights
    plant_nan_in_weight(model[2][2])
    assert analyze_model(model).nonfinite == ["2.2.weight"] and peak[0] <= 2, peak
    peak[0] = 0
    assert first_nonfinite_weight(weakref.ref(model)) == ("2.2.weight", NAN_WEIGHTS.get(kind, 32))
    assert peak[0] <= 2, peak


def test_an_unquantized_model_is_described_without_a_python_call_a_parameter():
    """A report describes every component (``report()``, ``get_summary()``): the quantized path's
    owner map and four calls a parameter doubled it on an unquantized pipeline (SD1.5's topology at
    tiny widths: 26546 -> 56380 calls, 13 -> 25 ms). 25 blocks of a Linear and a LayerNorm: 100
    parameters, 76 modules; 1327 calls as before the quantized path, 3386 with it."""
    import sys

    model = torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2)) for _ in range(25))
    )
    calls = [0]

    def profile(frame, event, arg):
        calls[0] += event == "call"

    sys.setprofile(profile)
    try:
        described = describe_module(model)
    finally:
        sys.setprofile(None)
    assert (described["parameters"], described["bytes"], described["dtypes"], described["quantized"]) == (
        250,
        1000,
        {"float32": 250},
        {},
    )
    assert calls[0] < 1500, calls


@pytest.mark.parametrize("kind", ["gguf_q8_0", "quanto_float8"])
def test_an_fp16_overflow_in_a_layer_whose_weights_cannot_be_copied_is_not_called_unfixable(kind):
    """An fp16 overflow from finite weights and inputs (the GGUF fp16 Wan's case): float32 fixes it
    unquantized (and in torchao), but GGUF's and quanto's weights refuse the copy the dtype rows run
    on; the verdict said 'no setting fixes it', as if float32 had been tried."""
    pytest.importorskip(PACKAGES[kind])
    stack = quantized_stack(kind, torch.float16)
    result = explain(OriginCall("transformer", stack, "", (torch.full((2, 32), 6e4, dtype=torch.float16),), {}))
    failed = [r for r in result.replays if r.finite is None]
    assert result.baseline.finite is False and result.module == "0" and result.fix is None
    assert [r.factor for r in failed] == ["float32", "bfloat16"]
    assert result.verdict == (
        "no setting that could be replayed fixes it: transformer makes NaN/Inf from finite weights and inputs; "
        f"float32, bfloat16 could not be replayed ({failed[0].error})"
    )


def test_an_nf4_component_runs_in_its_inputs_dtype_not_its_matmul_s():
    """diffusers' BitsAndBytesConfig(load_in_4bit=True) casts each weight to ``torch_dtype`` (fp16
    here), then quantizes it; its ``bnb_4bit_compute_dtype`` defaults to float32, the dtype of the
    matmul only: a ``Linear4bit`` returns its input's dtype (``.to(inp_dtype)``), fp16, where an
    overflow becomes Inf. Its weights counted in float32 made the fp16 component believed float32
    (no fp16 sentinel); before the quantized path its other floats decided, fp16 until its first
    forward cast its biases to float32 in place."""
    bnb = pytest.importorskip("bitsandbytes")
    from diffusion_debug.diffusion.components.inventory import module_dtype
    from diffusion_debug.diffusion.components.structure import TreeMemo

    def layer():
        out = bnb.nn.Linear4bit(32, 32, compute_dtype=torch.float32, quant_type="nf4")
        weight = torch.randn(32, 32, dtype=torch.float16)
        out.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", compress_statistics=False)
        out.bias = torch.nn.Parameter(torch.zeros(32, dtype=torch.float16), requires_grad=False)
        return out.to("cpu")  # (quantizes it)

    torch.manual_seed(0)
    component = torch.nn.Sequential(layer(), torch.nn.GELU(), layer(), torch.nn.LayerNorm(32).half())
    for _ in range(2):  # before its first forward and after it (its biases then float32)
        memo = TreeMemo()
        memo.refresh([component])
        assert (memo.dtype(component), module_dtype(component)) == (torch.float16, torch.float16)
        assert describe_module(component)["dtype"] == "float16"
        assert component(torch.ones(1, 32, dtype=torch.float16)).dtype == torch.float16


def test_a_torchao_nf4_weight_of_a_qlora_run_is_read_dequantized():
    """torchao's NF4Tensor (QLoRA fine-tuning: ``to_nf4``) overrides ``dequantize`` with a static
    helper of two arguments: analyze_tensor, analyze_model and why raised TypeError on it."""
    pytest.importorskip("torchao")
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    from diffusion_debug import analyze_tensor
    from diffusion_debug.diffusion.replay.why import module_with_nonfinite_weights

    torch.manual_seed(0)
    reference = torch.randn(256, 256, dtype=torch.bfloat16)
    layer = torch.nn.Linear(256, 256, bias=False).requires_grad_(False)
    layer.weight = torch.nn.Parameter(to_nf4(reference), requires_grad=False)
    analysis = analyze_tensor(layer.weight)
    assert analysis.quantized == "NF4Tensor, dequantized" and analysis.nan == 0
    assert max(-analysis.min, analysis.max) == reference.abs().max().item()  # (a block's absmax is kept)
    assert analyze_model(layer).nonfinite == [] and module_with_nonfinite_weights(layer) is None
    with torch.no_grad():
        layer.weight.quantization_factor[0] = float("nan")  # the first of 4 groups of block scales
    assert analyze_tensor(layer.weight).nan == 256 * 256 // 4
    assert analyze_model(layer).nonfinite == ["weight"] and module_with_nonfinite_weights(layer) == ""
