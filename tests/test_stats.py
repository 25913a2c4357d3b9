import math
from collections import OrderedDict
from dataclasses import dataclass

import pytest
import torch
from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

from diffusion_debug.stats import (
    absmax_on_device,
    call_tensors,
    collect,
    iter_tensors,
    measure,
    tensor_stats,
    tensors_in,
)
from diffusion_debug.stats.host import count_host_transfers

INF, NAN = math.inf, math.nan


def naive(t: torch.Tensor) -> dict:
    """The reference: plain torch on float64, one statistic at a time."""
    x = t.detach().to(torch.float64).flatten()
    finite = x[torch.isfinite(x)]
    ref = dict(
        nan=int(torch.isnan(x).sum()),
        posinf=int((x == INF).sum()),
        neginf=int((x == -INF).sum()),
        zero_fraction=float((x == 0).sum()) / x.numel() if x.numel() else 0.0,
    )
    if finite.numel():
        ref.update(
            min=float(finite.min()),
            max=float(finite.max()),
            mean=float(finite.mean()),
            std=float(finite.std(correction=0)),
            absmax=float(finite.abs().max()),
            l2=float(torch.linalg.vector_norm(finite)),
        )
    else:
        ref.update(min=None, max=None, mean=None, std=None, absmax=None, l2=None)
    return ref


def check_against_naive(t, rel=1e-5, abs_=1e-6):
    got = tensor_stats(t)
    ref = naive(t)
    assert got.numel == t.numel() and got.shape == tuple(t.shape)
    for key, expected in ref.items():
        value = getattr(got, key)
        if expected is None:
            assert value is None, key
        else:
            assert value == pytest.approx(expected, rel=rel, abs=abs_), key
    return got


def laced(n=1000, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(n, generator=g) * 5).to(dtype)
    t[3], t[10], t[11], t[500] = NAN, INF, -INF, INF
    t[20:30] = 0
    return t


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(4, 8, 16, 16, generator=torch.Generator().manual_seed(1)),
        lambda: torch.full((7, 3), 2.5),
        lambda: laced(),
        lambda: torch.randn(2000, generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 1e4,
        lambda: torch.tensor([INF, -INF, NAN]),
        lambda: torch.tensor([3.0]),
    ],
    ids=["random", "constant", "nan_inf_laced", "float64_offset", "all_nonfinite", "single"],
)
def test_float32_and_float64_match_naive_reference(make):
    check_against_naive(make())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_matches_reference_on_its_own_values(dtype):
    t = laced(dtype=dtype)
    got = check_against_naive(t, rel=1e-4)
    assert got.dtype == str(dtype).removeprefix("torch.")
    assert got.dtype_max_fraction == pytest.approx(got.absmax / torch.finfo(dtype).max)


def test_fp16_dtype_max_fraction_is_the_overflow_signal():
    t = torch.tensor([1.0, -60000.0, 2.0], dtype=torch.float16)
    assert tensor_stats(t).dtype_max_fraction == pytest.approx(60000.0 / 65504.0, rel=1e-3)


def test_empty_tensor():
    got = tensor_stats(torch.empty(0, 3))
    assert (got.numel, got.nan, got.posinf, got.neginf, got.zero_fraction) == (0, 0, 0, 0, 0.0)
    assert got.min is None and got.mean is None and got.std is None and got.note is None


def test_integer_and_bool():
    ints = torch.tensor([-5, 0, 7, 7], dtype=torch.int32)
    got = check_against_naive(ints)
    assert got.dtype_max_fraction == pytest.approx(7 / torch.iinfo(torch.int32).max)
    flags = torch.tensor([True, False, True, True])
    got = tensor_stats(flags)
    assert (got.min, got.max, got.mean, got.zero_fraction, got.dtype_max_fraction) == (0.0, 1.0, 0.75, 0.25, None)


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this torch has no float8")
def test_fp8():
    t = torch.tensor([0.5, -2.0, 448.0, 0.0]).to(torch.float8_e4m3fn)
    got = check_against_naive(t)
    assert got.dtype_max_fraction == pytest.approx(1.0)


def test_meta_tensor_says_what_cannot_be_measured():
    got = tensor_stats(torch.empty(2, 3, device="meta"))
    assert got.note == "meta tensor: no data to measure"
    assert got.shape == (2, 3) and got.numel == 6 and got.mean is None


def test_complex_is_not_measured_but_does_not_crash():
    got = tensor_stats(torch.randn(3, dtype=torch.complex64))
    assert got.note == "complex tensor: not measured"


def test_many_tensors_reach_the_host_in_one_transfer():
    tensors = [torch.randn(64) for _ in range(20)] + [laced(), torch.empty(0)]
    with count_host_transfers() as reads:
        pending = [measure(t) for t in tensors]
        stats = collect(pending)
    assert reads.calls == ["tolist"]
    for t, s in zip(tensors, stats):
        assert s.mean == pytest.approx(naive(t)["mean"], rel=1e-5, abs=1e-6) if t.numel() else s.mean is None


def test_measure_alone_never_reads_the_host():
    with count_host_transfers() as reads:
        measure(laced())
        absmax_on_device((torch.randn(5), {"x": torch.randn(5)}))
    assert reads.count == 0


@dataclass
class _Pair:
    first: torch.Tensor
    second: tuple


def test_nested_outputs_are_walked_with_paths():
    a, b, c = torch.ones(2), torch.zeros(3), torch.tensor([NAN])
    output = {
        "unet": UNet2DConditionOutput(sample=a),
        "list": [b, OrderedDict(z=c)],
        "pair": _Pair(first=a, second=(b, "not a tensor")),
    }
    paths, tensors = zip(*iter_tensors(output))
    stats = dict(zip(paths, collect([measure(t) for t in tensors])))
    assert list(stats) == ["unet.sample", "list.0", "list.1.z", "pair.first", "pair.second.0"]
    assert stats["list.1.z"].nan == 1 and stats["list.0"].zero_fraction == 1.0


def test_absmax_on_device_propagates_nan_and_inf():
    assert absmax_on_device(torch.tensor([1.0, -3.0])).item() == 3.0
    assert math.isnan(absmax_on_device([torch.tensor([1.0]), torch.tensor([NAN, 2.0])]).item())
    assert absmax_on_device((torch.tensor([INF], dtype=torch.float16),)).item() == INF
    assert absmax_on_device((torch.tensor([1, 2]), "text")) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_summarize_many_tensors_in_five_cpu_ops_against_a_float64_reference(dtype):
    from diffusion_debug.op_count import count_aten_ops
    from diffusion_debug.stats import can_summarize, summarize, to_host

    g = torch.Generator().manual_seed(0)
    tensors = [(torch.randn(2, 4, 8, 8, generator=g) * scale + shift).to(dtype) for scale, shift in ((1, 0), (3, 1))]
    tensors.append(tensors[0][:, :, :, :])  # a view of another: measured on its own all the same
    assert can_summarize(tensors) and not can_summarize([tensors[0], tensors[0].float()[:1]])
    with count_aten_ops() as ops:
        pending = summarize(tensors)
    # four on a GPU; on this CPU the abs-max is abs then amax (the CPU inf-norm along dims loops per element)
    assert ops.total == 5 and ops.counts["aten.amax.default"] == 1, ops.counts
    for stats, t in zip(pending.finish(to_host(pending.vectors)), tensors):
        x = t.double()
        assert stats.mean == pytest.approx(x.mean().item(), rel=1e-5, abs=1e-6)
        assert stats.std == pytest.approx(x.std(correction=0).item(), rel=1e-4)
        assert stats.l2 == pytest.approx(x.norm().item(), rel=1e-5)
        assert stats.absmax == x.abs().max().item()  # exact: taken in the tensor's own dtype
        assert stats.nan == stats.posinf == stats.neginf == 0 and stats.min is None


def test_summarize_says_when_a_tensor_needs_a_full_measurement():
    from diffusion_debug.stats import summarize, to_host

    bad = torch.ones(2, 3)
    bad[1, 2] = float("inf")
    pending = summarize([torch.ones(2, 3), bad])
    good, unknown = pending.finish(to_host(pending.vectors))
    assert good.mean == 1.0 and unknown is None


def test_to_dict_is_dataclasses_asdict_with_the_shape_as_a_list():
    import dataclasses

    from diffusion_debug.diffusion.step_values import STAT_KEYS, stats_dict

    odd = torch.tensor([[1.0, -3.0], [float("inf"), float("nan")]])
    for t in (odd, torch.zeros(0), torch.zeros(2, dtype=torch.int64)):
        s = tensor_stats(t)
        expected = {**dataclasses.asdict(s), "shape": list(t.shape)}
        assert s.to_dict() == expected and list(s.to_dict()) == list(expected)
        assert stats_dict(s) == {k: expected[k] for k in STAT_KEYS} and list(stats_dict(s)) == list(STAT_KEYS)


def test_call_tensors_are_the_tensors_of_args_and_kwargs_in_tensors_in_order():
    a, b, c, d, e = (torch.full((1,), float(i)) for i in range(5))
    output = UNet2DConditionOutput(sample=e)
    args, kwargs = (a, [b, None], 3, "x"), {"x": c, "none": None, "nested": {"w": d}, "scale": 1.0, "out": output}
    found = call_tensors(args, kwargs)
    assert [t.item() for t in found] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert all(x is y for x, y in zip(found, tensors_in((args, kwargs)), strict=True))
    assert call_tensors((a,), {}) == [a] and call_tensors((), {}) == []


def test_host_copy_values_against_each_tensors_own_tolist_across_dtype_runs():
    """A 0-d value keeps its value whatever its neighbours' dtypes (runs of one dtype are stacked
    apart; a run of one is reshaped), and an int64 count beyond float32's range stays exact."""
    from diffusion_debug.op_count import count_aten_ops
    from diffusion_debug.stats import HostCopy

    g = torch.Generator().manual_seed(0)
    half = [v.half() for v in torch.randn(5, generator=g) * 1000]
    weight = torch.randn(3, generator=g, requires_grad=True)
    tensors = [
        torch.tensor(2**40 + 1),  # a count: 1099511627777, which float32 rounds
        *half[:3],
        torch.tensor(0.1, dtype=torch.float32),  # a run of one among fp16 values
        *half[3:],
        torch.tensor(0.1, dtype=torch.bfloat16),
        torch.tensor(math.nan, dtype=torch.bfloat16),
        weight.sum(),  # autograd tracks it: read without a graph
        torch.empty(0),
        torch.arange(4.0).reshape(2, 2),
        torch.tensor(math.inf, dtype=torch.float16),
    ]
    naive = [t.detach().double().reshape(-1).tolist() for t in tensors]
    with count_aten_ops() as ops:
        copy = HostCopy(tensors)
    stacked = (ops.counts["aten.stack.default"], ops.counts["aten.cat.default"])
    assert stacked == (3, 1)  # fp16 x3, fp16 x2, bf16 x2 (and the first float64 buffer, made once)
    with count_host_transfers() as reads:
        rows = copy.wait()
    assert reads.blocking == [] and reads.deferred == ["tolist"]
    assert rows[0] == [1099511627777.0]

    def named(rows):  # NaN named, to compare equal
        return [[v if v == v else "nan" for v in row] for row in rows]

    assert named(rows) == named(naive) and [len(r) for r in rows] == [1] * 10 + [0, 4, 1]


@pytest.mark.parametrize("autocast", [torch.float16, torch.bfloat16])
def test_host_copy_under_autocast_joins_its_pieces_in_one_op_with_the_same_values(autocast):
    """A step's values join in one float64 ``cat`` (their dtypes mixed: float32 statistics, fp16 abs-maxes,
    int64 counts). Autocast's ``cat`` casts each piece not of the widest dtype first (an op each: 4 on a
    step's copy, every step of a user's ``with torch.autocast(...)``); the join runs outside autocast,
    where ``cat`` promotes them itself, exactly."""
    from diffusion_debug.op_count import count_aten_ops
    from diffusion_debug.stats import HostCopy

    tensors = [
        torch.tensor([1.5, -2.25], dtype=torch.float32),
        torch.tensor(65504.0, dtype=torch.float16),
        torch.tensor(3.0, dtype=torch.float16),
        torch.tensor(2**40 + 1),  # a count float32 would round
        torch.tensor([0.1, 7.0], dtype=torch.bfloat16),
    ]
    naive = [t.double().reshape(-1).tolist() for t in tensors]
    HostCopy([torch.ones(1)])  # (the device's empty float64 buffer, made once a process)
    with torch.autocast("cpu", dtype=autocast), count_aten_ops() as ops:
        rows = HostCopy(tensors).wait()
    assert rows == naive
    assert ops.counts == {"aten.stack.default": 1, "aten.cat.default": 1}, ops.counts  # no _to_copy
    assert torch.is_autocast_cpu_enabled() is False  # (left as it was)


@pytest.mark.parametrize("autocast", [torch.float16, torch.bfloat16])
def test_host_copy_under_autocast_casts_nothing_and_reads_what_it_reads_outside_it(autocast):
    """A step's values under the user's ``torch.autocast``: autocast's ``cat`` cast each piece not of the widest
    dtype (the float64 buffer: every piece) in an op of its own, 3 ``_to_copy`` a step of an SD pipeline under
    float16 autocast, and its ``stack`` took float32 and its own dtype only (float16 values under bfloat16 autocast
    raised). Joined outside autocast: the ops and the values of a copy made outside it."""
    from diffusion_debug.op_count import count_aten_ops
    from diffusion_debug.stats import HostCopy

    tensors = [
        torch.tensor(1.5, dtype=torch.float16),
        torch.tensor(-2.0, dtype=torch.float16),
        torch.tensor(0.1),
        torch.tensor(0.25, dtype=torch.bfloat16),
        torch.tensor(3.0, dtype=torch.bfloat16),
        torch.tensor([1.0, 2.0], dtype=torch.float16),
        torch.tensor(7),
    ]
    with count_aten_ops() as outside:
        expected = HostCopy(tensors).wait()
    with torch.autocast("cpu", dtype=autocast):
        with count_aten_ops() as ops:
            rows = HostCopy(tensors).wait()
    assert ops.counts == outside.counts and "aten._to_copy.default" not in ops.counts
    assert rows == expected == [[1.5], [-2.0], [0.10000000149011612], [0.25], [3.0], [1.0, 2.0], [7.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scalars_to_host_reads_what_to_host_reads_in_one_stack_where_the_values_share_a_dtype(dtype):
    from diffusion_debug.op_count import count_aten_ops
    from diffusion_debug.stats import scalars_to_host, to_host

    values = torch.tensor([1.5, -65504.0 if dtype == torch.float16 else 3e38, NAN, INF, 1e-3]).to(dtype)
    alike = list(values.unbind())
    naive = [float(v) for v in values.tolist()]  # each value as its dtype holds it
    with count_aten_ops() as ops, count_host_transfers() as reads:
        got = scalars_to_host(alike)
    assert got[0] == naive[0] and got[1] == naive[1] and got[3] == naive[3] and got[4] == naive[4]
    assert math.isnan(got[2]) and len(got) == 5
    assert ops.counts == {"aten.stack.default": 1} and reads.count == 1
    with count_aten_ops() as ops:  # one alone: read as it is
        assert scalars_to_host(alike[:1]) == [1.5]
    assert ops.counts == {}
    # mixed dtypes, a vector, an empty tensor, an integer: to_host's first values (NaN for none)
    wide, vector = torch.tensor(2.0, dtype=torch.float64), torch.tensor([7.0, 8.0])
    mixed = [alike[0], wide, vector, torch.empty(0), torch.tensor(3)]
    expected = [row[0] if row else NAN for row in to_host(mixed)]
    got = scalars_to_host(mixed)
    assert got[:3] == expected[:3] == [1.5, 2.0, 7.0] and math.isnan(got[3]) and got[4] == 3.0
    tracked = torch.tensor(2.5, requires_grad=True)  # tracked by autograd: no graph for the read
    assert scalars_to_host([tracked, tracked * 2]) == [2.5, 5.0]
    assert scalars_to_host([]) == []


class _OwnOps(torch.Tensor):
    """A subclass with a ``__torch_function__`` of its own whose ops raise (as a compiled GGUF model's
    ``GGUFParameter``)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise KeyError(None)


def test_plain_tensor_unwraps_a_subclass_of_own_ops_only_where_its_storage_is_its_data():
    """A subclass of torch's dispatch (``GGUFParameter``'s kind) is read as the tensor it holds, no copy;
    a wrapper subclass with a ``__torch_dispatch__`` of its own (a jagged nested tensor; torchao's and
    DTensor's kind) is left as it is: its data is not its storage, and its ``alias`` raised
    (NotImplementedError) where a measurement read it, a ``debugger_error`` on its call."""
    from diffusion_debug.stats import plain_tensor

    base = torch.arange(6.0)
    with torch._C.DisableTorchFunctionSubclass():
        own = base.as_subclass(_OwnOps)
    plain = plain_tensor(own)
    assert type(plain) is torch.Tensor and plain.data_ptr() == base.data_ptr() and plain.tolist() == base.tolist()
    jagged = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(1, 3)], layout=torch.jagged)
    parameter = torch.nn.Parameter(base.clone())
    assert plain_tensor(jagged) is jagged and plain_tensor(parameter) is parameter


def test_autocast_off_keeps_autocasts_cache_of_cast_weights_where_autocast_was_turned_on_without_a_region():
    """``torch.set_autocast_enabled`` turns autocast on with no region (nesting count 0): leaving a plain
    ``torch.autocast(enabled=False)`` region there clears autocast's cache of cast weights, and the user's next
    call casts every weight again. A host copy under it keeps the cache: the next call casts what it did."""
    from diffusion_debug.op_count import count_aten_ops
    from diffusion_debug.stats import HostCopy

    linear, x = torch.nn.Linear(4, 4), torch.ones(2, 4)
    torch.set_autocast_enabled("cpu", True)
    try:
        torch.set_autocast_dtype("cpu", torch.bfloat16)
        torch.autocast_increment_nesting()  # autocast caches weight casts only inside a region: warm it in one
        linear(x)
        torch.autocast_decrement_nesting()
        with count_aten_ops() as warm:
            linear(x)
        HostCopy([torch.tensor(1.0, dtype=torch.float16), torch.tensor(2.0)]).wait()
        with count_aten_ops() as after:
            linear(x)
    finally:
        torch.set_autocast_enabled("cpu", False)
        torch.clear_autocast_cache()
    assert after.counts == warm.counts, (warm.counts, after.counts)


@pytest.mark.parametrize("autocast", [torch.float16, torch.bfloat16])
def test_scalars_and_summaries_of_the_other_half_dtype_read_under_autocast_what_they_read_outside_it(autocast):
    """Abs-maxes of one half dtype (a float16 component's outputs, a float16 T5's two calls) read under the
    other's autocast: ``scalars_to_host`` stacked them, and ``summarize`` stacked a step's tensors, with
    autocast's ``stack``, which takes float32 and its own dtype only and raised for the other half dtype
    ("Unexpected floating ScalarType in at::autocast::prioritize"): a ``debugger_error`` where a value was to be
    read. Both run outside autocast: the values and ops of a read outside it, autocast left as it was."""
    from diffusion_debug.op_count import count_aten_ops
    from diffusion_debug.stats import scalars_to_host
    from diffusion_debug.stats.batched import summarize

    other = torch.bfloat16 if autocast == torch.float16 else torch.float16
    scalars = list(torch.tensor([1.5, -3.0, INF, 0.25]).to(other).unbind())
    tensors = [torch.tensor([[1.0, -2.0], [4.0, 0.5]]).to(other), torch.tensor([[3.0, 0.0], [-8.0, 2.0]]).to(other)]
    l2 = torch.tensor([21.25, 77.0]).sqrt().tolist()  # (float32 norms)
    with count_aten_ops() as outside_ops:
        expected = (scalars_to_host(scalars), [v.tolist() for v in summarize(tensors).vectors])
    with torch.autocast("cpu", dtype=autocast), count_aten_ops() as ops:
        got = (scalars_to_host(scalars), [v.tolist() for v in summarize(tensors).vectors])
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == autocast
    assert got == expected == ([1.5, -3.0, INF, 0.25], [[3.5, -3.0], l2, [4.0, 8.0]])
    assert ops.counts == outside_ops.counts and "aten._to_copy.default" not in ops.counts


@pytest.mark.parametrize("device_type", ["cpu", "hpu", "xla", "mtia", "ipu"])
def test_outside_autocast_turns_off_each_device_type_any_autocast_sees(device_type):
    """``ANY_AUTOCAST`` (one C call) sees these device types' autocast too: one on among them was left on, and the
    training monitor measured under it. Turned on with no region (a flag each), off within the block, on after.
    (A third-party backend's, ``privateuseone`` renamed, needs one registered: ``torch.autocast`` refuses it.)"""
    from diffusion_debug.stats import ANY_AUTOCAST, outside_autocast

    try:
        torch.set_autocast_enabled(device_type, True)
    except RuntimeError:  # (torch 2.5, the floor: no mtia autocast; outside_autocast skips it the same way)
        pytest.skip(f"this torch has no {device_type} autocast")
    try:
        with outside_autocast():
            inside = torch.is_autocast_enabled(device_type), ANY_AUTOCAST()
        after = torch.is_autocast_enabled(device_type)
    finally:
        torch.set_autocast_enabled(device_type, False)
    assert (inside, after) == ((False, False), True)


def test_outside_autocast_that_fails_at_a_later_device_type_leaves_none_it_turned_off(monkeypatch):
    """A failure turning off a later device type's autocast left the earlier ones off (the stack was never handed
    back, nor closed) and their nesting counts one higher: the user's autocast is as it was."""
    from diffusion_debug.stats import host

    turned_off = host.autocast_off

    def refusing(device_type):
        if device_type == "hpu":
            raise RuntimeError("refused")
        return turned_off(device_type)

    monkeypatch.setattr(host, "autocast_off", refusing)
    torch.set_autocast_enabled("cpu", True)
    torch.set_autocast_enabled("hpu", True)
    try:
        with pytest.raises(RuntimeError, match="refused"):
            host.outside_autocast()
        state = torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("hpu")
        nesting = torch.autocast_increment_nesting()
        torch.autocast_decrement_nesting()
    finally:
        torch.set_autocast_enabled("cpu", False)
        torch.set_autocast_enabled("hpu", False)
        torch.clear_autocast_cache()
    assert (state, nesting) == ((True, True), 1)
