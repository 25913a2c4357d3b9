import math

import pytest
import torch
from torch import nn

from diffusion_debug import installed
from diffusion_debug.diffusion.checks import find_producer, first_nonfinite
from diffusion_debug.probes import (
    OVERFLOW_DTYPES,
    PASS_THROUGH,
    ModuleReading,
    Probe,
    ProbeConfig,
    ProbeHandle,
    apply_probes,
    sentinel_modules,
)
from diffusion_debug.stats.host import count_host_transfers
from diffusion_debug.testing import plant_nonfinite as plant_inf
from diffusion_debug.testing import tiny_pipeline


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def hook_keys(model: nn.Module):
    return {
        name: (
            list(m._forward_hooks),
            list(m._forward_pre_hooks),
            list(m._backward_hooks),
            list(m._forward_hooks_with_kwargs),
            list(m._forward_pre_hooks_with_kwargs),
        )
        for name, m in model.named_modules()
    }


@pytest.fixture
def net():
    torch.manual_seed(0)
    return Net()


def test_sentinel_modules_of_a_custom_model(net):
    assert [n for n, _ in sentinel_modules(net)] == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]


def test_sentinel_modules_of_real_components():
    pipe = tiny_pipeline("sd")
    unet_blocks = [n for n, _ in sentinel_modules(pipe.unet)]
    assert {"conv_in", "down_blocks.0", "down_blocks.1", "up_blocks.1", "mid_block.resnets.0", "conv_out"} <= set(
        unet_blocks
    )
    assert not any(n.startswith("down_blocks.0.") for n in unet_blocks)  # blocks, not their insides
    vae_blocks = [n for n, _ in sentinel_modules(pipe.vae)]
    assert "decoder.up_blocks.0" in vae_blocks and "encoder.down_blocks.0" in vae_blocks
    text_blocks = [n for n, _ in sentinel_modules(pipe.text_encoder)]
    assert any(n.endswith("layers.1") for n in text_blocks)


@pytest.mark.parametrize("granularity, expected", [("full", "blocks.1.mlp.0"), ("sentinel", "blocks.1")])
def test_producer_is_the_planted_module_not_its_parent_or_successor(net, granularity, expected):
    fault = plant_inf(net.blocks[1].mlp[0])
    # sentinel on every dtype (this net is float32): the block-level mechanism itself
    probe = Probe(net, granularity, dtypes=None, measure_inputs=True)
    with probe.attach():
        out = net(torch.randn(3, 4))
    fault.remove()
    assert not torch.isfinite(out).all()
    readings = probe.collect()
    producer = find_producer(readings)
    assert producer.module == expected
    assert producer.call == 0 and producer.input_finite and not producer.output_finite
    if granularity == "full":
        # the parent and the next module are non-finite too, but not producers
        bad = [r.module for r in readings if not r.output_finite]
        assert bad[:3] == ["blocks.1.mlp.0", "blocks.1.mlp.2", "blocks.1.mlp"]  # the GELU is skipped


def test_producer_on_a_real_unet_inner_module():
    pipe = tiny_pipeline("sd")
    unet = pipe.unet
    target = "up_blocks.1.resnets.0.conv2"
    fault = plant_inf(unet.get_submodule(target))
    probe = Probe(unet, "full")
    sample = torch.randn(1, unet.config.in_channels, 8, 8)
    context = torch.randn(1, 4, unet.config.cross_attention_dim)
    with probe.attach(), torch.no_grad():
        unet(sample, 10, encoder_hidden_states=context)
    fault.remove()
    assert find_producer(probe.collect()).module == target


def test_nonfinite_parameter_makes_its_module_the_producer(net):
    with torch.no_grad():
        net.blocks[2].mlp[2].weight[0, 0] = math.nan
    probe = Probe(net, "full")
    with probe.attach():
        net(torch.randn(2, 4))
    assert find_producer(probe.collect()).module == "blocks.2.mlp.2"


def test_nonfinite_model_input_has_no_producer(net):
    probe = Probe(net, "full")
    with probe.attach():
        net(torch.tensor([[1.0, math.inf, 0.0, 0.0]]))
    readings = probe.collect()
    assert find_producer(readings) is None
    assert first_nonfinite(readings).module == "embed"


def test_calls_are_counted_per_module_in_finish_order(net):
    fault = plant_inf(net.head, from_call=2)
    probe = Probe(net, "sentinel", dtypes=None, measure_inputs=True)
    with probe.attach():
        for _ in range(3):
            net(torch.randn(1, 4))
    fault.remove()
    readings = probe.collect()
    assert len(readings) == 15
    producer = find_producer(readings)
    assert (producer.module, producer.call) == ("head", 2)


@pytest.mark.parametrize("armed", [False, True])
def test_readings_are_the_naive_ones_with_a_module_called_twice_in_one_forward(armed):
    """Each call's reading, numbered per module (a module called twice in one forward: 0 then 1;
    each other once: 0), with the sums a naive reference takes (float32: the finite signal)."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared, self.once = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            return self.once(self.shared(self.shared(x)))

    model, x = Twice(), torch.tensor([[1.0, -2.0]])
    with torch.no_grad():
        a = model.shared(x)
        b = model.shared(a)
        c = model.once(b)
    probe = Probe(model, "full")
    with probe.attach(armed=armed), torch.no_grad():
        model(x)
    s = [t.sum(dtype=torch.float32).item() for t in (x, a, b, c)]
    expected = [("shared", 0, s[0], s[1]), ("shared", 1, s[1], s[2]), ("once", 0, s[2], s[3]), ("", 0, s[0], s[3])]
    found = probe.collect()
    assert [type(r) for r in found] == [ModuleReading] * 4
    assert [tuple(r) for r in found] == [(n, k, "float32", i, o, "float32", "finite") for n, k, i, o in expected]


def test_sentinel_mode_reads_the_host_once_per_collect(net):
    probe = Probe(net, "sentinel", dtypes=None, measure_inputs=True)
    with probe.attach():
        with count_host_transfers() as during:
            net(torch.randn(2, 4))
        with count_host_transfers() as at_collect:
            readings = probe.collect()
    assert during.count == 0
    assert at_collect.calls == ["tolist"]
    assert len(readings) == 5 and all(r.output_finite for r in readings)


def test_readings_match_a_naive_reference(net):
    x = torch.randn(5, 4)
    probe = Probe(net, "full")
    with probe.attach():
        net(x)
    by_name = {r.module: r for r in probe.collect()}
    # float32: the finite signal is the sum; abs-max is only claimed for low precision
    assert by_name["embed"].output_value == pytest.approx(net.embed(x).sum().item(), rel=1e-5)
    assert by_name["embed"].input_value == pytest.approx(x.sum().item(), rel=1e-5)
    assert by_name["embed"].output_absmax is None and by_name["embed"].dtype == "float32"

    half = Net().half()
    xh = x.half()
    probe = Probe(half, "full")
    with probe.attach():
        half(xh)
    embed = {r.module: r for r in probe.collect()}["embed"]
    assert embed.output_absmax == pytest.approx(half.embed(xh).abs().max().item())
    assert embed.input_absmax == pytest.approx(xh.abs().max().item())
    assert (embed.dtype, embed.input_dtype) == ("float16", "float16")


def test_a_negative_infinite_sum_is_still_non_finite(net):
    probe = Probe(net, "full")
    with probe.attach():
        net(torch.tensor([[-math.inf, 1.0, 0.0, 0.0]]))
    readings = probe.collect()
    assert not readings[0].input_finite


def test_without_inputs_only_outputs_are_measured(net):
    probe = Probe(net, "sentinel", dtypes=None, measure_inputs=False)
    with probe.attach():
        net(torch.randn(1, 4))
    readings = probe.collect()
    assert len(readings) == 5 and all(r.input_value is None and r.output_value is not None for r in readings)


def test_dtype_max_fraction_for_fp16():
    model = nn.Sequential(nn.Linear(2, 2)).half()
    with torch.no_grad():
        model[0].weight.fill_(1000.0)
        model[0].bias.zero_()
    probe = Probe(model, "full")
    with probe.attach():
        model(torch.full((1, 2), 16.0, dtype=torch.float16))
    reading = probe.collect()[0]
    assert reading.dtype_max_fraction == pytest.approx(32000.0 / 65504.0, rel=1e-3)


def test_remove_leaves_hooks_exactly_as_before_and_is_idempotent(net):
    user_hook = net.blocks[0].register_forward_hook(lambda *a: None)
    before = hook_keys(net)
    handle = Probe(net, "full").attach()
    assert hook_keys(net) != before
    handle.remove()
    handle.remove()
    assert hook_keys(net) == before
    assert isinstance(handle, ProbeHandle) and not handle.attached
    user_hook.remove()


def test_handle_is_a_context_manager_and_removes_on_error(net):
    before = hook_keys(net)
    with pytest.raises(RuntimeError):
        with Probe(net, "sentinel").attach():
            raise RuntimeError("boom")
    assert hook_keys(net) == before


def test_outputs_are_unchanged_by_probes(net):
    x = torch.randn(4, 4)
    expected = net(x)
    for granularity in ("sentinel", "full"):
        with Probe(net, granularity).attach():
            assert torch.equal(net(x), expected)


def test_probes_add_no_attributes(net):
    before = {name: set(vars(m)) for name, m in net.named_modules()}
    with Probe(net, "full").attach():
        net(torch.randn(1, 4))
    assert {name: set(vars(m)) for name, m in net.named_modules()} == before


def test_a_failing_measurement_is_recorded_and_the_forward_goes_on(net, monkeypatch):
    import diffusion_debug.probes.readings as probes

    def broken(_):
        raise RuntimeError("measurement broke")

    monkeypatch.setattr(probes, "_sum_signal", broken)
    probe = Probe(net, "sentinel", dtypes=None, measure_inputs=True)
    with probe.attach():
        out = net(torch.randn(1, 4))
    assert out.shape == (1, 2)
    assert probe.errors[0] == ("embed", "RuntimeError: measurement broke")

    strict = Probe(net, "sentinel", dtypes=None, strict=True)
    with strict.attach(), pytest.raises(RuntimeError, match="measurement broke"):
        net(torch.randn(1, 4))
    assert strict.errors == [("embed", "RuntimeError: measurement broke")]  # no owner to hand it to

    # an owner's on_raise (the debugger's sink) gets it first, by where, and the probe keeps nothing
    handed = []
    owned = Probe(net, "sentinel", dtypes=None, strict=True)
    owned.on_raise, owned.label = lambda where, error: handed.append((where, str(error))), "probe net."
    with owned.attach(), pytest.raises(RuntimeError, match="measurement broke"):
        net(torch.randn(1, 4))
    assert handed == [("probe net.embed", "measurement broke")] and owned.errors == []


def test_bad_granularity_is_a_clear_error(net):
    with pytest.raises(ValueError, match="granularity must be one of"):
        Probe(net, "everything")


def test_full_probes_skip_modules_that_cannot_produce_nonfinite_values():
    model = nn.Sequential(nn.Linear(2, 2), nn.SiLU(), nn.Dropout(0.1), nn.Linear(2, 2)).eval()
    probe = Probe(model, "full")
    assert probe.module_names == ["", "0", "3"]
    fault = plant_inf(model[3])
    with probe.attach():
        model(torch.randn(1, 2))
    fault.remove()
    assert find_producer(probe.collect()).module == "3"


@pytest.mark.parametrize("armed", [False, True])
def test_a_pass_through_output_reads_as_its_input_without_another_reduction(armed):
    from diffusion_debug.op_count import count_aten_ops

    model = nn.Sequential(nn.Linear(2, 2), nn.SiLU(), nn.Dropout(0.1), nn.Linear(2, 2)).eval()
    x = torch.randn(3, 2)
    h = model[0](x).detach()
    probe = Probe(model, "full")
    with torch.no_grad(), count_aten_ops() as ops, probe.attach(armed=armed):
        out = model(x)
    # x, the first Linear's output and the last one's: the SiLU's and the dropout's outputs, which
    # the last Linear takes, are not reduced again
    assert ops.counts["aten.sum.default"] == 3
    readings = [(r.module, r.input_value, r.output_value) for r in probe.collect()]
    assert readings == [
        ("0", pytest.approx(x.sum().item()), pytest.approx(h.sum().item())),
        ("3", pytest.approx(h.sum().item()), pytest.approx(out.sum().item())),  # the SiLU's input
        ("", pytest.approx(x.sum().item()), pytest.approx(out.sum().item())),
    ]

    # a fault is still named where it is made: before the SiLU, or after it
    for planted in ("0", "3"):
        with plant_inf(model.get_submodule(planted)), probe.attach(armed=armed):
            model(x)
        assert find_producer(probe.collect()).module == planted


def test_a_pass_through_output_made_under_inference_mode_is_measured_where_it_is_taken():
    class Block(nn.Module):  # the SiLU takes a tensor made before inference_mode, read first by lin
        def __init__(self):
            super().__init__()
            self.lin, self.act, self.out = nn.Linear(2, 2), nn.SiLU(), nn.Linear(2, 2)

        def forward(self, x):
            a = self.lin(x)
            return self.out(self.act(x)) + a

    block, x = Block(), torch.randn(3, 2)
    probe = Probe(block, "full")
    with torch.inference_mode(), probe.attach():
        block(x)
    readings = {r.module: r for r in probe.collect()}
    assert probe.errors == []
    assert readings["out"].input_value == pytest.approx(nn.functional.silu(x).sum().item())


def test_an_activation_that_makes_an_inf_finite_is_measured_where_its_output_is_taken():
    class Block(nn.Module):  # -inf made by plain code in the parent, then a ReLU turns it into 0
        def __init__(self):
            super().__init__()
            self.norm, self.act, self.lin = nn.LayerNorm(2), nn.ReLU(), nn.Linear(2, 2)
            nn.init.constant_(self.lin.weight, 3e38)
            nn.init.zeros_(self.lin.bias)

        def forward(self, x):
            t = torch.log(x - 0.5)
            self.norm(t)
            return self.lin(self.act(t))

    block = Block()
    probe = Probe(block, "full")
    with torch.no_grad(), probe.attach():
        out = block(torch.tensor([[0.5, 30.0]]))
    assert out.isinf().all()
    readings = probe.collect()
    lin = next(r for r in readings if r.module == "lin")
    assert lin.input_finite and not lin.output_finite  # the ReLU's output read as it is, not as its -inf input
    assert find_producer(readings).module == "lin"


def test_a_full_probe_with_pass_through_modules_runs_inside_a_fullgraph_compile():
    model = nn.Sequential(nn.Linear(2, 2), nn.SiLU(), nn.Linear(2, 2))
    x = torch.randn(3, 2)
    eager = Probe(model, "full")
    with torch.no_grad(), eager.attach():
        model(x)
    probe = Probe(model, "full")
    with torch.no_grad(), probe.attach():
        torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    torch._dynamo.reset()
    assert probe.errors == []
    compiled, expected = probe.collect(), eager.collect()
    expected_outputs = [(r.module, pytest.approx(r.output_value)) for r in expected]
    assert [(r.module, r.output_value) for r in compiled] == expected_outputs
    # traced, the SiLU's output is reduced where the last Linear takes it (no version counter to key it by)
    silu = nn.functional.silu(model[0](x)).sum().item()
    assert compiled[1].module == "2" and compiled[1].input_value == pytest.approx(silu)


@pytest.mark.parametrize(
    "compile_it",
    [
        pytest.param(
            "torch.compile",
            marks=pytest.mark.skipif(
                not installed.GLOBAL_HOOKS_TAKE_KWARGS,
                reason="before torch 2.6 a probe hooks each module: each attach recompiles (a known floor defect)",
            ),
        ),
        "module.compile",
        "a block compiled in place",
    ],
)
def test_an_armed_probe_on_compiled_code_names_the_producer_and_later_attaches_compile_nothing(compile_it):
    # arming registers a process-wide hook (which a trace cannot do), and a new one at each attach
    # would make dynamo recompile each time: a model that runs compiled code gets a hook per module
    block = nn.Sequential(nn.Linear(2, 2), nn.SiLU(), nn.Linear(2, 2))
    model = nn.Sequential(nn.Sequential(block), nn.Identity())  # the block is a grandchild
    with torch.no_grad():
        block[2].weight[0, 0] = math.inf
    x = torch.randn(3, 2)
    target, prefix = model, "0.0."
    if compile_it == "torch.compile":
        target, prefix = torch.compile(model, backend="aot_eager", fullgraph=True), "_orig_mod.0.0."
    elif compile_it == "module.compile":
        model.compile(backend="aot_eager", fullgraph=True)
    else:
        block.compile(backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    try:
        graphs = []
        for _ in range(10):  # more attaches than dynamo's 8 recompiles
            with torch.no_grad(), apply_probes(target, ProbeConfig("full", armed=True)) as handle:
                out = target(x)
            assert out[:, 0].isinf().all() and handle.state.errors == []
            readings = handle.state.collect()
            assert find_producer(readings).module == f"{prefix}2"
            assert [r.output_finite for r in readings if r.module == f"{prefix}0"] == [True]
            graphs.append(counters["stats"]["unique_graphs"])
        # the probe's first calls fill its caches (a recompile each); then no attach compiles again
        assert graphs[2:] == [graphs[2]] * 8 and not counters["graph_break"]
    finally:
        torch._dynamo.reset()


def test_a_probe_reads_with_the_signal_and_dtypes_it_has_at_each_collect():
    model = nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 2))
    probe = Probe(model, "full", signal="absmax")
    with torch.no_grad(), probe.attach():
        out = model(torch.tensor([1, 2]))
    # the integer indices are not read (an abs-max of them raised once and lost the reading)
    assert probe.errors == [] and probe.collect()[-1].output_value == out.abs().max().item()
    probe.signal = "finite"
    with torch.no_grad(), probe.attach():
        out = model(torch.tensor([1, 2]))
    assert probe.collect()[-1].output_value == pytest.approx(out.sum().item())


def test_a_pass_through_output_is_measured_again_where_an_abs_max_is_read():
    # an fp16 reading is the abs-max, which a SiLU changes: the next Linear reads its own input
    model = nn.Sequential(nn.Linear(2, 2), nn.SiLU(), nn.Linear(2, 2)).half()
    x = torch.randn(3, 2).half()
    probe = Probe(model, "full")
    with torch.no_grad(), probe.attach():
        model(x)
    silu = model[1](model[0](x))
    second = next(r for r in probe.collect() if r.module == "2")
    assert second.input_absmax == silu.abs().max().item() != model[0](x).abs().max().item()


def test_a_probe_can_watch_only_the_dtypes_that_overflow():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).half())
    probe = Probe(model, "full", measure_inputs=False, dtypes=(torch.float16,))
    with probe.attach():
        model[1](model[0](torch.ones(1, 2)).half())
    readings = probe.collect()
    # the fp32 Linear and the fp32 call are not measured; the fp16 one reads its abs-max
    assert [(r.module, r.dtype) for r in readings] == [("1", "float16")]
    expected = model[1](model[0](torch.ones(1, 2)).half()).abs().max().item()
    assert readings[0].output_absmax == pytest.approx(expected)


def test_finite_signal_is_one_op():
    from diffusion_debug.op_count import count_aten_ops
    from diffusion_debug.stats import finite_signal

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(3, 4).to(dtype)
        with count_aten_ops() as ops:
            finite_signal(x)
        assert ops.total == 1, (dtype, ops.counts)


def test_an_overflow_sentinel_watches_block_outputs_that_can_overflow_only():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)).half(), nn.Linear(2, 1).half())
    probe = Probe(model, "sentinel", measure_inputs=False, dtypes=OVERFLOW_DTYPES)
    with probe.attach():
        out = model[2](model[1](model[0](torch.ones(1, 2)).half()))
    readings = probe.collect()
    assert [(r.module, r.dtype, r.input_value) for r in readings] == [("1", "float16", None), ("2", "float16", None)]
    assert readings[1].output_absmax == out.abs().max().item()


class FloatStream(nn.Module):
    """A residual block whose stream stays float32 under float16 autocast (CLIP's layers: a float32 input plus
    a float16 matmul's output)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, x):
        return x + self.linear(x)


@pytest.mark.parametrize("fused", [True, False])
def test_a_sentinel_under_fp16_autocast_reads_a_float32_stream_against_float16s_max(fused):
    """Under ``torch.autocast(..., dtype=torch.float16)`` the block's output is float32, which an overflow
    sentinel (fp16 and fp8 outputs only) never read: the next matmul casts it to float16, so a value past
    65504 there is an Inf. With ``autocast=torch.float16`` it is read as an abs-max, named float16, its share
    of float16's max; without, as before, not at all."""
    model = nn.Sequential(FloatStream())
    x = torch.tensor([[40000.0, -1.0]])
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    assert out.dtype == torch.float32
    expected = out.abs().max().item()
    found = {}
    for autocast in (None, torch.float16):
        dtypes = OVERFLOW_DTYPES if autocast is None else (*OVERFLOW_DTYPES, torch.float32)
        probe = Probe(model, "sentinel", measure_inputs=False, dtypes=dtypes, fused=fused, autocast=autocast)
        with probe.attach(), torch.autocast("cpu", dtype=torch.float16):
            model(x)
        found[autocast] = [(r.module, r.dtype, r.output_absmax, r.dtype_max_fraction) for r in probe.collect()]
    assert found == {None: [], torch.float16: [("0", "float16", expected, expected / 65504.0)]}


# -- armed: one process-wide hook during the model's calls ---------------------------------------


def global_hooks():
    from torch.nn.modules import module

    return (
        dict(module._global_forward_hooks),
        dict(module._global_forward_hooks_with_kwargs),
        dict(module._global_forward_hooks_always_called),
        dict(module._global_forward_pre_hooks),
    )


@pytest.mark.skipif(
    not installed.GLOBAL_HOOKS_TAKE_KWARGS, reason="before torch 2.6 a probe hooks each module, unarmed"
)
def test_an_armed_probe_reads_what_hooks_on_every_module_read_and_leaves_nothing(net):
    torch.manual_seed(1)
    x = torch.randn(3, 4)
    before, modules_before = global_hooks(), hook_keys(net)
    rows = {}
    for armed in (False, True):
        probe = Probe(net, "full")
        with plant_inf(net.blocks[1].mlp[0]), probe.attach(armed=armed):
            net(x)
            during = sum(len(m._forward_hooks) for m in net.modules())
        rows[armed] = (probe.collect(), during)
        assert global_hooks() == before and hook_keys(net) == modules_before
    assert repr(rows[True][0]) == repr(rows[False][0])  # same readings, order and values (NaN != NaN)
    assert find_producer(rows[True][0]).module == "blocks.1.mlp.0"
    # one per watched module and per pass-through one (its output reads as its input), and the plant
    passing = [m for m in net.modules() if isinstance(m, PASS_THROUGH)]
    assert len(passing) == 3 and rows[False][1] == len(Probe(net, "full").module_names) + len(passing) + 1
    # the model and what it calls directly (embed, blocks.*, head), and the planted module: its own
    # hook changes its output, so it is read after that hook, by one of the probe's
    assert rows[True][1] == 1 + 5 + 1 + 1
    assert rows[True][1] < rows[False][1]


@pytest.mark.skipif(
    not installed.GLOBAL_HOOKS_TAKE_KWARGS, reason="before torch 2.6 a probe hooks each module, unarmed"
)
def test_an_armed_probe_reads_modules_called_without_the_model_and_disarms_when_a_call_raises():
    pipe = tiny_pipeline("sd")
    vae, latents = pipe.vae, torch.randn(1, 4, 8, 8)
    before = global_hooks()
    probe = Probe(vae, "full")
    with plant_inf(vae.post_quant_conv), probe.attach(armed=True):
        vae.decode(latents)  # calls post_quant_conv then decoder, never the VAE itself
    readings = probe.collect()
    assert readings[0].module == "post_quant_conv" and find_producer(readings).module == "post_quant_conv"
    assert readings[-1].module == "decoder"

    def fail(module, args):
        raise RuntimeError("planted")

    with probe.attach(armed=True), vae.decoder.up_blocks[0].register_forward_pre_hook(fail):
        with pytest.raises(RuntimeError, match="planted"):
            vae.decode(latents)
        assert global_hooks() == before  # disarmed on the way out, not only at detach
        torch.nn.Linear(2, 2)(torch.ones(1, 2))  # a later call elsewhere is not read
    assert all(r.module.startswith(("post_quant_conv", "decoder")) for r in probe.collect())
    assert global_hooks() == before


def test_a_full_probe_hooks_a_pass_through_module_it_shares_only_for_its_own_calls():
    """diffusers before 0.33 hands every ``get_activation("silu")`` one ``nn.SiLU``: a VAE's full
    probe hooked it from attach, and each UNet call of it ran that hook. A pass-through module placed
    under several modules is hooked for the length of the model's calls alone; the readings (and the
    producer of an Inf) are those of a twin whose activations are its own."""

    def net(act=None):
        torch.manual_seed(0)
        first, second = (act, act) if act is not None else (nn.SiLU(), nn.SiLU())
        return nn.Sequential(nn.Linear(4, 4), first, nn.Linear(4, 4), second, nn.Linear(4, 4))

    shared = nn.SiLU()
    other = nn.Sequential(nn.Linear(4, 4), shared)  # another model using the same instance
    x, rows, inside = torch.randn(2, 4), {}, []
    for model in (net(), net(shared)):
        probe = Probe(model, "full")
        look = model[2].register_forward_hook(lambda *args: inside.append(len(shared._forward_hooks)))
        with plant_inf(model[2]), probe.attach():
            assert not shared._forward_hooks  # out between the model's calls
            model(x)
            assert not shared._forward_hooks
            other(x)  # runs no hook of the probe's
        look.remove()
        rows[model[1] is shared] = probe.collect()
    assert inside == [0, 1]  # in during the call of the model that shares it
    assert repr(rows[True]) == repr(rows[False]) and find_producer(rows[True]).module == "2"
