"""probes/fused.py: a sentinel's abs-maxes taken together, one op for a call's block outputs, read
the same values a reduction per tensor reads."""

import math

import pytest
import torch
from torch import nn

from diffusion_debug.op_count import count_aten_ops
from diffusion_debug.probes import OVERFLOW_DTYPES, Probe
from diffusion_debug.probes.fused import HeldAbsmax
from diffusion_debug.stats import to_host


class Blocks(nn.Module):
    def __init__(self, scale_after: float = 1.0):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.scale_after = scale_after

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 1 and self.scale_after != 1.0:
                x.mul_(self.scale_after)  # the block's output, changed in place after it returned
        return x


def sentinel(model, fused):
    return Probe(model, "sentinel", measure_inputs=False, dtypes=OVERFLOW_DTYPES, fused=fused)


def read(model, probe, x):
    with count_aten_ops() as ops, torch.no_grad(), probe.attach():
        model(x)
        values, make = probe.take()
    return ops.counts, make(to_host(values))


def test_a_fused_sentinel_reads_what_one_reduction_per_tensor_reads_in_one_op():
    torch.manual_seed(0)
    model = Blocks().half()
    with torch.no_grad():
        model.blocks[2].weight.mul_(3000.0)  # block 2 heads for fp16's largest value, block 3 past it
        model.blocks[3].weight.mul_(1000.0)
    x = torch.randn(2, 8, dtype=torch.float16)
    with torch.no_grad():
        plain = count_aten_ops()
        with plain:
            model(x)
    each_ops, each = read(model, sentinel(model, fused=False), x)
    fused_ops, fused = read(model, sentinel(model, fused=True), x)
    assert fused == each and [r.module for r in fused] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert fused[2].output_absmax > 1000 and not fused[3].output_finite  # the values the test is about
    naive = []  # the reference: each block's output abs-max, in float32
    with torch.no_grad():
        y = x
        for block in model.blocks:
            y = block(y)
            naive.append(y.float().abs().max().item())
    assert [r.output_value for r in fused] == naive
    added = lambda ops: {k: v - plain.counts.get(k, 0) for k, v in ops.items() if v != plain.counts.get(k, 0)}  # noqa: E731
    assert added(each_ops) == {"aten.linalg_vector_norm.default": 4}
    # on a CPU the fused read is _foreach_abs then _foreach_max (a ninth of the norm's time); on a
    # GPU one _foreach_norm kernel (test_a_gpu_reads_its_abs_maxes_in_one_norm_a_cpu_in_abs_and_max);
    # then the stack of the abs-maxes into one tensor (at the take: the host copy stacked them before)
    expected = {"aten._foreach_abs.default": 1, "aten._foreach_max.default": 1, "aten.stack.default": 1}
    assert added(fused_ops) == expected


@pytest.mark.skipif(not hasattr(torch, "_foreach_max"), reason="torch < 2.6: the norm everywhere")
def test_a_gpu_reads_its_abs_maxes_in_one_norm_a_cpu_in_abs_and_max():
    from diffusion_debug.probes.fused import _absmaxes

    nan, inf = float("nan"), float("inf")
    rows = [[1.0, -3.0], [nan, 2.0], [inf, -1.0], [-inf, 0.5], [nan, inf], [-0.0, 0.0]]
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        tensors = [torch.tensor(row, dtype=dtype) for row in rows]
        with count_aten_ops() as ops:
            values, one_device = _absmaxes(tensors)
        assert ops.counts == {"aten._foreach_abs.default": 1, "aten._foreach_max.default": 1}
        reference = torch._foreach_norm(tensors, math.inf)  # what the GPU path computes
        assert [v.dtype for v in values] == [dtype] * len(rows) and one_device
        assert [str(v.item()) for v in values] == [str(r.item()) for r in reference]
        assert [str(v.item()) for v in values] == ["3.0", "nan", "inf", "inf", "nan", "0.0"]
    meta = [torch.empty(2, 3, device="meta", dtype=torch.float16)]  # any device but the CPU: one norm
    with count_aten_ops() as ops:
        _absmaxes(meta)
    assert ops.counts == {"aten._foreach_norm.Scalar": 1}


def test_an_output_changed_in_place_after_its_module_returned_is_not_charged_to_the_module():
    torch.manual_seed(0)
    model = Blocks(scale_after=1e4).half()
    x = torch.randn(2, 8, dtype=torch.float16)
    _, each = read(model, sentinel(model, fused=False), x)  # read in the hook: before the change
    _, fused = read(model, sentinel(model, fused=True), x)  # read at the flush: after it
    assert each[1].output_value < 100 and fused[1].output_value == 0.0  # no reading, rather than a false one
    assert [r.output_value for r in fused[2:]] == [r.output_value for r in each[2:]]


def test_held_outputs_are_reduced_once_they_pass_the_byte_limit_into_one_tensor_a_flush():
    held = HeldAbsmax(limit_bytes=3 * 2 * 4)  # three fp16 tensors of 4 elements
    tensors = [torch.full((4,), float(i + 1), dtype=torch.float16) for i in range(4)]
    assert [held.add(t) for t in tensors[:2]] == [0, 1]
    assert len(held) == 2 and held.flushed == []  # under the limit: held, nothing reduced yet
    assert held.add(tensors[2]) == 2
    assert len(held) == 0 and [t.tolist() for t in held.flushed] == [[1.0, 2.0, 3.0]]
    assert held.add(tensors[3]) == 3
    flushed = held.take()  # the last flush (a view of its one value: no stack), and afresh at slot 0
    assert [t.tolist() for t in flushed] == [[1.0, 2.0, 3.0], [4.0]]
    assert [t.dtype for t in flushed] == [torch.float16] * 2
    assert len(held) == 0 and held.flushed == [] and held.add(tensors[0]) == 0


def test_a_flush_keeps_one_tensor_whatever_its_dtypes_and_a_value_a_tensor_across_devices():
    held = HeldAbsmax()
    for value, dtype in [(3.0, torch.float16), (-5.0, torch.bfloat16), (math.inf, torch.float16)]:
        held.add(torch.full((2,), value, dtype=dtype))
    with count_aten_ops() as ops:
        (flushed,) = held.take()
    assert flushed.dtype == torch.float32 and flushed.tolist() == [3.0, 5.0, math.inf]  # promoted, exactly
    assert ops.counts == {"aten._foreach_abs.default": 1, "aten._foreach_max.default": 1, "aten.stack.default": 1}
    held.add(torch.ones(2, dtype=torch.float16))
    held.add(torch.empty(2, dtype=torch.float16, device="meta"))  # another device: no stack across
    flushed = held.take()
    assert [(t.shape, t.device.type) for t in flushed] == [((), "cpu"), ((), "meta")]


@pytest.mark.parametrize("autocast, dtype", [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)])
def test_abs_maxes_of_one_half_dtype_under_the_other_half_dtypes_autocast_are_stacked_as_outside_it(autocast, dtype):
    """Autocast's ``stack`` takes float32 and its own dtype only: two float16 abs-maxes under bfloat16 autocast (a
    float16 component's sentinel in a bfloat16 autocast region) took the one-dtype shortcut, a stack under autocast,
    and raised "Unexpected floating ScalarType". Stacked outside autocast: the values as read outside it, no cast."""
    held = HeldAbsmax()
    with torch.autocast("cpu", dtype=autocast):
        held.add(torch.tensor([1.0, -3.0], dtype=dtype))
        held.add(torch.tensor([math.inf, 2.0], dtype=dtype))
        with count_aten_ops() as ops:
            (flushed,) = held.take()
    assert flushed.dtype == dtype and flushed.tolist() == [3.0, math.inf]
    assert ops.counts == {"aten._foreach_abs.default": 1, "aten._foreach_max.default": 1, "aten.stack.default": 1}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_fused_sentinel_records_no_graph_while_training_and_propagates_nan(dtype):
    model = Blocks().to(dtype)
    probe = Probe(model, "sentinel", measure_inputs=False, fused=True)
    x = torch.randn(2, 8, dtype=dtype, requires_grad=True)
    with probe.attach():
        y = model(x)
        y.float().sum().backward()  # the held outputs are detached views: backward is untouched
        nan = model.blocks[0](torch.full((2, 8), math.nan, dtype=dtype))
    values, make = probe.take()
    assert not any(v.requires_grad for v in values) and nan.isnan().all()
    readings = make(to_host(values))
    assert [r.output_finite for r in readings] == [True, True, True, True, False]


@pytest.mark.parametrize("armed, held_tensors", [(False, None), (True, None), (True, 7)])
def test_a_fused_full_probe_names_the_producer_and_reads_what_a_reduction_per_tensor_reads(
    armed, held_tensors, monkeypatch
):
    """The debugger's full probes on an fp16 component (its first call at the default, every call
    with probes="full") hold their abs-maxes for the fused reduction: the readings, inputs and
    outputs, are those of a reduction per tensor, a tensor read twice (the next module's input)
    is reduced once, and the planted producer is the module named. Also when the held tensors are
    flushed many times in the call (at every 7 here: a tensor held across a flush, the next
    module's input, is held again), one abs-max tensor a flush."""
    from diffusion_debug.probes import fused as fused_module
    from diffusion_debug.testing import tiny_pipeline

    if held_tensors is not None:
        monkeypatch.setattr(fused_module, "HELD_TENSORS", held_tensors)
    vae = tiny_pipeline("sd", dtype=torch.float16).vae
    z = torch.randn(1, 4, 8, 8, dtype=torch.float16)
    planted = vae.decoder.up_blocks[0].resnets[1].conv2

    def run(fused):
        probe = Probe(vae.decoder, "full", fused=fused)
        # the fault is the module's output (a hook of its own, put in before the probe's)
        with planted.register_forward_hook(lambda m, a, out: torch.full_like(out, math.inf)):
            with count_aten_ops() as ops, torch.no_grad(), probe.attach(armed=armed):
                image = vae.decoder(z)
                values, make = probe.take()
        return ops.counts, make(to_host(values)), image, values

    each_ops, each, each_image, _ = run(False)
    fused_ops, fused, fused_image, flushed = run(True)
    assert torch.equal(each_image.isnan(), fused_image.isnan()) and each_image.isnan().all()
    assert [repr(r) for r in fused] == [repr(r) for r in each] and len(fused) > 50  # (nan != nan)
    producers = [r.module for r in fused if r.input_finite and not r.output_finite]
    assert producers[0] == "up_blocks.0.resnets.1.conv2"
    norms = each_ops.get("aten.linalg_vector_norm.default", 0)
    assert norms > 50 and fused_ops.get("aten.linalg_vector_norm.default", 0) == 0
    flushes = 1 if held_tensors is None else len(flushed)
    assert fused_ops["aten._foreach_abs.default"] == fused_ops["aten._foreach_max.default"] == flushes
    assert fused_ops["aten.stack.default"] == flushes and all(v.dim() == 1 for v in flushed)
    if held_tensors is not None:  # one tensor a flush, of at most 7 values
        assert flushes > 10 and all(len(v) <= held_tensors for v in flushed), [len(v) for v in flushed]


def test_a_held_tensor_is_found_again_until_it_changes_or_is_flushed():
    held = HeldAbsmax()
    x, y = torch.ones(4, dtype=torch.float16), torch.full((4,), 2.0, dtype=torch.float16)
    assert (held.add(x), held.add(y)) == (0, 1)
    assert (held.slot_of(x), held.slot_of(y), held.slot_of(y.clone())) == (0, 1, None)
    y.mul_(3)  # changed in place: another value, read again where it is taken
    assert held.slot_of(y) is None
    assert held.add(y) == 2 and held.slot_of(y) == 2
    held.flush()
    assert held.slot_of(x) is None and [t.tolist() for t in held.take()] == [[1.0, 0.0, 6.0]]


@pytest.mark.parametrize("armed", [False, True])
def test_a_fused_full_probe_reads_calls_of_several_tensors_as_a_reduction_per_tensor_does(armed):
    """An fp16 UNet's calls take several tensors (a ResNet block's hidden states and time embedding,
    an attention's ``encoder_hidden_states`` keyword, flags beside them) and return a tuple (a
    transformer's ``return_dict=False``): the armed probe's hook holds them all itself (no
    :meth:`_read`), and its readings are those of a reduction per tensor, in order; the planted
    producer, a key projection whose weight holds an Inf (its input, the prompt's states, finite),
    is named, not the attention that takes its output."""
    from diffusion_debug.testing import tiny_pipeline

    unet = tiny_pipeline("sd", dtype=torch.float16).unet
    sample = torch.randn(2, 4, 8, 8, dtype=torch.float16)
    states = torch.randn(2, 7, unet.config.cross_attention_dim, dtype=torch.float16)
    planted = unet.down_blocks[0].attentions[0].transformer_blocks[0].attn2.to_k
    with torch.no_grad():
        planted.weight[0, 0] = math.inf

    def run(fused):
        probe = Probe(unet, "full", fused=fused)
        reads = []
        read = probe._read
        probe._read = lambda name, *rest: reads.append(name) or read(name, *rest)
        with count_aten_ops() as ops, torch.no_grad(), probe.attach(armed=armed and fused):
            out = unet(sample, 3, encoder_hidden_states=states, return_dict=False)[0]
            readings = probe.collect()
        return ops.counts, readings, out, reads

    each_ops, each, each_out, _ = run(False)
    fused_ops, fused, fused_out, reads = run(True)
    assert torch.equal(each_out.isnan(), fused_out.isnan()) and each_out.isnan().any()
    assert [repr(r) for r in fused] == [repr(r) for r in each] and len(fused) > 50  # (nan != nan)
    several = [r.module for r in fused if r.module.endswith(("resnets.0", "attn2", "attentions.0"))]
    assert "down_blocks.0.resnets.0" in several and "down_blocks.0.attentions.0" in several
    producers = [r.module for r in fused if r.input_finite and not r.output_finite]
    assert producers[0] == "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k"
    assert fused_ops.get("aten.linalg_vector_norm.default", 0) == 0
    if armed:  # read by _read: only the calls with a non-tensor argument (the time step) or output
        assert not any(name.endswith(("resnets.0", "attn2", "attentions.0", "to_k")) for name in reads)
        assert len(reads) < len(fused) / 10, (len(reads), len(fused))


def test_a_sentinel_taken_with_nothing_queued_hands_over_nothing_and_reads_the_next_call():
    """A reused sentinel is taken at every step whether its component ran or not: with nothing
    queued it hands over no value and no reading, and its next call is read as a first one is."""
    torch.manual_seed(0)
    model = Blocks().half()
    x = torch.randn(2, 8, dtype=torch.float16)
    probe = sentinel(model, fused=True)
    with torch.no_grad(), probe.attach():
        values, make = probe.take()
        assert (values, make([])) == ([], [])
        model(x)
        values, make = probe.take()
        readings = make(to_host(values))
        assert probe.take()[0] == []
    naive, y = [], x
    with torch.no_grad():
        for block in model.blocks:
            y = block(y)
            naive.append(y.float().abs().max().item())
    assert [r.output_value for r in readings] == naive


def test_forward_hooks_skip_a_module_that_is_gone():
    from diffusion_debug.probes.handles import ForwardHooks

    layer, seen = nn.Linear(2, 2), []
    with ForwardHooks([(None, lambda *a: seen.append("gone")), (layer, lambda *a: seen.append("layer"))]):
        layer(torch.ones(2))
    assert seen == ["layer"] and layer._forward_hooks == {}


def test_paused_hooks_come_out_of_their_modules_and_back_in_their_place():
    """``PausedHooks`` (a UNet sentinel's steps not read): a hook alone in its module's dict comes out
    (torch's fast path: nothing runs) and back under its own key, before any hook added meanwhile; one
    last behind another hook (transformers' output-capturing hook on a CLIP layer) comes out too and back
    after it, before one added meanwhile; one between two others stays in (its place could not be kept);
    a removal while out puts nothing back, and a later resume does nothing."""
    from diffusion_debug.probes.handles import ForwardHooks, OwnHook, PausedHooks

    alone, shared, middle, seen = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2), []
    theirs = shared.register_forward_hook(lambda *a: seen.append("theirs"))
    middle.register_forward_hook(lambda *a: seen.append("first"))
    ours = [
        (alone, OwnHook(lambda *a: seen.append("alone"))),
        (shared, OwnHook(lambda *a: seen.append("shared"))),
        (middle, OwnHook(lambda *a: seen.append("middle"))),
    ]
    added = ForwardHooks(ours)
    middle.register_forward_hook(lambda *a: seen.append("last"))
    keys = [list(alone._forward_hooks), list(shared._forward_hooks), list(middle._forward_hooks)]
    paused = PausedHooks(ours)
    paused.pause()
    assert paused.paused and not alone._forward_hooks and list(shared._forward_hooks) == [theirs.id]
    later = [m.register_forward_hook(lambda *a, m=m: seen.append(f"later {id(m)}")) for m in (alone, shared)]
    alone(torch.ones(2)), shared(torch.ones(2)), middle(torch.ones(2))
    assert seen == [f"later {id(alone)}", "theirs", f"later {id(shared)}", "first", "middle", "last"]
    paused.resume()
    seen.clear()
    alone(torch.ones(2)), shared(torch.ones(2)), middle(torch.ones(2))
    assert seen == [  # ours before the ones added while it was out, after theirs
        "alone",
        f"later {id(alone)}",
        "theirs",
        "shared",
        f"later {id(shared)}",
        "first",
        "middle",
        "last",
    ]
    assert [list(m._forward_hooks)[: len(k)] for m, k in zip((alone, shared), keys[:2])] == [keys[0], keys[1]]
    assert list(middle._forward_hooks) == keys[2]
    for handle in later:
        handle.remove()
    paused.pause()
    added.remove()  # a detach while out
    paused.remove()
    paused.resume()
    assert not alone._forward_hooks and list(shared._forward_hooks) == [theirs.id]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_call_output_held_with_the_block_outputs_reads_its_abs_max_with_no_op_of_its_own(dtype):
    """``Probe.hold``: a component call's output, reduced with the block outputs at ``take`` (the
    text encoder's output check), reads what a plain abs().max() in float64 reads, NaN before Inf,
    strided or not, and adds no op to the flush's; what the fused reduction does not take as it is
    (fp8, empty, meta) and a probe that holds nothing give None (the caller measures it itself)."""
    model = Blocks().to(dtype)
    x = torch.randn(2, 8, dtype=dtype)
    for fill in (None, 65504.0, -math.inf, math.nan):
        output = (torch.randn(3, 7, 8, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
        if fill is not None:
            output[1, 2, 3] = fill
            output[2, 0, 0] = math.inf  # with a NaN too: the NaN wins, as in a reduction
        for tensor in (output, output[:, ::2]):
            probe = sentinel(model, fused=True)
            with count_aten_ops() as ops, torch.no_grad(), probe.attach():
                model(x)
                slot = probe.hold(tensor)
                values, make = probe.take()
            blocks = 4 if dtype in OVERFLOW_DTYPES else 0  # a bf16 block cannot overflow: not read
            assert slot == blocks and len(values) == 1  # after the blocks' outputs, in their one flush
            expected = tensor.double().abs().max().item()
            got = values[0].tolist()[slot]
            assert got == expected or (math.isnan(got) and math.isnan(expected)), (fill, got, expected)
            assert [r.module for r in make([values[0].tolist()])] == [f"blocks.{i}" for i in range(blocks)]
            assert ops.counts["aten._foreach_abs.default"] == ops.counts["aten._foreach_max.default"] == 1
    probe = sentinel(model, fused=True)
    assert probe.hold(torch.zeros(0, dtype=dtype)) is None
    assert probe.hold(torch.zeros(2, dtype=dtype, device="meta")) is None
    if hasattr(torch, "float8_e4m3fn"):
        assert probe.hold(torch.zeros(2, dtype=torch.float8_e4m3fn)) is None
    assert sentinel(model, fused=False).hold(output) is None


class DownBlocks(nn.Module):
    """Blocks that return what a UNet's down blocks do: the hidden states and a tuple of residuals,
    the last of which is the hidden states again (``extra``: a non-float tensor, or None, among
    the residuals)."""

    def __init__(self, extra=False):
        super().__init__()
        self.blocks = nn.ModuleList([_DownBlock(extra) for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x, _ = block(x)
        return x


class _DownBlock(nn.Module):
    def __init__(self, extra):
        super().__init__()
        self.first, self.second, self.extra = nn.Linear(8, 8), nn.Linear(8, 8), extra

    def forward(self, x):
        residual = self.first(x)
        x = self.second(residual)
        extra = () if self.extra is False else (self.extra,)
        return x, (residual, *extra, x)


@pytest.mark.parametrize("extra", [False, None, torch.ones(2, dtype=torch.int64)], ids=["tensors", "none", "int"])
def test_a_fused_sentinel_reads_a_tuple_of_hidden_states_and_residuals_as_a_reduction_per_tensor_does(extra):
    """A down block's output, held in the hook's own frame (``Probe._hold_tuple``) or, with
    anything but floating tensors in it, read by ``_read``: each distinct tensor held once (the
    hidden states, returned twice, one slot), and each block's reading the largest abs-max of its
    tensors, as one reduction a tensor and a naive float32 reference read it."""
    torch.manual_seed(0)
    model = DownBlocks(extra).half()
    with torch.no_grad():
        model.blocks[1].first.weight.mul_(10000.0)  # a residual heads for fp16's largest value
    x = torch.randn(2, 8, dtype=torch.float16)
    _, each = read(model, sentinel(model, fused=False), x)
    probe = sentinel(model, fused=True)
    with torch.no_grad(), probe.attach():
        model(x)
        held = len(probe._held.tensors)
        values, make = probe.take()
    fused = make(to_host(values))
    assert held == 6  # two distinct tensors a block
    naive = []
    with torch.no_grad():
        y = x
        for block in model.blocks:
            residual = block.first(y)
            y = block.second(residual)
            naive.append(max(residual.float().abs().max().item(), y.float().abs().max().item()))
    assert [r.module for r in fused] == ["blocks.0", "blocks.1", "blocks.2"]
    assert fused == each and [r.output_value for r in fused] == naive and naive[1] > 1000


def test_paused_hooks_keep_every_order_a_prepend_and_two_of_ours_on_one_module():
    """``PausedHooks.resume``: a hook prepended (``prepend=True``) while ours, last behind another's, was out
    stays before that other hook (it went behind it); two of ours on one module (first and last) go back in
    their order (they came back swapped)."""
    from diffusion_debug.probes.handles import ForwardHooks, OwnHook, PausedHooks

    shared, seen = nn.Linear(2, 2), []
    shared.register_forward_hook(lambda *a: seen.append("theirs"))
    ours = [(shared, OwnHook(lambda *a: seen.append("ours")))]
    made = [ForwardHooks(ours)]  # removed at the end: each holds probes.copies' patch until then
    paused = PausedHooks(ours)
    paused.pause()
    shared.register_forward_hook(lambda *a: seen.append("prepended"), prepend=True)
    paused.resume()
    shared(torch.ones(2))
    assert seen == ["prepended", "theirs", "ours"]

    for between in (False, True):
        both, seen = nn.Linear(2, 2), []
        first, last = OwnHook(lambda *a: seen.append("first")), OwnHook(lambda *a: seen.append("last"))
        made.append(ForwardHooks([(both, first)]))
        if between:
            both.register_forward_hook(lambda *a: seen.append("theirs"))
        made.append(ForwardHooks([(both, last)]))
        paused = PausedHooks([(both, first), (both, last)])
        paused.pause()
        assert not both._forward_hooks or between
        paused.resume()
        both(torch.ones(2))
        assert seen == (["first", "theirs", "last"] if between else ["first", "last"])
    for hooks in made:
        hooks.remove()
