"""analyze_tensor against a float64 reference computed element by element in plain Python."""

from __future__ import annotations

import math

import pytest
import torch

from diffusion_debug import analyze_tensor
from diffusion_debug.stats import count_host_transfers


def _reference(t: torch.Tensor) -> dict:
    values = [float(v) for v in t.detach().reshape(-1).double().tolist()]
    finite = [v for v in values if math.isfinite(v)]
    mean = sum(finite) / len(finite)
    limit = torch.finfo(t.dtype).max if t.dtype.is_floating_point else torch.iinfo(t.dtype).max
    return {
        "nan": sum(v != v for v in values),
        "inf": sum(abs(v) == math.inf for v in values),
        "zeros": sum(v == 0 for v in values),
        "min": min(finite),
        "max": max(finite),
        "mean": mean,
        "std": math.sqrt(sum((v - mean) ** 2 for v in finite) / len(finite)),
        "range": max(abs(v) for v in finite) / limit,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32])
def test_analyze_tensor_matches_a_naive_reference(dtype):
    generator = torch.Generator().manual_seed(3)
    t = (torch.randn(5, 7, generator=generator) * 50).to(dtype)
    t[0, 0] = 0
    t[1, :2] = 0
    if dtype.is_floating_point:
        t[2, 3] = float("nan")
        t[3, 1] = float("inf")
        t[4, 6] = float("-inf")
    found, expected = analyze_tensor(t, "t"), _reference(t)
    assert (found.shape, found.dtype, found.device) == ((5, 7), str(dtype).removeprefix("torch."), "cpu")
    assert (found.nan, found.inf, found.zeros) == (expected["nan"], expected["inf"], expected["zeros"])
    for key in ("min", "max", "mean", "std"):
        assert getattr(found, key) == pytest.approx(expected[key], rel=1e-6, abs=1e-9), key
    assert found.range_fraction == pytest.approx(expected["range"], rel=1e-6)
    assert found.has_nan == found.has_inf == dtype.is_floating_point


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_finite_tensor_near_its_dtypes_maximum_has_finite_statistics(dtype):
    # the squares of values above ~1.8e19 overflow a float32 accumulator: std would read inf
    t = torch.tensor([3e38, 3e38, -1e20, 2e19], dtype=torch.float32).to(dtype)
    found, expected = analyze_tensor(t), _reference(t)
    assert found.nan == found.inf == 0
    for key in ("min", "max", "mean", "std"):
        assert getattr(found, key) == pytest.approx(expected[key], rel=1e-6), key
    assert found.stats.l2 == pytest.approx(math.sqrt(sum(float(v) ** 2 for v in t.double().tolist())), rel=1e-6)


def test_analyze_tensor_reads_the_host_once():
    t = torch.randn(1000)
    with count_host_transfers() as reads:
        analyze_tensor(t)
    assert reads.blocking == ["tolist"]


def test_analyze_tensor_repr_is_one_line_with_what_is_wrong():
    t = torch.tensor([[2.0, 0.0, float("nan")], [-4.0, float("-inf"), 1.0]], dtype=torch.float16)
    assert repr(analyze_tensor(t, "latents")) == (
        "latents: tensor[2, 3] float16 cpu min=-4 max=2 mean=-0.25 std=2.278 NaN=1 -Inf=1 zero=1 range=6.1e-05"
    )
    assert repr(analyze_tensor(torch.ones(2, 2))) == "tensor[2, 2] float32 cpu min=1 max=1 mean=1 std=0 range=2.9e-39"
    assert repr(analyze_tensor(torch.empty(0, 3))) == "tensor[0, 3] float32 cpu empty"
    assert (
        repr(analyze_tensor(torch.empty(2, device="meta")))
        == "tensor[2] float32 meta (meta tensor: no data to measure)"
    )


def test_analyze_tensor_to_dict_is_plain_values():
    d = analyze_tensor(torch.tensor([0.0, float("inf")]), "x").to_dict()
    assert (d["name"], d["shape"], d["posinf"], d["inf"], d["zeros"], d["max"]) == ("x", [2], 1, 1, 1, 0.0)


def test_analyze_tensor_refuses_what_is_not_a_tensor():
    with pytest.raises(TypeError, match="analyze_tensor takes a torch.Tensor, not list"):
        analyze_tensor([1.0, 2.0])


def _assert_matches(analysis, reference):
    assert (analysis.nan, analysis.inf, analysis.zeros) == (reference["nan"], reference["inf"], reference["zeros"])
    for key in ("min", "max", "mean", "std", "range"):
        got = analysis.range_fraction if key == "range" else getattr(analysis, key)
        assert got == pytest.approx(reference[key], rel=1e-6, abs=1e-12), key


def test_an_expanded_view_is_measured_as_its_full_copy_would_be():
    """Stride-0 dimensions repeat each value equally often: the stats of the copy, without the copy."""
    base = torch.randn(3, 1, 5, generator=torch.Generator().manual_seed(1))
    base[0, 0, 1], base[1, 0, 2], base[2, 0, 4] = float("nan"), float("inf"), 0.0
    view = base.expand(3, 400, 5)
    assert view.stride() == (5, 0, 1)
    analysis = analyze_tensor(view, "v")
    _assert_matches(analysis, _reference(view.contiguous()))
    assert analysis.shape == (3, 400, 5) and analysis.stats.numel == 6000
    copy_l2 = view.contiguous().nan_to_num(0, 0, 0).double().norm().item()
    assert analysis.stats.l2 == pytest.approx(copy_l2, rel=1e-6)  # over the finite values, scaled by the repeat


def test_a_terabyte_expand_of_one_zero_is_analysed_without_allocating_it():
    analysis = analyze_tensor(torch.zeros(1).expand(10**6, 10**6))  # a copy would be 4 TB
    assert repr(analysis) == "tensor[1000000, 1000000] float32 cpu min=0 max=0 mean=0 std=0 zero=1000000000000 range=0"
    assert (analysis.stats.numel, analysis.zeros, analysis.nan) == (10**12, 10**12, 0)


@pytest.mark.parametrize("layout", ["strided", "jagged", "jagged narrowed"])
def test_a_nested_tensor_is_measured_over_its_components(layout):
    generator = torch.Generator().manual_seed(2)
    parts = [torch.randn(2, 3, generator=generator), torch.randn(4, 3, generator=generator)]
    parts[1][1, 1], parts[1][2, 0], parts[0][0, 2] = float("nan"), float("-inf"), 0.0
    if layout == "strided":
        with pytest.warns(UserWarning, match="prototype"):
            nested = torch.nested.nested_tensor(parts)
    elif layout == "jagged":
        nested = torch.nested.nested_tensor(parts, layout=torch.jagged)
    else:  # components that are slices of one buffer: the buffer holds values that are in no component
        buffer = torch.randn(3, 4, generator=generator)
        buffer[0, 3] = float("nan")
        nested = torch.nested.narrow(buffer, 1, torch.tensor([0, 1, 0]), torch.tensor([2, 3, 1]), layout=torch.jagged)
        parts = list(nested.unbind())
    analysis = analyze_tensor(nested, "n")
    _assert_matches(analysis, _reference(torch.cat([p.reshape(-1) for p in parts])))
    assert analysis.nested_shapes == tuple(tuple(p.shape) for p in parts)
    shapes = ", ".join(f"[{', '.join(map(str, p.shape))}]" for p in parts)
    assert repr(analysis).startswith(f"n: nested tensor of {len(parts)}: {shapes} float32 cpu min=")
