"""A component's own state passed as an object, not a list or dict: GLM-Image gives its transformer a
``GlmImageKVCache`` (``kv_caches``), whose layers the pipeline switches between ``write`` (the condition
images' pass, before the loop), ``read`` (a step's conditional call) and ``skip`` (its unconditional call),
and whose entries each write replaces (``torch.cat``). A kept call holds the cache as it was at the call:
its replay reads the condition keys and values a ``read`` call read, and writes nothing into the user's.
Before, the kept call held the live object: a replay of the conditional call ran in ``skip`` mode (set for
the unconditional call since), read no cache, and a NaN made only with the cache read was named at the
transformer, not its module."""

from __future__ import annotations

import contextlib
import enum
import json
from pathlib import Path
from types import SimpleNamespace

import diffusers
import numpy as np
import PIL.Image
import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion import replay
from diffusion_debug.diffusion.components import cache_hooks, call_sites
from diffusion_debug.diffusion.components.call_sites import kept_as_passed
from diffusion_debug.diffusion.replay.bundle import save_bundle
from diffusion_debug.diffusion.replay.bundle_objects import own_classes

GLM = pytest.mark.skipif(not hasattr(diffusers, "GlmImagePipeline"), reason="this diffusers has no GLM-Image")
MODULE = "transformer_blocks.0.attn1.to_out.0"


def glm_image():
    """A tiny GLM-Image pipeline, called with its prior tokens and prompt embeddings given (no AR model)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, GlmImagePipeline, GlmImageTransformer2DModel

    torch.manual_seed(0)
    transformer = GlmImageTransformer2DModel(
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        text_embed_dim=16,
        time_embed_dim=16,
        condition_dim=8,
        prior_vq_quantizer_codebook_size=32,
    )
    vae = AutoencoderKL(
        block_out_channels=(32, 64),
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        latent_channels=4,
        sample_size=32,
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )
    components = dict(tokenizer=None, processor=None, text_encoder=None, vision_language_encoder=None)
    pipe = GlmImagePipeline(
        **components, vae=vae, transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler()
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def image_to_image(pipe) -> torch.Tensor:
    """Two steps with CFG from one condition image (a 32x32 image: 8x8 tokens)."""
    generator = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, 4, 16, generator=generator)
    image = PIL.Image.fromarray((np.arange(32 * 32 * 3).reshape(32, 32, 3) % 251).astype(np.uint8))
    return pipe(
        prompt_embeds=embeds,
        negative_prompt_embeds=torch.zeros_like(embeds),
        prior_token_ids=torch.randint(0, 32, (1, 64), generator=generator),
        image=[image],
        prior_token_image_ids=[torch.randint(0, 32, (64,), generator=generator)],
        source_image_grid_thw=[torch.tensor([[1, 8, 8]])],
        height=32,
        width=32,
        num_inference_steps=2,
        guidance_scale=1.5,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).images


@contextlib.contextmanager
def nan_while_reading(pipe):
    """A NaN in ``MODULE``'s output whenever its call reads the condition cache (a ``read`` call): what an
    fp16 attention over the condition tokens overflowing would make."""
    passed = []

    def kept(module, args, kwargs):
        passed[:] = [kwargs.get("kv_caches")]

    def nan(module, args, output):
        if passed and passed[0] is not None and passed[0][0].mode == "read":
            output = output.clone()
            output[0, -1, 0] = float("nan")
            return output
        return None

    hooks = [
        pipe.transformer.register_forward_pre_hook(kept, with_kwargs=True),
        pipe.transformer.get_submodule(MODULE).register_forward_hook(nan),
    ]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@GLM
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
@pytest.mark.parametrize("kept", [None, 0], ids=["copied", "beyond_the_copies"])
def test_a_nan_made_reading_glm_images_condition_cache_is_named_at_its_module(tmp_path, mode, kept, monkeypatch):
    # beyond the step's bytes of copies (a real-size cache: 30 layers of condition keys and values) the cache's
    # tensors are held as passed, under inference_mode too: each write replaces an entry, none is written into
    if kept is not None:
        monkeypatch.setattr(cache_hooks, "KEPT_BYTES", kept)
    twin, pipe = glm_image(), glm_image()
    with nan_while_reading(twin), torch.no_grad():
        expected = image_to_image(twin)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with nan_while_reading(pipe), dbg, mode():
        seen = image_to_image(pipe)
    dbg.close()
    assert torch.equal(seen.isnan(), expected.isnan()) and torch.equal(seen.nan_to_num(), expected.nan_to_num())
    report = dbg.report()
    assert [a.message for a in report.anomalies if a.kind == "debugger_error"] == []
    errors = [(a.kind, a.component, a.module, a.step) for a in report.anomalies if a.severity == "error"]
    assert errors == [("nonfinite", "transformer", MODULE, 0)]


class LayerCache:
    def __init__(self):
        self.keys, self.mode = [], None

    def store(self, key):
        self.keys.append(key)


class Cache:
    def __init__(self, layers):
        self.layers = [LayerCache() for _ in range(layers)]


def test_a_kept_object_is_the_state_it_was_passed_and_a_use_writes_only_into_its_copy(monkeypatch):
    monkeypatch.setattr(cache_hooks, "KEPT_BYTES", 0)
    with torch.inference_mode():
        key = torch.ones(2)
    user = Cache(2)
    user.layers[0].store(key)
    user.layers[0].mode = "read"
    args, kwargs = kept_as_passed((), {"kv_caches": user}, [0], state=frozenset({"kv_caches"}))
    user.layers[0].mode = "skip"  # switched for the next call
    user.layers[1].store(torch.zeros(2))
    used = kept_as_passed(args, kwargs)[1]["kv_caches"]  # a replay's: a copy made again at each use
    assert type(used) is Cache and used is not user
    assert [(layer.mode, len(layer.keys)) for layer in used.layers] == [("read", 1), (None, 0)]
    assert used.layers[0].keys[0] is key  # held uncloned: never written into
    used.layers[1].store(torch.ones(2))  # the replay's write
    again = kept_as_passed(args, kwargs)[1]["kv_caches"]
    assert [len(layer.keys) for layer in again.layers] == [1, 0]
    assert [len(layer.keys) for layer in user.layers] == [1, 1]
    assert user.layers[0].mode == "skip" and user.layers[0].keys[0] is key


KLEIN = pytest.mark.skipif(not hasattr(diffusers, "Flux2KleinKVPipeline"), reason="no Flux2 Klein KV here")
KLEIN_MODULE = "transformer_blocks.0.attn.to_out.0"


def klein_kv():
    """A tiny Flux2 Klein KV pipeline: its transformer extracts the reference image's keys and values into a
    ``Flux2KVCache`` (``kv_cache``, an object whose layers' entries each store replaces) at step 0, and reads
    them (``kv_cache_mode="cached"``) from step 1 on."""
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinKVPipeline,
        Flux2Transformer2DModel,
    )

    torch.manual_seed(0)
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=16,
        out_channels=None,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=False,
    )
    vae = AutoencoderKLFlux2(
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        block_out_channels=(16, 32),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=8,
        sample_size=32,
    )
    components = dict(scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder=None, tokenizer=None)
    pipe = Flux2KleinKVPipeline(**components, vae=vae, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def klein_edit(pipe) -> torch.Tensor:
    image = PIL.Image.fromarray((np.arange(64 * 64 * 3).reshape(64, 64, 3) % 251).astype(np.uint8))
    return pipe(
        image=image,
        prompt_embeds=torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(1)),
        height=32,
        width=32,
        num_inference_steps=3,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).images


@contextlib.contextmanager
def nan_while_cached(pipe):
    """A NaN in ``KLEIN_MODULE``'s output whenever its call reads the reference cache (steps 1 and 2)."""
    modes = []

    def kept(module, args, kwargs):
        modes[:] = [kwargs.get("kv_cache_mode")]

    def nan(module, args, output):
        if modes and modes[0] == "cached":
            output = output.clone()
            output.view(-1)[-1] = float("nan")
            return output
        return None

    hooks = [
        pipe.transformer.register_forward_pre_hook(kept, with_kwargs=True),
        pipe.transformer.get_submodule(KLEIN_MODULE).register_forward_hook(nan),
    ]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@KLEIN
def test_a_real_size_flux2_klein_reference_cache_under_inference_mode_is_replayed(tmp_path, monkeypatch):
    # beyond the step's bytes of copies an inference tensor has no version counter; Flux2KVCache's entries are
    # replaced by each store (an object of own state, like every diffusers cache object), never written into:
    # held as passed, replayed, and the NaN named at its module
    monkeypatch.setattr(cache_hooks, "KEPT_BYTES", 0)
    twin, pipe = klein_kv(), klein_kv()
    with nan_while_cached(twin), torch.no_grad():
        expected = klein_edit(twin)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with nan_while_cached(pipe), dbg, torch.inference_mode():
        seen = klein_edit(pipe)
    dbg.close()
    assert torch.equal(seen.isnan(), expected.isnan()) and torch.equal(seen.nan_to_num(), expected.nan_to_num())
    report = dbg.report()
    assert [a.message for a in report.anomalies if a.kind == "debugger_error"] == []
    errors = [(a.kind, a.component, a.module, a.step) for a in report.anomalies if a.severity == "error"]
    assert errors == [("nonfinite", "transformer", KLEIN_MODULE, 1)]


class StaticLayer:
    def __init__(self, key):
        self.keys = key

    def update(self, key):
        self.keys.index_copy_(0, torch.tensor([0]), key)  # transformers' StaticCache: written into


def test_an_object_passed_as_past_key_values_may_be_written_into_so_its_inference_tensor_refuses_a_replay(monkeypatch):
    monkeypatch.setattr(cache_hooks, "KEPT_BYTES", 0)
    with torch.inference_mode():
        user = StaticLayer(torch.ones(2))
    kept = kept_as_passed((), {"past_key_values": user}, [0], state=frozenset({"past_key_values"}))
    with pytest.raises(RuntimeError, match="^an inference_mode cache tensor"):
        kept_as_passed(*kept)


class Slotted:
    __slots__ = ("keys",)


class WithSlots(Slotted):
    def __init__(self):
        self.keys, self.mode = torch.ones(2), "read"


class WithOdd:
    def __init__(self):
        from diffusers.configuration_utils import FrozenDict

        self.frozen = FrozenDict(n=1)


def test_an_object_a_snapshot_cannot_rebuild_is_passed_as_it_is():
    # a dict, list, tuple or set subclass (FrozenDict, OrderedDict, a ModelOutput) keeps its items outside
    # its __dict__, an object with __slots__ its slots: rebuilt from its __dict__ it would be empty
    from diffusers.configuration_utils import FrozenDict

    state = frozenset({"kv_cache"})
    for user in (FrozenDict(n=1), WithSlots()):
        kept = kept_as_passed((), {"kv_cache": user}, [1 << 20], state=state)
        assert kept_as_passed(*kept)[1]["kv_cache"] is user
    user = WithOdd()
    used = kept_as_passed(*kept_as_passed((), {"kv_cache": user}, [1 << 20], state=state))[1]["kv_cache"]
    assert type(used) is WithOdd and used is not user and used.frozen is user.frozen and dict(used.frozen) == {"n": 1}


def test_an_object_whose_entries_are_replaced_is_held_uncloned_at_keep_and_at_use():
    # its tensors are never written into (a replay's store replaces them in its copy): nothing to clone, no
    # byte of the step's copies spent; one changed in place since (no_grad: a version) still refuses a strict use
    key, value = torch.ones(2), torch.zeros(2)
    with torch.inference_mode():
        frozen = torch.ones(2)
    user = Cache(2)
    user.layers[0].store(key)
    user.layers[1].store(frozen)
    user.mode = value
    budget = [1 << 20]
    kept = kept_as_passed((), {"kv_caches": user}, budget, state=frozenset({"kv_caches"}))
    assert budget == [1 << 20]
    for strict in (True, False):
        used = kept_as_passed(*kept, strict=strict)[1]["kv_caches"]
        assert used.layers[0].keys[0] is key and used.layers[1].keys[0] is frozen and used.mode is value
    value.add_(1)
    assert kept_as_passed(*kept, strict=False)[1]["kv_caches"].mode is value
    with pytest.raises(RuntimeError, match=r"^a \(2,\) tensor the call was passed .* was changed in place since"):
        kept_as_passed(*kept)


@GLM
def test_a_repro_bundle_holds_glm_images_cache_object_and_its_replay_reads_it(tmp_path):
    # the bundle wrote the cache object as unsupported and replayed it as None: no condition keys read, the
    # NaN not made again, and the replay named no module
    pipe = glm_image()
    config = DebugConfig(output_dir=str(tmp_path), log_level="error", repro_bundle=True)
    dbg = DiffusionModelDebugger(pipe, config)
    with nan_while_reading(pipe), dbg, torch.no_grad():
        image_to_image(pipe)
    dbg.close()
    (bundle,) = [a.details["bundle"] for a in dbg.report().anomalies if "bundle" in a.details]
    bundle = Path(dbg.report().save()) / bundle
    with nan_while_reading(pipe), torch.no_grad():
        replayed = replay(bundle, pipe.transformer)
    assert (replayed["module"], replayed["output_finite"], replayed["note"]) == (MODULE, False, "")
    kept = json.loads((bundle / "meta.json").read_text())["call"]["kwargs"]["__dict__"]["kv_caches"]
    assert kept["__object__"] == "GlmImageKVCache"
    assert kept["attributes"]["__dict__"]["caches"]["__list__"][0]["__object__"] == "GlmImageLayerKVCache"
    kept["__object__"] = "GlmImageTransformer2DModel"  # a crafted file: only the module's plain classes are made
    meta = json.loads((bundle / "meta.json").read_text())
    meta["call"]["kwargs"]["__dict__"]["kv_caches"] = kept
    (bundle / "meta.json").write_text(json.dumps(meta))
    with nan_while_reading(pipe), torch.no_grad():
        replayed = replay(bundle, pipe.transformer)  # given None, as before: no cache read, no NaN made
    assert (replayed["module"], replayed["output_finite"]) == (None, True)


def bundled(path, component, **kwargs) -> dict:
    """The packed kwargs of a bundle of a call of ``component`` given ``kwargs``, and its tensors' names."""
    save_bundle(path, component="net", component_module=component, call_prefix="", args=(torch.ones(1, 2),),
                kwargs=kwargs, step=0, timestep=None, module="", anomaly_kind="nonfinite")  # fmt: skip
    meta = json.loads((path / "meta.json").read_text())
    return meta["call"]["kwargs"]["__dict__"], sorted(meta["shapes"])


def test_a_bundle_packs_an_object_only_of_a_class_its_replay_makes(tmp_path):
    # an object of a class other than the component module's own (transformers' DynamicCache, beside a Linear
    # defined in torch) was packed, every layer's keys and values copied to the CPU and written, to be replayed
    # as None: it is written unsupported, nothing of it packed
    cache = Cache(2)
    cache.layers[0].store(torch.ones(3))
    packed, tensors = bundled(tmp_path, torch.nn.Linear(2, 2), past_key_values=cache)
    assert (list(packed["past_key_values"]), tensors) == (["__unsupported__"], ["args.0"])


class Mode(enum.Enum):
    READ = "read"


class Processor:  # an attention processor: called, not a state
    def __call__(self, x):
        return x


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x, mode=None):
        self.seen = mode
        return self.lin(x)


def test_an_enum_member_is_no_object_a_bundle_packs_nor_a_processor_one_it_makes(tmp_path):
    # an Enum member was packed as a plain object and its replay refused the bundle ("not the packed layout of
    # a call": Mode.__new__ wants a value); a crafted file could have made a bare attention processor
    net = Net()
    packed, _ = bundled(tmp_path, net, mode=Mode.READ)
    replay(tmp_path, net)
    assert (list(packed["mode"]), net.seen) == (["__unsupported__"], None)
    classes = own_classes(net)
    assert ("Cache" in classes, "Mode" in classes, "Processor" in classes) == (True, False, False)


def test_a_cycle_through_a_bundled_objects_lists_is_written_unsupported(tmp_path):
    # a list holding itself in a packed object's attributes was walked without end: a RecursionError, told as
    # the debugger's repro_bundle failing, and no bundle written
    cache = Cache(1)
    cache.layers.append(cache.layers)
    packed, _ = bundled(tmp_path, Net(), mode=cache)
    layers = packed["mode"]["attributes"]["__dict__"]["layers"]["__list__"]
    assert (layers[0]["__object__"], layers[1]) == ("LayerCache", {"__unsupported__": "a cycle back to a list"})


@GLM
@pytest.mark.parametrize(
    "failing_keep, nan_mode, nan_call, step",
    [(3, "skip", 1, 0), (4, "read", 2, 1)],
    ids=["the_last_call_unkept", "an_earlier_call_unkept"],
)
def test_a_keep_that_runs_out_of_memory_leaves_its_call_unkept_not_the_call_before_it(
    tmp_path, monkeypatch, failing_keep, nan_mode, nan_call, step
):
    # step 0's unconditional call (its layers in ``skip`` mode) makes the NaN, and cloning its arguments runs
    # out of memory: the step's conditional call stayed kept in its place, and the repro bundle of the
    # unconditional call's NaN held the conditional call (``read`` mode), whose replay made no NaN. Step 1's
    # conditional call (its second ``read``) makes the NaN and is the one unkept: nothing took its place among
    # the held calls, so the bundle of its NaN held the step's unconditional call (``skip``), no NaN replayed
    passed, keeps, kept_as_passed, calls = [], [], call_sites.kept_as_passed, []

    def failing(args, kwargs, budget=None, *rest, **options):
        if budget is not None and "kv_caches" in kwargs:  # a keep: the write call, step 0's read, its skip
            keeps.append(kwargs["kv_caches"][0].mode)
            if len(keeps) == failing_keep:
                raise torch.OutOfMemoryError("planted: out of memory cloning a kept call")
        return kept_as_passed(args, kwargs, budget, *rest, **options)

    def nan(module, args, output):
        if passed[0] is not None and passed[0][0].mode == nan_mode:
            calls.append(None)
            if len(calls) >= nan_call:
                return output.clone().fill_(float("nan"))
        return None

    monkeypatch.setattr(call_sites, "kept_as_passed", failing)
    pipe = glm_image()
    hooks = [
        pipe.transformer.register_forward_pre_hook(
            lambda m, a, k: passed.insert(0, k.get("kv_caches")), with_kwargs=True
        ),
        pipe.transformer.get_submodule(MODULE).register_forward_hook(nan),
    ]
    config = DebugConfig(output_dir=str(tmp_path), log_level="error", repro_bundle=True)
    dbg = DiffusionModelDebugger(pipe, config)
    try:
        with dbg, torch.no_grad():
            image_to_image(pipe)
    finally:
        for hook in hooks:
            hook.remove()
    dbg.close()
    assert keeps[:failing_keep] == ["write", "read", "skip", "read"][:failing_keep]
    report = dbg.report()
    assert [a.message for a in report.anomalies if a.kind == "debugger_error"] == [
        "The debugger's keep_call failed (OutOfMemoryError: planted: out of memory cloning a kept call); the run went"
        " on without it."
    ]
    errors = [
        (a.component, a.module, a.step, a.details.get("bundle")) for a in report.anomalies if a.severity == "error"
    ]
    assert errors == [("transformer", "", step, None)]


def test_a_held_call_is_chosen_by_its_place_and_one_not_held_is_no_call():
    # a call ``back`` calls before the last beyond those held was replayed and bundled as the step's last call;
    # a held call whose keep failed is none (its place kept), not the call before or after it
    latest, first = ((1,), {}), ((0,), {})
    key, unkept = ("transformer", ""), call_sites._UNKEPT
    taken = ({key: latest}, {}, {key: [(first, None), (unkept, None)]})
    calls = SimpleNamespace(kept={}, contexts={}, earlier={})
    chosen = []
    for back in range(4):
        with call_sites.CallSiteHooks.calls_of(calls, taken, "transformer", back):
            chosen.append(calls.kept.get(key))
    assert [call is expected for call, expected in zip(chosen, [latest, unkept, first, unkept])] == [True] * 4
