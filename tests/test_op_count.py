"""The per-step cost as a count of aten ops (deterministic, unlike a timing): at real size on a GPU
the pipeline is launch-bound, so the ops the debugger adds are what it costs (DESIGN.md: at most 25
added ops per denoising step in default mode at SD1.5 topology in fp16), and the hooks it runs."""

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger, installed
from diffusion_debug.op_count import added_ops, count_aten_ops
from diffusion_debug.testing import tiny_pipeline

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import op_counts  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

# one worker under `pytest -n 2`: the session's fork server (conftest.py's `pipeline_forks`) starts once
FRESH = pytest.mark.xdist_group("pipeline_forks")


@pytest.fixture(scope="module")
def fresh_process(tmp_path_factory, pipeline_forks):
    """``fresh_process(code, *args)``: the JSON object that ``python -c code args`` (in the repository)
    prints last, run in a process of its own, as each count of Python calls is (what other tests leave
    in a process moves it), forked from tests/fork_server.py's (conftest.py's ``pipeline_forks``, shared
    with record/test_run_dir.py), which imported torch, diffusers and transformers once: not three
    processes importing them (~4.5 CPU-s each)."""
    folder = tmp_path_factory.mktemp("op-count-forks")

    def run(code: str, *args: str) -> dict:
        done = pipeline_forks.run(ROOT, dict(os.environ), list(args), code=code, outputs=folder)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.splitlines()[-1])

    return run


def test_the_counter_counts_kernels_not_views():
    x = torch.ones(4, 4)
    with count_aten_ops() as ops:
        y = x.view(16)[:8]
        z = (y * 2).sum()
    assert z.item() == 16 and ops.counts == {"aten.mul.Tensor": 1, "aten.sum.default": 1}
    assert added_ops(ops.counts, {"aten.mul.Tensor": 1}) == {"aten.sum.default": 1}


@pytest.mark.parametrize(
    "dtype, level",
    [(torch.float32, "advanced"), (torch.float32, "basic"), (torch.float16, "advanced")],
)
def test_default_mode_adds_at_most_25_ops_per_denoising_step(dtype, level):
    pipe = tiny_pipeline("sd", dtype=dtype)
    config = DebugConfig(level=level, output_dir=tempfile.mkdtemp(), stream_events=False, log_level="error")
    counts = op_counts.inference_ops(pipe, config)
    assert counts["added_ops_per_step"] <= 25, counts
    if dtype == torch.float32:  # the sentinel watches fp16 block outputs only: a float32 step is a few ops
        # 8 on this CPU: the step's one copy of its latents for the preview (six ops before the
        # previews were made at the report), the stack of its tensors and its sum, L2 norm, abs and
        # amax, the guidance gap, the one cat of the transfer (13 before, 12 pinned)
        assert counts["added_ops_per_step"] <= 8, counts


def test_the_training_debugger_adds_the_same_ops_whatever_the_model_size():
    """A monitored step adds 30 aten ops on any model: each is a kernel launch on a GPU, where the
    step's host time is what the debugger costs. 32 before a scalar loss's timestep buckets took its
    column in four ops, not six (train18). 36 before integer timesteps were bucketed by one
    ``bucketize``, the update sketch's float64 product promoted its squares itself and the module
    norms were one ``segment_reduce`` (tests/training/test_step_counts.py pins the Accelerate
    step's). 33 before the update sketch scaled its blocks'
    squares and summed them per module on the device (a float64 cast, a multiplication and a
    ``segment_reduce``: three launches, where the host read two floats per parameter into a list
    and then into numpy, and summed them there: 684 parameters, 390 modules on an SD UNet, a tenth
    of a millisecond of host time a step). 35 before the update sketch wrote into two buffers
    that take turns (its stack of the kept values and the change: one op) and the sketch's float32
    squares went into the transfer's ``cat`` as they are (a float64 copy first). 38 before integer timesteps
    were bucketed in integers (a float64 copy, a floor and a cast back), 46 before the norms'
    non-finite check was one comparison (``isfinite`` is four ops) and the loss's two, a
    one-micro-step loss was its own mean (a ``mean`` and a division), and the update sketch summed
    its blocks in one ``segment_reduce``
    (an ``index_add_`` into zeros). 60 before the step row shared its float64 norms
    and their squares (the global norm, the module norms and the transfer each made their own),
    took its NaN and infinity from made-once constants (a scalar op each, four to five a step), the
    timestep buckets were added in one ``index_add_`` of a (3, samples) stack (three before), and a
    ``None`` gradient's zero stand-in was made once."""
    from diffusers import UNet2DConditionModel

    small = tiny_pipeline("sd").unet
    with torch.random.fork_rng():
        torch.manual_seed(0)
        # twice the layers and wider blocks: more parameters and modules, the same monitor ops
        larger = UNet2DConditionModel(
            sample_size=8,
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
            block_out_channels=(32, 96),
            layers_per_block=2,
            cross_attention_dim=32,
            attention_head_dim=8,
            norm_num_groups=32,
        )
    small_ops, larger_ops = op_counts.training_ops(small), op_counts.training_ops(larger)
    assert small_ops["parameters"] < larger_ops["parameters"]
    assert small_ops["added_ops_per_step"] == larger_ops["added_ops_per_step"] <= 30, (small_ops, larger_ops)


def test_a_full_probe_adds_one_reduction_per_tensor_and_nothing_else():
    """What a full probe costs on a CPU is its number of op entries (benchmarks/RESULTS.md,
    2026-11-27): on the tiny SD UNet, 265 float32 sums, one per distinct tensor crossing a module
    boundary (a SiLU's or a dropout's output reads as its input), and no other op."""
    from diffusion_debug.probes import Probe

    pipe = tiny_pipeline("sd")
    unet, hidden = pipe.unet, pipe.text_encoder.config.hidden_size
    x, context = torch.randn(2, 4, 8, 8), torch.randn(2, 77, hidden)
    with torch.no_grad(), count_aten_ops() as plain:
        unet(x, 10, encoder_hidden_states=context)
    for armed in (False, True):
        probe = Probe(unet, "full")
        with torch.no_grad(), count_aten_ops() as ops, probe.attach(armed=armed):
            unet(x, 10, encoder_hidden_states=context)
        readings = probe.collect()
        assert added_ops(ops.counts, plain.counts) == {"aten.sum.default": 265}, armed
        assert len(readings) == 224 and all(r.input_finite and r.output_finite for r in readings)


def shaped(kind, dtype):
    from benchmarks.models import sd15_shaped_pipeline

    return tiny_pipeline("sd", dtype=dtype) if kind == "tiny" else sd15_shaped_pipeline(dtype)


def quiet_config():
    return DebugConfig(output_dir=tempfile.mkdtemp(), stream_events=False, log_level="error")


@pytest.mark.parametrize("kind", ["tiny", "sd15_shaped"])
def test_an_fp16_unet_sentinel_adds_one_op_a_step_it_reads_and_none_at_the_others(kind):
    """DESIGN: <= 25 added ops per denoising step at SD1.5 topology in fp16. The sentinel reads every
    fp16 block output of the UNet (12 distinct tensors on the tiny pipeline, 22 at SD1.5 topology,
    one linalg_vector_norm each before they were taken together: 25 and 35 added ops a step, then 14
    and 14): one _foreach_norm a step it reads on a GPU, the only op an fp16 step adds beyond a bf16
    one. On the CPU these tests run on, the same abs-maxes are _foreach_abs then _foreach_max (the CPU
    norm takes nine times as long; probes/fused.py): two ops, and their stack into the step's one
    transfer, 11 a step (15 before the step's latent preview was made at the report, one copy a
    step instead of six ops, and its scalars joined the transfer without a stack of their own).
    It reads a run's steps 0, 1, then every 4th (components/sentinel_pace.py; every step before):
    step 4 adds its 3 ops, step 2 none beyond a bf16 step's, and 20 steps 8.9 a step on this CPU
    (11 before; on a GPU 7.6, 9 before)."""
    fp16 = shaped(kind, torch.float16)
    read = op_counts.inference_ops(fp16, quiet_config(), short=4, long=5)  # step 4
    unread = op_counts.inference_ops(fp16, quiet_config(), short=2, long=3)  # step 2
    bf16 = op_counts.inference_ops(shaped(kind, torch.bfloat16), quiet_config())
    assert read["added_ops_per_step"] == bf16["added_ops_per_step"] + 3 <= 11, (read, bf16)
    assert read["added_by_op"]["aten.stack.default"] == bf16["added_by_op"]["aten.stack.default"] + 1
    assert read["added_by_op"]["aten._foreach_abs.default"] == read["added_by_op"]["aten._foreach_max.default"] == 1
    assert "aten._foreach_norm.Scalar" not in read["added_by_op"]
    assert unread["added_by_op"] == bf16["added_by_op"], (unread, bf16)
    # the step's own statistics (latents, denoiser output): the L2 norm, and on this CPU the abs-max
    # as abs then amax (a GPU's inf-norm along dims is one kernel; the CPU's loops per element)
    for counts in (read, unread, bf16):
        assert counts["added_by_op"]["aten.linalg_vector_norm.default"] == 1, counts
        assert counts["added_by_op"]["aten.amax.default"] == counts["added_by_op"]["aten.abs.default"] == 1, counts


def test_a_first_calls_full_probes_on_fp16_components_take_their_abs_maxes_together():
    """At the default the first call of a pipeline's debuggers reads an fp16 VAE and text encoder
    with full probes. Their abs-maxes are held and taken together, as the sentinel's are: a 1-step
    call of tiny SD in fp16 adds 34 ops (165 when each tensor had its own linalg_vector_norm: 138 of
    them; 37 before the step's statistics took their abs-max as abs then amax on a CPU); 29 (33 on
    torch 2.13 before) once the text encoder's output abs-max came from its held outputs (its last
    module's output: no norm of its own, and its probe's one flushed vector read with no join)
    rather than a linalg_vector_norm and a float64 join at each of its two calls; 26 once those two
    calls (the prompt and the negative prompt) were taken together, one flush for both."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)

    def call():
        pipe("a photo of a cat", num_inference_steps=1, generator=torch.Generator().manual_seed(0), output_type="np")

    with count_aten_ops() as plain:
        call()
    debugger = DiffusionModelDebugger(pipe, quiet_config())
    with count_aten_ops() as ops, debugger:
        levels = dict(debugger._steps.probes.levels)
        call()
    debugger.close()
    assert levels == {"unet": "sentinel", "text_encoder": "full", "vae": "full"}
    added = added_ops(ops.counts, plain.counts)
    assert added["aten.linalg_vector_norm.default"] == 1 and sum(added.values()) <= 26, added
    assert added["aten._foreach_abs.default"] == added["aten._foreach_max.default"] == 3, added


@pytest.mark.parametrize("kind", ["tiny", "sd15_shaped"])
def test_a_reused_debugger_runs_two_hooks_a_component_call_and_one_a_watched_block(kind):
    """DESIGN's bound on hooks fired per call, once a reused debugger's first call is behind it (its
    full probes on the VAE and text encoder): each component call runs 2 hooks (the call site's pre
    and post hook; the post hook, ``always_call``, also sees an OOM: 4 while the OOM watch had its
    own two), and each block of an fp16 component's sentinel one; a bf16 or fp32 component has no
    sentinel. A component called once per image watches the blocks that hold modules, and
    post_quant_conv, which the VAE's decode calls outside its decoder
    (``component_probes.inner_blocks``); the UNet's ``time_proj`` (diffusers' ``Timesteps``, made in
    float32 whatever the dtype) is none of the fp16 blocks (``component_probes.overflow_blocks``).
    A mid block is one block (``overflow_blocks``), the UNet's sentinel leaves out its single
    modules but its last (``component_probes.denoiser_blocks``: conv_in and conv_norm_out, not
    conv_out), a text encoder's its embeddings (lookups), and its layer stack is read at its last
    layer (``component_probes.stack_ends``: a residual stream). Tiny SD in fp16, a 1-step call: 22 =
    the UNet 2 + 7, the text encoder twice 2 + 1, the VAE decode 2 + 5 (9 a step the UNet's sentinel
    reads, 2 one it does not: ``components.sentinel_pace``, steps 0, 1, 4, 8...; counted here over
    steps 1 and 2, 5.5 a step; every step 9 before); at SD1.5 topology 27 (13 and 2 a step, 7.5 over
    steps 1 and 2). 24 and 49 while each text encoder layer was a block (2 and 12 a call). 32 and
    57 (13 and 17 a step) while each mid block's resnets and attentions
    were blocks of their own, the UNet's conv_in and conv_norm_out and a text encoder's embeddings
    watched; 33 and 58 (14 and 18 a step) while the UNet's sentinel hooked time_proj, 41 and 66
    (16 and 20 a step) while the OOM watch hooked each call apart, 46 and 71 while those sentinels
    also watched the single modules at either end (conv_in, conv_norm_out, conv_out,
    final_layer_norm). 26 and 31 (measures 18 and 23) since the ends after a call site's last block are
    watched again (vae36: the VAE decoder's conv_norm_out and conv_out, each text encoder's final_layer_norm):
    a near-max or NaN/Inf there is named by the sentinel's reading, where it took the output check's replay."""
    from diffusion_debug.diffusion.components.component_probes import denoiser_blocks, inner_blocks, overflow_blocks
    from diffusion_debug.diffusion.components.inventory import find_components
    from diffusion_debug.probes import probed_modules

    fp16, bf16 = shaped(kind, torch.float16), shaped(kind, torch.bfloat16)
    components = {c.name: c for c in find_components(fp16)}
    unet_blocks = [name for name, _ in probed_modules(components["unet"].module, "sentinel")]
    mid = [name for name in unet_blocks if name.startswith("mid_block.")]
    assert len(mid) == 3 and [name for name, _ in overflow_blocks(components["unet"].module)] == [
        "mid_block" if name == mid[0] else name for name in unet_blocks if name != "time_proj" and name not in mid[1:]
    ]

    def blocks(name, prefixes=("",)):
        found = overflow_blocks(components[name].module)
        found = denoiser_blocks(found) if name == "unet" else inner_blocks(components[name], found)
        return len([block for block, _ in found if block.startswith(prefixes)])

    unet, text = blocks("unet"), blocks("text_encoder")
    vae = blocks("vae", ("decoder.", "post_quant_conv"))  # decode calls both
    hooks = op_counts.inference_hooks(fp16, quiet_config())
    assert hooks["hooks_per_call"] == (2 + unet) + 2 * (2 + text) + (2 + vae) == {"tiny": 26}.get(kind, 31), hooks
    # steps 1 (read) and 2 (not read: the sentinel's hooks are out, the call sites' 2 alone)
    assert hooks["hooks_per_step"] == 2 + unet / 2 and hooks["measures_per_step"] == unet / 2
    # a reading a watched block call (the probe readings of the user_path table): 24 and 49 before,
    # 16 and 41 while each text encoder layer was read
    assert hooks["measures_per_call"] == unet + 2 * text + vae == {"tiny": 18}.get(kind, 23), hooks
    assert hooks["first_call_hooks"] > hooks["hooks_per_call"]  # the first call's full probes
    plain = op_counts.inference_hooks(bf16, quiet_config())  # no sentinel: the call sites' hooks only
    assert (plain["hooks_per_call"], plain["hooks_per_step"], plain["measures_per_call"]) == (8, 2, 0)


def test_an_img2img_encode_s_sentinel_watches_its_end_modules_with_no_added_op(monkeypatch):
    """An img2img call encodes its image: the VAE's ``encode`` site (its ``encoder``, then ``quant_conv`` outside
    it) is watched as the decode's is (``component_probes.inner_blocks``): its blocks that hold modules (3 down
    blocks, the mid block as one) and the single modules after its last one (``conv_norm_out``, ``conv_out``: its
    end, vae36), not ``conv_in`` before them; ``quant_conv``, outside the site. Tiny img2img in fp16, a reused
    debugger's 1-step call reading every group: 35 hooks (tiny SD's 26, the encode site's 2 and its 7 modules), 25
    readings (18 and 7); in bf16 10 (the call sites' alone: 8 and the encode's 2). Ops of that call: 30 added in
    fp16 (tiny SD's 25, the encode's held outputs flushed on their own: one stack, abs and max), the same with
    the encoder's and decoder's end modules left out (their outputs join the fused reduction: no op of their
    own); 19 in bf16 (tiny SD's 18 and the encode output's norm)."""
    from diffusion_debug.diffusion.components import component_probes
    from diffusion_debug.diffusion.components.inventory import find_components
    from diffusion_debug.testing.zoo import ZOO_CALLS

    def encoder_blocks(pipe):
        vae = next(c for c in find_components(pipe) if c.name == "vae")
        found = component_probes.inner_blocks(vae, component_probes.overflow_blocks(vae.module))
        return [name for name, _ in found if name.startswith(("encoder.", "quant_conv"))]

    def counts(dtype, inner_blocks=component_probes.inner_blocks):
        pipe = tiny_pipeline("img2img", dtype=dtype)
        call = ZOO_CALLS["img2img"][0]()
        monkeypatch.setattr(component_probes, "inner_blocks", inner_blocks)
        hooks = op_counts.inference_hooks(pipe, quiet_config(), **call)

        def run():
            pipe(num_inference_steps=1, generator=torch.Generator().manual_seed(0), output_type="np", **call)

        with count_aten_ops() as plain:
            run()
        debugger = DiffusionModelDebugger(pipe, quiet_config())
        with debugger:
            run()
        with count_aten_ops() as ops, debugger:  # its 2nd run: every group read
            run()
        debugger.close()
        monkeypatch.undo()
        return hooks, sum(added_ops(ops.counts, plain.counts).values()), pipe

    fp16, fp16_ops, pipe = counts(torch.float16)
    encoder = encoder_blocks(pipe)
    ends = ["encoder.conv_norm_out", "encoder.conv_out"]
    assert encoder == [*(f"encoder.down_blocks.{i}" for i in range(3)), "encoder.mid_block", *ends, "quant_conv"]
    per_call = (fp16["hooks_per_call"], fp16["measures_per_call"])
    assert per_call == (26 + 2 + len(encoder), 18 + len(encoder)) == (35, 25), fp16  # tiny SD's, the encode's
    assert (fp16["hooks_per_step"], fp16["measures_per_step"]) == (5.5, 3.5), fp16  # tiny SD's: the steps unchanged
    bf16, bf16_ops, _ = counts(torch.bfloat16)
    assert (bf16["hooks_per_call"], bf16["measures_per_call"], bf16["hooks_per_step"]) == (10, 0, 2), bf16
    original = component_probes.inner_blocks

    def without_ends(component, blocks):  # vae36's end modules left out: the blocks' list before it
        return [(name, block) for name, block in original(component, blocks) if not name.endswith(END_MODULES)]

    unended, unended_ops, _ = counts(torch.float16, without_ends)
    assert fp16["hooks_per_call"] - unended["hooks_per_call"] == 4  # the encoder's 2, the decoder's 2
    assert (fp16_ops, unended_ops, bf16_ops) == (30, 30, 19)


END_MODULES = ("coder.conv_norm_out", "coder.conv_out")
"""The VAE encoder's and decoder's end modules (test_an_img2img_encode_s_sentinel_watches_its_end_modules...)."""


def test_a_first_calls_full_probes_on_the_vae_run_no_hook_in_the_unet_s_steps():
    """A first call reads the VAE and text encoder with full probes; on torch before 2.6 (no global
    hook taking kwargs: a hook per module) the full probe's pass-through hooks (``Probe._pass_on``)
    went on the modules at attach, and diffusers before 0.33 hands every ``get_activation("silu")``
    one shared ``nn.SiLU``: the VAE's hook on it ran at each of the UNet's SiLU calls, 26 a tiny SD
    step (186.5 Python calls a step: 304 added where a later call adds 117.5, on the floor stack,
    torch 2.5.1 and diffusers 0.32.2; 68 hooks and 610 calls a step at SD1.5 topology). Those hooks
    are now in for the length of the VAE's calls only (``Probe._register_passing``): a first call's
    step runs the hooks a later call's does (the call site's 2 and the sentinel's blocks), 122
    Python calls added a step on the floor stack (131 at SD1.5 topology). An fp32 first call reads
    no component fully: 92 either way."""
    import gc
    from collections import Counter

    def first_call_hooks(steps: int) -> Counter:
        pipe = shaped("tiny", torch.float16)
        debugger = DiffusionModelDebugger(pipe, quiet_config())

        def run() -> None:
            with debugger:
                pipe("a photo of a cat", num_inference_steps=steps, generator=torch.Generator().manual_seed(0))

        gc.collect()  # an earlier debugger (a cycle) collected in the counted call: its finalizers' callbacks counted
        try:
            return op_counts.hook_calls(run)
        finally:
            debugger.close()

    per_step = first_call_hooks(3)
    per_step.subtract(first_call_hooks(1))
    per_step.pop(op_counts.READINGS, None)
    assert {name: n / 2 for name, n in per_step.items() if n} == {
        "call_hooks.<locals>.pre_hook": 1,
        "call_hooks.<locals>.post_hook": 1,
        "Probe._read_output": 3.5,  # the UNet's sentinel: 7 blocks, steps 1 and 2 (read, not read)
    }


def test_hook_calls_counts_no_finalizer_the_garbage_collector_runs_inside_a_module_call():
    """A collection the interpreter starts inside ``nn.Module``'s call (an allocation there) runs the
    finalizers of the package's garbage (a closed debugger's weakref callbacks, ``__del__``) with that
    call's frame as their caller: ``hook_calls`` counted them as hooks. A CI run counted 4 in a reused bf16
    PixArt debugger's 2-step call (14 where 10), once the same test's closed fp16 pipeline was collected."""
    import functools
    import gc
    import weakref

    from diffusion_debug.diffusion.setup_checks import _forget_tokenizer  # a package weakref callback

    class Cycle:
        pass

    space = {"gc": gc}  # a hook whose frame is nn.Module's file: the collection starts in a module call
    exec(compile("def collect(module, args):\n    gc.collect()\n", torch.nn.modules.module.__file__, "exec"), space)
    linear = torch.nn.Linear(2, 2)
    linear.register_forward_pre_hook(space["collect"])
    enabled = gc.isenabled()
    gc.disable()  # the cycle stays until the hook's collection
    try:
        garbage = Cycle()
        garbage.self = garbage
        ref = weakref.ref(garbage, functools.partial(_forget_tokenizer, -1))
        del garbage
        counts = op_counts.hook_calls(lambda: linear(torch.ones(2)))
    finally:
        if enabled:
            gc.enable()
    assert ref() is None and dict(counts) == {}, counts


def test_python_calls_counts_no_finalizer_a_collection_would_run_during_the_counted_call():
    """The cyclic collector starts when allocations say, wherever that is: inside a counted call it
    runs the finalizers of garbage (a closed debugger's weakref callbacks, ``__del__``), whose calls
    were counted as the call's (the Python-call pins read a difference of two such counts).
    ``python_calls`` collects first and keeps the collector off while it counts: a run that leaves a
    cycle and then allocates counts what it counts with the collector off."""
    import gc

    class Cycle:
        def __del__(self) -> None:
            sum(abs(i) for i in range(3))  # a finalizer's calls: the generator expression's frames

    def run() -> None:
        garbage = Cycle()
        garbage.self = garbage
        del garbage
        for _ in range(50):
            torch.nn.Linear(1, 1)  # a module's allocations pass any collection threshold

    threshold, enabled = gc.get_threshold(), gc.isenabled()
    gc.disable()
    try:
        quiet = op_counts.python_calls(run)
        gc.enable()
        gc.set_threshold(1)  # a collection at the first allocation after the cycle
        assert op_counts.python_calls(run) == quiet
    finally:
        gc.set_threshold(*threshold)
        gc.enable() if enabled else gc.disable()
        gc.collect()


@pytest.mark.parametrize("kind", ["flux", "pixart"])
def test_an_fp16_dit_runs_one_sentinel_hook_a_block_list_a_step(kind):
    """A transformer denoiser's repeated block lists are residual streams, each read at its last
    block (``component_probes.stack_ends``, ``repeated``): a tiny fp16 Flux with 3 dual-stream and 3
    single-stream blocks runs 9 hooks a step (the call site's 2, its embedders, norm_out and proj_out
    5, a block list's last block 2; 13 while each block was read: 11 readings a step, now 7); a
    PixArt with 3 blocks 8 (10 before; 6 readings, 8 before), 29 a 2-step call (33 before). At real
    size Flux.1-dev's 19 + 38 blocks are 2 hooks a step where they were 57, PixArt-alpha's 28 one.
    bf16: no sentinel, the call site's 2 hooks a step. A call 4 hooks more since the VAE decoder's and the text
    encoders' end modules are watched (vae36; Flux 23 where 19, PixArt 33 where 29: conv_norm_out and conv_out,
    each encoder's final_layer_norm)."""
    from diffusion_debug.testing.flux import FLUX_CALL, deeper
    from diffusion_debug.testing.zoo import ZOO_CALLS

    layers = {"num_layers": 3, "num_single_layers": 3} if kind == "flux" else {"num_layers": 3}
    call = FLUX_CALL[0]() if kind == "flux" else ZOO_CALLS["pixart"][0]()
    short = 1 if kind == "flux" else 2  # (PixArt's default scheduler cannot run 1 step)
    counts = {}
    for dtype in (torch.float16, torch.bfloat16):
        pipe = deeper(tiny_pipeline(kind, dtype=dtype), **layers)
        counts[dtype] = op_counts.inference_hooks(pipe, quiet_config(), short=short, long=short + 2, **call)
    fp16, bf16 = counts[torch.float16], counts[torch.bfloat16]
    if kind == "flux":
        assert (fp16["hooks_per_step"], fp16["measures_per_step"], fp16["hooks_per_call"]) == (9, 7, 23), fp16
    else:  # (the floor stack, torch 2.5.1 and diffusers 0.32.2, runs 61 a call, 56 before vae36: one more component
        # call, and per-module probe hooks where torch before 2.6 has no global hook taking kwargs; a step the same 8)
        per_call = 33 if installed.GLOBAL_HOOKS_TAKE_KWARGS else 61
        assert (fp16["hooks_per_step"], fp16["measures_per_step"], fp16["hooks_per_call"]) == (8, 6, per_call), fp16
    named = (bf16["by_hook"], bf16["first_by_hook"], bf16)  # a count that moves names its hooks
    assert (bf16["hooks_per_step"], bf16["measures_per_step"]) == (2, 0), named


@pytest.mark.skipif(
    not installed.GLOBAL_HOOKS_TAKE_KWARGS, reason="before torch 2.6 a probe hooks each module: other counts"
)
# 121 and 225 until a CFG call's two text encoder calls were read together (one probe take, one flush and one
# host read for both, their readings cut per call): 329 in fp16 on tiny SD, 433 at SD1.5 topology, fp32 and bf16
# unchanged at 210 and 218
# 120 and 224 once set_timesteps read nothing (a Schedule made and read with the first step: 2 calls in every
# dtype, where a float() made none) and fp32's two encoder outputs took one fused abs-max (1 fewer in fp32 and
# bf16): 211 in fp32, 219 in bf16, 331 in fp16 on tiny SD; 211 and 435 at SD1.5 topology
# 112 and 136 once an fp16 text encoder's sentinel read its layer stack at its last layer (component_probes.
# stack_ends; 4 calls a hook: torch's inner, is_compiling, is_scripting and Probe._read_output): 2 hooks fewer a
# CFG call on tiny SD (2 layers), 22 at SD1.5 topology (12): 323 in fp16 on tiny SD, 347 at SD1.5 topology, fp32
# and bf16 unchanged at 211 and 219
@FRESH
# 112 and 136, 12 and 12 while the UNet's step 0, the VAE's and the text encoder's sentinels read the same runs
# (a call read read all three): 56 and 76, 10 and 10 once each read runs of its own (sentinel_pace.SENTINEL_PHASES)
# each group's own read call pinned too (the VAE's 49 and 53, the text encoder's 32 and 32): the costliest alone
# (``float16``, the UNet's) left the others' read paths unpinned, where the call reading all three pinned them all;
# the VAE's 56 and 60, the text encoder's 38 and 38 once the sites' end modules are watched (vae36: 2 hooks a VAE
# decode, 1 a text encoder call, ~3.5 and 3 Python calls each; a call no group reads unchanged)
@pytest.mark.parametrize(
    "kind, fp16_over_fp32, not_read_over_fp32, groups_over_fp32",
    [
        ("tiny", 56, 10, {"steps": 56, "decoders": 56, "encoders": 38}),
        ("sd15_shaped", 76, 10, {"steps": 76, "decoders": 60, "encoders": 38}),
    ],
)
def test_a_reused_debugger_adds_about_as_many_python_calls_in_fp16_and_bf16_as_in_fp32(
    kind, fp16_over_fp32, not_read_over_fp32, groups_over_fp32, fresh_process
):
    """On a CPU at tiny size a reused debugger's fixed cost per 1-step call is Python, counted here
    (deterministic; benchmarks/RESULTS.md, 2026-11-28). Events streamed, log level error: 1268
    calls added in fp32 and bf16 alike (the same path: output checks, no probe; 1554 before the
    guards were kept per place, the call sites' hooks put in without torch's handles, a few
    per-call generators made loops and getattr_static a walk of the MRO), 1642 in fp16 on tiny
    SD, 1801 at SD1.5 topology; then 14 fewer in every dtype once the busy check kept the
    pipeline's ``__call__`` frame for the call and a memory sample stopped asking
    ``torch.cuda.is_available()``, and about 30 fewer in fp16 once the sentinel's reads kept no
    key and weak reference per block output (probes/fused.py: HeldAbsmax.positions). At that
    merge: 1289 in fp32, 1290 in bf16, 1640 in fp16 on tiny SD and 1793 at SD1.5 topology (the
    host copies' runs per dtype added about 25): what fp16 adds over fp32 is its sentinel's
    blocks (30 a call on tiny SD, 55 at SD1.5 topology), each torch's hook dispatch (3 calls)
    and one of ours, and their reading. About 94 fewer in every dtype once the step's preview was
    made at the report and a clean step's checks read its readings once: 1192 in fp32, 1193 in
    bf16, 1544 in fp16 on tiny SD and 1697 at SD1.5 topology. About 320 fewer in every dtype once
    the run's guards were found by the dict's own lookup, a step row's shapes copied without a
    call each, the JSON encoder made once, the per-step comprehensions made loops, a memory sample
    read ``statm`` without psutil, the call sites found their device from the modules' dicts at
    attach (not ``parameters()``'s generators) and read a call's output tensor without the nested
    walk, and a watched method's dispatcher found its patch with no Python call; about 20 fewer
    in fp16 once a VAE or text encoder's sentinel left out the single modules at either end of a
    call site: 870 in fp32, 871 in bf16, 1193 in fp16 on tiny SD and 1317 at SD1.5 topology (861,
    862, 1188 and 1312 on torch 2.13 once full probes' hooks were cut). Then, in every dtype, 73
    fewer once the OOM watch's two hooks a component call were folded into the call sites' (their
    post hook ``always_call``) and a step row took the memory sample its denoiser call ended
    with, and about 80 fewer once a call site's role was read once (a plan per site), a clean
    call's readings read once before the localiser (none without a probe) and its abs-max read
    as it is or stacked (no float64 join where the values share a dtype; a probe's values and
    bf16/fp16 decoded images still join): 706 in fp32, 714 in bf16, 1058 in fp16 on tiny SD;
    689, 697 and 1182 at SD1.5 topology (1060 and 1184 in fp16 once a probe's take asked whether
    a module was called twice). fp16's sentinel readings take the joined read, so what fp16 adds
    over fp32 stays 354 and 495. Then a reused debugger kept its probes and its call sites' hook
    plans across attaches (the tree unchanged), an fp16 UNet's sentinel left out ``time_proj`` (made
    in float32: never read), a block's one-tensor tuple took the fast path, a patch copied its
    method's names in one call, probe_levels named no dtype and a take emptied its batch in place:
    664 in fp32, 672 in bf16, 884 in fp16 on tiny SD; 647, 655 and 985 at SD1.5 topology, where
    main measured 709, 717, 1063 and 692, 700, 1187 the same day and way. What fp16 adds over
    fp32: 220 and 338 (354 and 495 before). Then, in every dtype, the guards every call takes made
    a ``try`` (46 fewer), the static checks memoised on what they read (19), a memory sample's
    CUDA check and a CPU call's peak read in place (9) and a clean event's empty error queue read
    in place (12), a streamed line made by json's C encoder alone (14) and a pending step or an
    empty list of findings read in place (8): 556 in fp32, 564 in bf16, 776 in fp16 on tiny SD;
    541, 549 and 879 at SD1.5 topology (fp16 over fp32 still 220 and 338). Then the counted call
    predicts v (``call_cost.one_step``): the tiny pipeline's epsilon call had warned
    ``latent_divergence`` every call, and the count held that warning (15 calls, folded into the
    run's first): 542 in fp32, 550 in bf16, 762 in fp16 on tiny SD; 542 and 880 at SD1.5 topology.
    Then, in every dtype, a reused debugger's five method patches were made once and put back at
    each attach (56 fewer: ``PipelinePatches``, still removed at every detach), the busy check asked
    ``is_dynamo_compiling()`` and torch's flag (``is_compiling()`` is two calls: 19), and the call
    sites' hooks went in by one ``ForwardHooks`` with their hook pairs made once (30); in fp16 a
    probe taken with nothing queued built nothing and a sentinel's hooks went in without a
    comprehension (9 on tiny SD): 437 in fp32, 445 in bf16, 644 in fp16 on tiny SD; 437 and 762 at
    SD1.5 topology (fp16 over fp32: 207 and 325; bf16 over fp32 stays 8: a bound in calls, where
    2% of fp32 was 8.7). Then 8 fewer in every dtype once the busy check looked for the pipeline's
    kept frame itself: 429, 437 and 636 on tiny SD; 429 and 754 at SD1.5 topology. Then a reused
    debugger's attach read the tree memo's values without a call (``TreeMemo.current``), the probe
    levels, dtypes and call sites' devices in loops, and put the fp16 components' sentinel hooks in
    by one ``ForwardHooks``; empty probes were passed over by one ``reset_probes``, a call's time
    and memory read in its post-hook, detach's frame, error queue and clean exit and a run's start
    read in place: 362, 370 and 538 on tiny SD; 362 and 656 at SD1.5 topology (428, 436, 635, 428
    and 753 measured the same way before; fp16 over fp32: 176 and 294). Then an fp16 text
    encoder's output abs-max was taken with its sentinel's block outputs (``Probe.hold``: no norm
    of its own, no float64 join): 16 fewer in fp16, 522 on tiny SD and 640 at SD1.5 topology
    (fp16 over fp32: 160 and 278). Then, in every dtype, the policy read the sink's queue as each
    event ended (no wrapper a component output, step and ``encode_prompt``), a step was read with
    its denoiser outputs (no ``dataclasses.replace``) and a DDIM scheduler's missing ``step_index``
    and ``sigmas`` from its dict (no ``ConfigMixin.__getattr__``), a clean step entered no null
    context, a row's statistics were made in one call and its nested dicts copied without a call
    each, the tree keys compared inline, the run's inputs read without comprehensions, a
    pipeline's missing tokenizers without ``ConfigMixin.__getattr__``, the latents' finiteness and
    the previews' schedule inline and an unprobed step's suspects not looked for (52 of the
    debugger's own in fp32 and bf16, 50 in fp16); and a patched class method's dispatcher carried
    its method's signature, so diffusers' ``inspect.signature(scheduler.step)`` at every call
    unwraps nothing (102 fewer in diffusers' own reads): 208 in fp32, 216 in bf16, 370 in fp16 on
    tiny SD; 208 and 488 at SD1.5 topology (fp16 over fp32: 162 and 280). Then the fp16 sentinel
    took a mid block as one block and left out the UNet's conv_in and conv_norm_out and a text
    encoder's embeddings (8 hooks fewer a tiny SD call, 4 Python calls each), and held a down
    block's tuple of hidden states and residuals in its hook's frame (``Probe._hold_tuple``): 41
    fewer in fp16 on tiny SD, 55 at SD1.5 topology (measured alone on its branch: 522 -> 481 and
    640 -> 585); with the compiled VAE decode's watch (2 more a call in every dtype): 210 in fp32,
    218 in bf16, 331 in fp16 on tiny SD; 210 and 435 at SD1.5 topology (fp16 over fp32: 121 and
    225). Counted in a process of its own: in the fresh-clone suite of 2026-11-29 the same tree
    counted 6 more in every dtype (216, 441, 224 at SD1.5 topology) after what other tests on that
    worker had left in the process. One such leftover found: ``benchmarks.call_parts.measure`` took
    its timing wrappers off in the order they went on, and left one on ``step_values.measure_call``
    (two parts time it) at each run: one Python call more a watched call per run, 212 after
    test_benchmarks' two call_parts tests in one process (210 once they come off in reverse). The
    rest of the +6 was not reproduced: tests/diffusion, tests/record, tests/report, tests/jobs but
    its launches, this file's other tests and the whole suite's collection, each run in one process
    before the count, and a pytest-xdist worker itself, leave 210. A count over its pin shows the
    functions whose calls it added (``added_python_calls(sites=True)``). Then an fp16 UNet's
    sentinel read a run's step 0 at a debugger's 1st, 2nd, 5th, 9th... runs only (sentinel_pace):
    both fp16 calls are pinned, one whose step 0 is read (``float16``, as before: 322 on tiny SD,
    346 at SD1.5 topology) and one not read (``float16_not_read``: 286 and 290, a call's 7 and
    11 hooks fewer); the fewest of three had counted a call not read from then on (322 -> 286). Then
    the sentinels of the fp16 VAE and text encoder read the same runs (and while warm; their outputs
    are checked at every call): a call not read runs the call sites' hooks alone, as a bf16 call does
    (7 hooks fewer on tiny SD, 8 at SD1.5 topology, and their readings): 256 on both (45 over fp32,
    37 over bf16: the pace's hooks taken out and put back), where a read call stays 322 and 346. Then
    an attach before a run not read left its sentinels' hooks out (``SentinelPace.left_out``: none put
    in, none taken out), such a run's text encoder and VAE calls were checked at their output alone as
    an unprobed component's (no hold, take or flush) and an fp16 or bf16 decoded image's extremes were
    read with its float32 count by one stack (no float64 join): counted in one process as the test
    does, 258 -> 224 in fp16 not read (fp32 213 -> 214, bf16 221 -> 214, fp16 read 324 -> 324); fp16
    not read over fp32: 10 on both. Then each group of sentinels read runs of its own from a debugger's
    3rd (sentinel_pace.SENTINEL_PHASES: the text encoder's 3, 7..., the UNet's step 0 5, 9..., the VAE's 6,
    10...; runs 1 and 2 read all three): ``float16`` is now the costliest of the three calls that read one
    group (``added_read_by_group``; the UNet's: 268 on tiny SD, 288 at SD1.5 topology; the VAE's 261 and
    265, the text encoder's 244 and 244) where it was the call that read all three (324 and 346, a
    debugger's 2nd call still), and ``float16_not_read`` a call no group reads (its 4th: 222 on both; the
    3rd and 6th read a group now). Over four calls fp16 adds 249 on average on tiny SD as before."""
    added = fresh_process(FRESH_PROCESS_COUNT, kind)
    fp32, sites = added["float32"], added.pop("float32_sites")  # what an fp32 count over its pin is made of
    by_group = added.pop("float16_by_group")  # each group's own read call (its runs: sentinel_pace.SENTINEL_PHASES)
    over = {group: count - fp32 for group, count in by_group.items()}
    assert set(over) == set(groups_over_fp32) and all(over[g] <= groups_over_fp32[g] for g in over), (over, fp32)
    assert fp32 <= 214, (added, sites)
    assert abs(added["bfloat16"] - fp32) <= 10, added
    assert added["float16"] - fp32 <= fp16_over_fp32, added
    assert added["float16_not_read"] - fp32 <= not_read_over_fp32 < added["float16"] - fp32, added


FRESH_PROCESS_COUNT = """
import json, sys, tempfile, warnings
import torch
warnings.simplefilter("ignore")
from diffusion_debug import DebugConfig
from benchmarks import op_counts
from tests.test_op_count import shaped
config = DebugConfig(output_dir=tempfile.mkdtemp(), log_level="error")
counts = {  # the sites of fp32's count only (what names a count over its pin): collecting them is slower
    str(dtype).removeprefix("torch."): op_counts.added_python_calls(
        shaped(sys.argv[1], dtype), config, sites=dtype == torch.float32, read=dtype == torch.float16
    )
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
}
added = {dtype: count.get("added_read", count["added"]) for dtype, count in counts.items()}
added["float16_not_read"] = counts["float16"]["added"]  # a call whose step 0 the UNet's sentinel reads not
by_group = counts["float16"]["added_read_by_group"]
print(json.dumps({**added, "float32_sites": counts["float32"]["added_by_site"], "float16_by_group": by_group}))
"""


@FRESH
def test_an_fp16_unet_step_adds_the_python_calls_of_a_bf16_step_plus_its_read_blocks(fresh_process):
    """On a GPU a watched denoising step's cost is host time: the Python it runs and the ops it
    launches. Counted per step at SD1.5 topology (``op_counts.step_python_calls``, a process of its
    own): a bf16 step (no sentinel) adds 86 calls (91 at steps 2 and 3, the early steps' checks; 87 and 92
    on the floor stack). An fp16 step the UNet's sentinel does not read (``sentinel_pace``: all but
    steps 0, 1, 4, 8...) adds 1 more (the pace's; counted at step 3: step 2 also takes out the hooks step 1
    read, which a 2-step call, the pace not asked after a run's last step, no longer does), a step it reads
    each block's hook dispatch (torch's,
    3 calls on torch 2.13, 4 on 2.5.1) and hook (11 blocks), and 22 for the take and the reading: 152
    and 164. Every fp16 step was a read one before: 156 to 161 calls a step, 157.85 over 20 steps,
    now 108.9 (113.2 on the floor stack); fp16 over bf16 70 a step, now 21."""
    added = fresh_process(STEP_COUNT)
    (fp16_unread, fp16_read), (bf16_unread, bf16_read), dispatch = added["float16"], added["bfloat16"], added["hook"]
    assert bf16_read <= 87 and bf16_unread <= 92, added
    assert fp16_unread == bf16_unread + 1, added
    assert fp16_read - bf16_read <= 11 * (dispatch + 1) + 22, added


STEP_COUNT = """
import json, tempfile, warnings
import torch
warnings.simplefilter("ignore")
from diffusion_debug import DebugConfig
from benchmarks import op_counts
from tests.test_op_count import shaped
config = DebugConfig(output_dir=tempfile.mkdtemp(), log_level="error")
added = {
    str(dtype).removeprefix("torch."): [
        op_counts.step_python_calls(shaped("sd15_shaped", dtype), config, short=step, long=step + 1)["added_per_step"]
        for step in (3, 4)
    ]
    for dtype in (torch.float16, torch.bfloat16)
}
layer = torch.nn.Linear(1, 1)
bare = op_counts.python_calls(lambda: layer(torch.ones(1)))
layer.register_forward_hook(lambda *args: None)
added["hook"] = op_counts.python_calls(lambda: layer(torch.ones(1))) - bare - 1  # torch's dispatch of a hook
print(json.dumps(added))
"""


def test_a_monitored_training_step_adds_a_pinned_number_of_python_calls():
    """On a GPU a monitored step's cost is host time, most of it the Python a step runs, counted
    here (deterministic, ``op_counts.training_python_calls``: an Accelerate fp16 step on the CPU,
    monitored minus plain, the fewest of three each; the same on tiny SD and at SD1.5 topology: the
    per-step work does not grow with the model's modules). 324 calls when first counted; 275 once
    the judges and the step row called numpy's methods (not its dispatching functions, three calls
    each), the module-health peers' median was taken without ``np.median`` (fifteen calls) and
    lists were built where a generator resumed once a value (the loss spike check's deviations:
    28); 252 once the step's two norm reads switched grad mode off without ``torch.no_grad``'s
    context objects (eleven), the early loss level's median was kept (not taken three times a
    step) and ``RankContext.distributed`` became an attribute (six); 229 once a clean step skipped
    noting clipping, linking causes, naming components and ordering by cause (nothing to judge);
    221 once a clean step was counted without generators, a loss not judged for a spike returned
    a made-once ``SpikeCheck`` and the step's description reused the learning rates its row read
    (218 counted at ea32099); 216 once the update sketch summed its blocks per module on the device
    and the judges shared one array of the module norms; 217 on the floor stack (220 for a while)
    once a step with no loss (launch's ``NO_LOSS``) was told by a row's property, 212 (213 on the
    floor) once it was told by the row's loss count itself; 206 once module health, the loss-spike
    check, the update ratios' key and the record row stopped calling numpy's and our own Python
    wrappers (207 on the floor); 195 (196 on the floor) once a clean step stopped running its
    comprehensions over no anomalies, entered module health's ``np.errstate`` once and listed the
    gradients by ``map`` (``tests/training/test_step_counts.py`` pins bf16's and the ops too); 157
    (158 on the floor) counted on a step off the per-module figures' schedule (``training.step.detail``:
    four steps in five after the first ten read no module norms and no update sketch); 147 (148 on the
    floor) once the step row's slots and local figures were listed by ``map``, its counts read without
    a helper and a clean step ran no comprehension for its anomaly kinds and open repeat keys (ten);
    146 (147 on the floor) once the loss-spike check read its early level as an attribute; 145 (146 on the
    floor) once the step's norms took the gradients its swap check listed (no ``local_gradients`` call);
    143 (144 on the floor) once a scalar loss's timestep buckets ran no ``1.0 - finite`` (``Tensor.__rsub__``);
    145 (146 on the floor) since not_learning's step pre-hook stays on the optimizer from the first step
    (its two calls in ``optimizer.step()``: put on and off, it recompiled a compiled step).
    Its ops: 24 until the global norm was one ``vector_norm`` of the float64 norms (cost24), 22 since."""
    calls = op_counts.training_python_calls(tiny_pipeline("sd").unet.train())
    assert calls["added"] <= 146, calls
    # tests/training/test_step_counts.py's PINNED["fp16"] (its fp16 case without a clip is this count)
    assert calls["added_ops_per_step"] == 22, calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spacing", ["linspace", "leading"])
def test_a_reused_debuggers_1_step_call_reads_the_host_twice_and_its_step_once_late(dtype, spacing):
    """Issue 45: on a GPU every host read of a device value is a sync. A reused debugger's 1-step call
    adds 2 blocking reads (the text encoder's calls read together, the VAE decode's output) and the
    step's deferred copy: 3 and 1 while ``set_timesteps`` read its first timestep (``float``) and, on a
    ``leading`` schedule with ``steps_offset=0``, its last, 4; they now ride in the first step's copy
    (``step_values.Schedule``). Counted here: every read of a tensor (``count_host_transfers``), the
    pipeline's own subtracted, on CPU tensors standing for the device's."""
    from diffusers import DDIMScheduler

    from diffusion_debug.stats.host import count_host_transfers

    pipe = tiny_pipeline("sd", dtype=dtype)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config, timestep_spacing=spacing, steps_offset=0)

    def call():
        pipe("a photo of a cat", num_inference_steps=1, generator=torch.Generator().manual_seed(0))

    debugger = DiffusionModelDebugger(pipe, quiet_config())
    with debugger:
        call()  # the first call (full probes on fp16 components)
    with count_host_transfers() as plain:
        call()
    with debugger, count_host_transfers() as watched:
        call()
    events = [e for e in debugger.record.events if e["type"] == "set_timesteps"]
    debugger.close()
    added = (len(watched.blocking) - len(plain.blocking), len(watched.deferred) - len(plain.deferred))
    assert added == (2, 1), (watched.calls, plain.calls)
    first = float(pipe.scheduler.timesteps[0])
    assert [(e["num_inference_steps"], e["first_timestep"], e["init_noise_sigma"]) for e in events] == [
        (1, first, 1.0)
    ] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cfg_calls_two_unprobed_text_encoder_outputs_take_one_fused_abs_max(dtype):
    """An fp32 or bf16 text encoder has no sentinel: the prompt's and the negative prompt's outputs each
    took a ``linalg_vector_norm`` (a kernel each on a GPU) before their stack into the one read, 3 ops.
    Now they are reduced together when read (``call_events._output_absmaxes``): one ``_foreach_norm``
    kernel on a GPU and the stack, 2 ops; on this CPU ``_foreach_abs`` and ``_foreach_max``
    (``probes.fused._absmaxes``), 3 as before. The call's one ``linalg_vector_norm`` is the step's L2
    norm: 17 ops a reused 1-step call in fp32, 18 in bf16 (16 and 17 on a GPU). 19 in bf16 once a bf16
    decoded image's two extremes were made float32 (two ``_to_copy``) to be read with its float32 count
    by one stack, as an fp32 image's, where a stack and a float64 ``cat`` joined them (HostCopy: 7
    Python calls a call). 18 and 20 once a call's end compared torch's global generator's state with its
    state as the run began (one ``aten.equal`` of two CPU tensors a call, none a step: a call given
    ``generator=`` that draws from the global one is ``nondeterministic``); only for a call given a generator
    of its own since (this one): a call given none, or the global one, copies and compares nothing (17 and 19,
    tests/diffusion/test_debugger.py's global-RNG test). 18 in bf16 too once a decoded image's count and extremes
    were joined by one ``cat``, which makes bf16 extremes float32 itself (its two ``_to_copy`` and stack gone)."""
    pipe = tiny_pipeline("sd", dtype=dtype)

    def call():
        pipe("a photo of a cat", num_inference_steps=1, generator=torch.Generator().manual_seed(0))

    debugger = DiffusionModelDebugger(pipe, quiet_config())
    with debugger:
        call()
    with count_aten_ops() as plain:
        call()
    with count_aten_ops() as ops, debugger:
        call()
    debugger.close()
    added = added_ops(ops.counts, plain.counts)
    assert added["aten.linalg_vector_norm.default"] == 1, added
    assert added["aten._foreach_abs.default"] == added["aten._foreach_max.default"] == 1, added
    assert sum(added.values()) == {torch.float32: 18, torch.bfloat16: 18}[dtype], added


def test_encoder_outputs_reduced_together_keep_each_ones_nan_inf_and_near_overflow():
    """Each output's abs-max as its own ``absmax`` gives it: NaN before Inf, Inf, a value near fp16's
    max, in every dtype, fused or not (mixed dtypes, fp8: one each)."""
    from diffusion_debug.diffusion.call_events import _output_absmaxes
    from diffusion_debug.stats import absmax_on_device

    def outputs(dtype):
        made = [torch.randn(1, 4, 8) for _ in range(4)]
        made[0][0, 1, 2], made[1][0, 2, 3], made[2][0, 3, 4] = float("nan"), float("inf"), -60000.0
        made[1][0, 0, 0] = float("-inf")
        return [t.to(dtype) for t in made]

    fp8 = getattr(torch, "float8_e4m3fn", torch.float16)
    for group in (outputs(torch.float32), outputs(torch.bfloat16), outputs(torch.float16), outputs(fp8)):
        group += [group[0]]  # a NaN tensor after the others too
        found = [t.item() for t in _output_absmaxes(group)]
        expected = [absmax_on_device(t).item() for t in group]
        assert str(found) == str(expected), (group[0].dtype, found, expected)
        assert found[0] != found[0] and found[-1] != found[-1]
        assert found[1] == float("inf") or group[0].dtype.itemsize == 1  # (e4m3fn has no Inf)
    mixed = outputs(torch.float32)[:2] + outputs(torch.bfloat16)[2:]
    assert str([t.item() for t in _output_absmaxes(mixed)]) == str([absmax_on_device(t).item() for t in mixed])


@pytest.mark.parametrize("kind", ["sdxl", "controlnet"])
def test_a_kept_call_clones_no_tensor_of_a_list_or_dict_that_is_not_the_components_own_state(kind, monkeypatch):
    # a kept call cloned every tensor in its list and dict arguments: 2 ops a step more in SDXL (its
    # added_cond_kwargs), 12 in a ControlNet pipeline (its residuals: 24.75 of the 25 a step at SD1.5 topology),
    # ~90 µs host a UNet call; only the component's own state (a kv_cache rewritten in place) is cloned
    from diffusers.utils import logging as diffusers_logging

    from diffusion_debug.diffusion.components import call_sites
    from diffusion_debug.testing.zoo import ZOO_CALLS

    diffusers_logging.set_verbosity_error()
    pipe = tiny_pipeline(kind)
    extra = ZOO_CALLS[kind][0]() if kind in ZOO_CALLS else {"prompt": "a cat"}
    config = DebugConfig(output_dir=tempfile.mkdtemp(), stream_events=False, log_level="error")
    debugger = DiffusionModelDebugger(pipe, config)

    def counted() -> dict:
        with count_aten_ops() as ops, debugger:
            pipe(**extra, num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0))
        return ops.counts

    counted()  # the first run's one-time work
    kept = counted()
    original = call_sites.kept_as_passed  # without cloning: every tensor held as passed (no bytes to clone)
    monkeypatch.setattr(
        call_sites,
        "kept_as_passed",
        lambda args, kwargs, budget=None, **rest: original(args, kwargs, None if budget is None else [0], **rest),
    )
    assert added_ops(kept, counted()) == {}
    debugger.close()


def test_a_clip_text_encoders_sentinel_under_fp16_autocast_reads_its_two_dtypes_in_one_stack_with_no_cast():
    """Under CPU float16 autocast a float32 CLIP's sentinel reads its float16 projections (``out_proj``, ``fc2``) and
    a float32 layer output (its stream), held with the call's float32 output and reduced together. Autocast's
    ``stack`` casts each tensor not of the widest dtype first: the four float16 abs-maxes were four ``_to_copy``
    before their stack, 7 ops a call. Stacked outside autocast, the stack promotes them itself (exactly): 3. The
    values are each module's abs-max as it returned, the call's output's too."""
    from diffusion_debug.probes.fused import HeldAbsmax

    pipe = tiny_pipeline("sd")
    encoder = pipe.text_encoder
    ids = pipe.tokenizer(["a photo of a cat"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    debugger = DiffusionModelDebugger(pipe, quiet_config())
    with torch.autocast("cpu", dtype=torch.float16):
        with debugger:  # the first run reads it fully; the next ones with its sentinel
            pipe("a photo of a cat", num_inference_steps=1, generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), count_aten_ops() as plain:
            encoder(ids)
        with debugger, torch.no_grad(), count_aten_ops() as ops:
            level = debugger._steps.probes.levels["text_encoder"]
            encoder(ids)
        debugger.close()
        outputs = []  # its float16 projections' outputs and its float32 output, as they returned: the reference
        hooks = [
            m.register_forward_hook(lambda _m, _a, out: outputs.append(out))
            for name, m in encoder.named_modules()
            if name.endswith(("self_attn.out_proj", "mlp.fc2"))
        ]
        with torch.no_grad():
            outputs.append(encoder(ids).last_hidden_state)
        for hook in hooks:
            hook.remove()
        held = HeldAbsmax()
        for output in outputs:
            held.add(output)
        (flushed,) = held.take()
    assert level == "sentinel"
    assert added_ops(ops.counts, plain.counts) == {
        "aten._foreach_abs.default": 1,
        "aten._foreach_max.default": 1,
        "aten.stack.default": 1,
    }
    assert {t.dtype for t in outputs} == {torch.float16, torch.float32}
    assert flushed.dtype == torch.float32
    assert flushed.tolist() == [t.abs().max().item() for t in outputs]


def test_an_sd_pipeline_under_fp16_autocast_adds_no_cast_a_step():
    """A float32 SD pipeline under the user's ``with torch.autocast("cpu", dtype=torch.float16)``: the step's one
    ``cat`` of its values for the host (stats/host.py) ran under autocast, whose ``cat`` casts each piece not of
    the widest dtype (the float64 buffer's) first: 2.25 ``_to_copy`` a step, 16 added ops a step. Joined outside
    autocast, the cat promotes them itself (exactly, as outside it): no cast, 13.75. A call is made first, in the
    same autocast region: autocast caches its float16 copies of the weights from the first call on, and a first
    call counted would read as 51 casts a step fewer in the plain pipeline's per-step count."""
    pipe = tiny_pipeline("sd")
    with torch.autocast("cpu", dtype=torch.float16):
        pipe("a photo of a cat", num_inference_steps=1, generator=torch.Generator().manual_seed(0), output_type="np")
        counts = op_counts.inference_ops(pipe, quiet_config())
    assert "aten._to_copy.default" not in counts["added_by_op"], counts
    assert counts["added_ops_per_step"] == 13.75, counts


def test_a_float32_dits_sentinel_under_fp16_autocast_reads_its_projections_at_steps_0_1_and_every_8th():
    """A float32 PixArt under float16 autocast computes its blocks' projections (``attn1.to_out.0``,
    ``attn2.to_out.0``, ``ff.net.2``) in float16 and its adaLN gates scale them into a float32 stream: its sentinel
    reads them too (``sentinel_blocks.block_projections``), at steps 0, 1 and every 8th
    (``SENTINEL_EVERY_PROJECTED``; every 4th added 28.4 ops a step over a 20-step run at PixArt-alpha's 28 blocks,
    23.6 every 8th: benchmarks/RESULTS.md, dit31). 3 blocks, each flush the real model's (``op_counts.held_bytes``:
    HELD_BYTES scaled as a projection's output is to 1024 px with CFG's, 10922 bytes here: 3 flushes a step read):
    step 8 runs 17 hooks (its 9 projections beside the 8 of before, 15 readings) and adds 21 ops (3 flushes of
    ``_foreach_abs``, ``_foreach_max`` and ``stack`` beside the 12 of a step not read); step 4 (read at every 4th: 21)
    the call site's 2 hooks and 12 ops, a float32 step's. A 20-step run (steps 0, 1, 8, 16 read): 13.8 ops a step.
    (dit31 measured 26 and 14 before main's a11f3dbb took the host copy and the flushes' stacks out of the user's
    autocast: 2 ``_to_copy`` a step and 1 a flush fewer.) Out of autocast the float32 transformer has no probe: 12 a
    step, as before. Each call under an autocast region of its own, as a user's."""
    from benchmarks.models import PIXART_1024_PROJECTION_BYTES
    from diffusion_debug.probes.fused import HELD_BYTES
    from diffusion_debug.testing.flux import deeper
    from diffusion_debug.testing.zoo import ZOO_CALLS

    call = ZOO_CALLS["pixart"][0]()
    pipe = deeper(tiny_pipeline("pixart"), num_layers=3)
    projection = pipe.transformer.transformer_blocks[0].attn1.to_out[0]
    sizes = []
    handle = projection.register_forward_hook(lambda _m, _a, out: sizes.append(out.numel() * out.element_size()))
    with torch.autocast("cpu", dtype=torch.float16):
        pipe(**call, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="latent")
    handle.remove()
    fp16 = {"autocast": torch.float16, **call}
    with op_counts.held_bytes(HELD_BYTES * sizes[0] // PIXART_1024_PROJECTION_BYTES):
        read = op_counts.inference_ops(pipe, quiet_config(), short=8, long=9, first=2, **fp16)
        unread = op_counts.inference_ops(pipe, quiet_config(), short=4, long=5, first=2, **fp16)
        hooks = [op_counts.inference_hooks(pipe, quiet_config(), short=s, long=s + 1, **fp16) for s in (8, 4)]
    fp32 = op_counts.inference_ops(pipe, quiet_config(), short=2, long=3, first=2, **call)
    assert [(h["hooks_per_step"], h["measures_per_step"]) for h in hooks] == [(17, 15), (2, 0)], hooks
    assert (read["added_ops_per_step"], unread["added_ops_per_step"]) == (21, 12), (read, unread)
    assert "aten._to_copy.default" not in read["added_by_op"], read
    run = (4 * read["added_ops_per_step"] + 16 * unread["added_ops_per_step"]) / 20  # steps 0, 1, 8, 16 read
    assert run == 13.8 and run <= 25
    assert fp32["added_ops_per_step"] == 12, fp32


def test_a_float32_flux_under_fp16_autocast_costs_a_step_what_it_costs_on_main():
    """Flux's block streams are float16 under float16 autocast (its x_embedder and gates run in it; its blocks clip
    them), told at the first call after an attach (``component_probes._StreamDtype``): its projections' hooks go then,
    and from the next attach its sentinel is main's, its block lists' ends read every step, no projection, no pace.
    Tiny Flux (3 + 3 blocks), float32 weights, each call under an autocast region of its own, the pipeline watched
    twice first (its tree changes at the 2nd call: a 1st-call check again there): 9 hooks a step (7 readings), 34 a
    call, as main (21, 19 and 59 while its projections were read every step); 38 a call since the VAE's and text
    encoders' end modules are watched (vae36). Ops a step: main's 11, no
    ``_to_copy`` (a11f3dbb: host copy and fused stacks outside the user's autocast; dit31's base measured 13)."""
    from diffusion_debug.testing.flux import FLUX_CALL, deeper

    pipe = deeper(tiny_pipeline("flux"), num_layers=3, num_single_layers=3)
    call = FLUX_CALL[0]()
    for _ in range(2):
        debugger = DiffusionModelDebugger(pipe, quiet_config())
        with torch.autocast("cpu", dtype=torch.float16), debugger:
            pipe(**call, num_inference_steps=2, generator=torch.Generator().manual_seed(0))
        debugger.close()
    fp16 = {"autocast": torch.float16, **call}
    hooks = op_counts.inference_hooks(pipe, quiet_config(), short=2, long=4, **fp16)
    ops = op_counts.inference_ops(pipe, quiet_config(), short=2, long=4, first=1, **fp16)
    assert (hooks["hooks_per_step"], hooks["measures_per_step"], hooks["hooks_per_call"]) == (9, 7, 38), hooks
    assert "_StreamDtype._seen" not in hooks["by_hook"], hooks
    assert ops["added_ops_per_step"] == 11, ops
    assert "aten._to_copy.default" not in ops["added_by_op"], ops


def test_the_hook_counts_name_a_function_as_its_qualified_name_on_every_python():
    """:func:`op_counts.qualname`: the names the hook counts are keyed by, ``co_qualname`` from Python 3.11; 3.10 has
    none (every hook count there failed with an AttributeError), so they are read from the package's functions and
    the code objects nested in them. Where ``co_qualname`` exists the two agree, for every code of the package."""
    import diffusion_debug.probes.readings  # noqa: F401  (the probes' hooks among the codes named)

    named = op_counts._package_qualnames()
    ours = {code: name for code, name in named.items() if "diffusion_debug" in code.co_filename}
    assert "Probe._reader.<locals>.hook" in ours.values() and "Probe._read_output" in ours.values()
    if sys.version_info >= (3, 11):
        assert {code: code.co_qualname for code in ours} == ours
    hook = next(code for code, name in ours.items() if name == "Probe._reader.<locals>.hook")
    assert op_counts.qualname(hook) == "Probe._reader.<locals>.hook"
