"""A kept call's tensors inside its dict and list arguments are its own: AnyFlow FAR passes its
transformer a ``kv_cache`` dict whose tensors its next chunk's cache step rewrites in place, and a
cache step writes into them itself. A replay read a step later (localisation, ``why()``) reads them
as the call was passed, and never writes into the user's dict. Before, the kept call held the user's
tensors: the replay read the rewritten cache (the NaN the call made did not reproduce: named at the
transformer, not its module; ``why()`` found the replay finite) and its own cache writes landed in
the user's cache (the run's cache one write ahead of its unwatched twin's). A tensor beyond the step's
bytes of copies is held as passed and a replay that finds it changed refuses (a ``debugger_error``),
never naming a wrong module; a call given no tensor in a list or dict clones nothing."""

from __future__ import annotations

import contextlib

import diffusers
import pytest
import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler
from torch import nn

from diffusion_debug import DebugConfig, DiffusionDebugError, DiffusionModelDebugger
from diffusion_debug.diffusion.components import cache_hooks
from diffusion_debug.diffusion.components.call_sites import kept_as_passed
from diffusion_debug.op_count import count_aten_ops


class Sqrt(nn.Module):
    def forward(self, x):
        return x.sqrt()


class CachedTransformer(nn.Module):
    """A denoiser given its own state in a dict (FAR's ``kv_cache``): it reads ``k`` and writes ``v``
    in place (a cache step's write); ``root`` makes NaN where ``k`` is negative."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj_in, self.root, self.proj_out = nn.Linear(4, 4), Sqrt(), nn.Linear(4, 4)

    def forward(self, sample, timestep, kv_cache):
        h = self.root(self.proj_in(sample).relu() + kv_cache["k"])
        kv_cache["v"].add_(1.0)
        return self.proj_out(h) + kv_cache["v"]


class CachedPipeline(DiffusionPipeline):
    """Each step's cache ``k`` is negated in place after the call (FAR's next cache step rewrites it);
    ``by_position``: the cache passed as the transformer's third argument, not by keyword."""

    def __init__(self, transformer, scheduler):
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler)

    def __call__(self, kv_cache, num_inference_steps=3, by_position=False):
        latents = torch.linspace(-1, 1, 8).reshape(1, 2, 4)
        self.scheduler.set_timesteps(num_inference_steps)
        for t in self.scheduler.timesteps:
            if by_position:
                noise = self.transformer(latents, t, kv_cache)
            else:
                noise = self.transformer(latents, t, kv_cache=kv_cache)
            latents = self.scheduler.step(noise, t, latents).prev_sample
            kv_cache["k"].neg_()
        return latents


def cache():
    """``k`` positive at step 0, negative at step 1 (the NaN made there), positive again when read."""
    return {"k": torch.ones(1, 2, 4), "v": torch.zeros(1, 2, 4)}


def watched(tmp_path, user, by_position=False, mode=contextlib.nullcontext):
    pipe = CachedPipeline(CachedTransformer(), FlowMatchEulerDiscreteScheduler())
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg, mode():
        pipe(user, by_position=by_position)
    dbg.close()
    return dbg.report()


@pytest.mark.parametrize("by_position", [False, True], ids=["by_keyword", "by_position"])
def test_a_kv_cache_rewritten_after_the_call_is_replayed_as_passed_and_left_untouched(tmp_path, by_position):
    # by position (transformer(x, t, kv_cache)) the cache was not known as its own state: held as passed, the
    # replay read it rewritten, the NaN did not reproduce (named at the transformer) and why() found it finite
    twin = cache()
    CachedPipeline(CachedTransformer(), FlowMatchEulerDiscreteScheduler())(twin)
    user = cache()
    report = watched(tmp_path, user, by_position)
    assert all(torch.equal(user[k].view(torch.uint8), twin[k].view(torch.uint8)) for k in twin)  # v: 3, not 4
    (error,) = [a for a in report.anomalies if a.severity == "error"]
    assert (error.kind, error.component, error.module, error.step) == ("nonfinite", "transformer", "root", 1)
    assert not [a for a in report.anomalies if a.kind == "debugger_error"]
    before = {k: v.clone() for k, v in user.items()}
    result = report.why()
    assert (result.module, result.baseline.finite) == ("root", False)
    assert all(torch.equal(before[k], user[k]) for k in user)


def test_a_cache_beyond_the_bytes_copied_and_changed_since_is_not_replayed(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_hooks, "KEPT_BYTES", 0)  # nothing cloned as kept: each tensor held as passed
    twin = cache()
    CachedPipeline(CachedTransformer(), FlowMatchEulerDiscreteScheduler())(twin)
    user = cache()
    report = watched(tmp_path, user)
    assert all(torch.equal(user[k].view(torch.uint8), twin[k].view(torch.uint8)) for k in twin)  # cloned to replay
    (error,) = [a for a in report.anomalies if a.severity == "error"]
    assert (error.kind, error.component, error.module, error.step) == ("nonfinite", "transformer", "", 1)
    failed = [a.message for a in report.anomalies if a.kind == "debugger_error"]
    assert [m.split(" failed ")[0] for m in failed] == ["The debugger's replay", "The debugger's repro_bundle"]
    changed = "(1, 2, 4) tensor the call was passed in a list or dict was changed in place since"
    assert all(changed in m for m in failed)


def test_a_held_inference_tensor_is_not_replayed(tmp_path, monkeypatch):
    # under torch.inference_mode the held cache is an inference tensor, which has no version counter: the
    # replay read it rewritten (k positive again), the NaN did not reproduce, and why() said the call was finite
    monkeypatch.setattr(cache_hooks, "KEPT_BYTES", 0)  # nothing cloned as kept: each tensor held as passed
    with torch.inference_mode():
        twin, user = cache(), cache()
        CachedPipeline(CachedTransformer(), FlowMatchEulerDiscreteScheduler())(twin)
    report = watched(tmp_path, user, mode=torch.inference_mode)
    assert all(torch.equal(user[k].view(torch.uint8), twin[k].view(torch.uint8)) for k in twin)
    (error,) = [a for a in report.anomalies if a.severity == "error"]
    assert (error.kind, error.component, error.module, error.step) == ("nonfinite", "transformer", "", 1)
    failed = [a.message for a in report.anomalies if a.kind == "debugger_error"]
    assert [m.split(" failed ")[0] for m in failed] == ["The debugger's replay", "The debugger's repro_bundle"]
    refused = (  # whole within the 200 characters a debugger_error's message keeps
        "(RuntimeError: an inference_mode cache tensor (over the 0 bytes copied a step) has no version counter: a "
        "change since the call cannot be seen; replay under torch.no_grad() ((1, 2, 4))); the run went on"
    )
    assert all(refused in m for m in failed)
    with pytest.raises(DiffusionDebugError) as refusal:  # no bundle to replay: never "finite"
        report.why()
    assert str(refusal.value) == (
        "why needs the repro bundle of the run's first NaN/Inf error; this run saved none (no error at a component "
        "call, repro_bundle is off, or the bundle could not be made: a debugger_error says why)."
    )


def test_a_strict_use_never_reuses_the_half_s_arguments_a_check_made():
    # a VAE half watched around its VAE's compiled method gets its own arguments made once from the method's
    # call: made by a check (strict=False: a held tensor read as it is now), they were reused by the replay,
    # which read the rewritten cache where it had to refuse
    from types import SimpleNamespace

    from diffusion_debug.diffusion.components.call_sites import CallSiteHooks

    class Half(nn.Module):
        def forward(self, z, kv_cache):
            return z + kv_cache["k"]

    half = Half()

    def decode(z, kv_cache):  # the VAE's method (compiled by the user): the half is called in it
        return half(z * 2, kv_cache=kv_cache)

    def sites_keeping(kv):
        sites = CallSiteHooks.__new__(CallSiteHooks)
        sites.through = {("vae", "decoder"): decode}
        kept = kept_as_passed((torch.ones(2),), {"kv_cache": kv}, [0], state=frozenset({"kv_cache"}))  # held
        sites.kept = {("vae", "decoder"): kept}
        return sites

    site = SimpleNamespace(component="vae", prefix="decoder", module=half)
    kv = {"k": torch.ones(2)}
    sites = sites_keeping(kv)
    kv["k"].neg_()  # rewritten in place after the call
    args, checked = sites.kept_call(site, strict=False)  # a check of the values: read as they are now
    assert torch.equal(args[0], torch.full((2,), 2.0)) and torch.equal(checked["kv_cache"]["k"], -torch.ones(2))
    with pytest.raises(RuntimeError, match="was changed in place since"):
        sites.kept_call(site)
    kv = {"k": torch.ones(2)}
    sites = sites_keeping(kv)
    sites.kept_call(site, strict=False)
    args, replayed = sites.kept_call(site)  # unchanged: made again strictly, the half's arguments as passed
    assert torch.equal(args[0], torch.full((2,), 2.0)) and torch.equal(replayed["kv_cache"]["k"], torch.ones(2))
    assert replayed["kv_cache"]["k"] is not kv["k"]
    kv["k"].neg_()  # a strict making holds copies: a later check reuses it
    _, checked = sites.kept_call(site, strict=False)
    assert torch.equal(checked["kv_cache"]["k"], torch.ones(2))


def test_an_own_state_passed_by_position_is_known_from_the_signature():
    from diffusion_debug.diffusion.components.call_sites import state_positions

    state = frozenset({"kv_cache", "feat_cache"})
    assert state_positions(CachedTransformer().forward, state) == {2: "kv_cache"}
    assert state_positions(lambda x, *rest, kv_cache=None: x, state) == {}
    assert state_positions(print, state) == {}  # no signature to read: nothing by position
    kv, budget = {"k": torch.ones(4)}, [1 << 20]
    args, _ = kept_as_passed((torch.ones(1), 1.0, kv), {}, budget, state=state, positions={2: "kv_cache"})
    assert args[2]["k"] is not kv["k"] and budget == [(1 << 20) - 16]


@pytest.mark.parametrize("by_position", [False, True], ids=["by_keyword", "by_position"])
def test_a_held_inference_tensor_refuses_only_where_its_state_may_be_written_into(by_position, monkeypatch):
    # the Wan VAE's causal convs replace feat_cache's entries (a new tensor), never write into them: held
    # under inference_mode, its copy of the list is as passed and is replayed; FAR's kv_cache is written into
    monkeypatch.setattr(cache_hooks, "KEPT_BYTES", 0)  # the step's bytes of copies, [0] below
    state = frozenset({"kv_cache", "feat_cache"})
    with torch.inference_mode():
        feat, kv = [torch.ones(2)], {"k": torch.ones(2)}

    def kept(name, value):
        if by_position:
            return kept_as_passed((value,), {}, [0], state=state, positions={0: name})
        return kept_as_passed((), {name: value}, [0], state=state)

    passed, (feat_kept, kv_kept) = feat[0], (kept("feat_cache", feat), kept("kv_cache", kv))
    held = feat_kept[0][0] if by_position else feat_kept[1]["feat_cache"]
    assert held[0] is passed  # beyond the bytes copied: held as passed, no clone
    feat[0] = torch.zeros(2)  # the next call's replacement: not in the kept copy
    args, kwargs = kept_as_passed(*feat_kept)
    used = args[0][0] if by_position else kwargs["feat_cache"][0]
    assert torch.equal(used, torch.ones(2)) and used is not passed  # a copy for the replay to write into
    with pytest.raises(RuntimeError) as refused:
        kept_as_passed(*kv_kept)
    assert str(refused.value) == (
        "an inference_mode cache tensor (over the 0 bytes copied a step) has no version counter: a change since the "
        "call cannot be seen; replay under torch.no_grad() ((2,))"
    )


def test_a_call_given_no_tensor_in_a_list_or_dict_clones_nothing():
    sample, cache = torch.ones(2), [None, None]
    with count_aten_ops() as ops:
        args, kwargs = kept_as_passed((sample, cache), {"feat_idx": [0], "scale": 1.0}, budget=[1 << 20])
    assert ops.counts == {} and args[0] is sample and args[1] == cache and args[1] is not cache
    budget = [16]  # 4 floats of the own state: the first is cloned, the second held as passed
    residuals = [torch.ones(4)]  # not the component's own state: held as passed, no op (a ControlNet's)
    kv = {"a": torch.ones(4), "b": torch.ones(4)}
    with count_aten_ops() as ops:
        args, kept = kept_as_passed((residuals,), {"residuals": residuals}, budget=[1 << 20], state=frozenset({"kv"}))
    assert ops.counts == {} and args[0][0] is residuals[0] and kept["residuals"][0] is residuals[0]
    _, kwargs = kept_as_passed((), {"kv": kv}, budget=budget, state=frozenset({"kv"}))
    assert budget == [0] and type(kwargs["kv"]["a"]) is torch.Tensor and type(kwargs["kv"]["b"]).__name__ == "_Held"
    assert kwargs["kv"]["a"] is not kv["a"] and torch.equal(kwargs["kv"]["a"], kv["a"])
    used, _ = kept_as_passed(args, {})  # a use clones: a replay never writes into the user's tensors
    assert used[0][0] is not residuals[0] and torch.equal(used[0][0], residuals[0])
    read, _ = kept_as_passed(args, {}, strict=False)  # a check of the values: nothing cloned
    assert read[0][0] is residuals[0]


def same(a, b) -> bool:
    """``a`` and ``b`` hold the same containers, keys (a tensor key by its values) and tensors, bit for bit."""
    if isinstance(a, torch.Tensor):
        return type(b) is torch.Tensor and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return len(a) == len(b) and all(same(k, j) and same(v, w) for (k, v), (j, w) in zip(a.items(), b.items()))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    return a == b


def test_a_bundle_s_tensor_paths_are_unique_and_its_call_loads_as_saved(tmp_path):
    # {0: a, "0": b} wrote both as kwargs.kv_cache.0 (one lost, the other loaded twice); a key "x.y" beside
    # {"x": {"y": ...}} likewise; a tensor key was written nowhere (the bundle did not load)
    from diffusion_debug.diffusion.replay.bundle import load_call, read_bundle, save_bundle

    def values(start):
        return torch.arange(start, start + 2, dtype=torch.float32)

    kwargs = {
        "kv_cache": {0: values(0), "0": values(2), 1: {"k": values(4)}},
        "by_tensor": {torch.tensor([7.0]): values(6), torch.tensor([7.0]): values(8)},
        "x.y": values(10),
        "x": {"y": values(12), "#0": values(14), "": values(16), "#1": [values(18), (values(20),)]},
        "half": values(22).half(),
    }
    args = (values(24), [values(26), {"0": values(28)}])
    model = CachedTransformer()
    save_bundle(
        tmp_path,
        component="transformer",
        component_module=model,
        call_prefix="",
        args=args,
        kwargs=kwargs,
        step=0,
        timestep=1.0,
        module="root",
        anomaly_kind="nonfinite",
    )
    meta, tensors = read_bundle(tmp_path)
    assert len(tensors) == len(meta["dtypes"]) == 17 and meta["dtypes"]["kwargs.half"] == "float16"
    assert "args.0" in tensors and "kwargs.kv_cache.#1" in tensors and "kwargs.x.y" in tensors
    _, loaded_args, loaded = load_call(tmp_path, model)
    assert same(tuple(loaded_args), args) and same(loaded, kwargs)


def test_a_bundled_dict_keyed_by_layer_index_loads_with_its_keys(tmp_path):
    # FAR's kv_cache is {layer index: {"full_cache": ..., "compressed_cache": ...}}: a bundle wrote its keys as
    # strings, and why()'s replay of the call failed (KeyError: 0): "nothing can be concluded"
    from diffusion_debug.diffusion.replay.bundle import load_call, save_bundle

    kv_cache = {0: {"k": torch.ones(2)}, 1: {"k": torch.zeros(2)}, (2, "a"): None}
    model = CachedTransformer()
    save_bundle(
        tmp_path,
        component="transformer",
        component_module=model,
        call_prefix="",
        args=(torch.ones(1, 2, 4),),
        kwargs={"kv_cache": kv_cache, "named": {"scale": 1.0}},
        step=0,
        timestep=1.0,
        module="root",
        anomaly_kind="nonfinite",
    )
    _, args, kwargs = load_call(tmp_path, model)
    assert list(kwargs["kv_cache"]) == [0, 1, (2, "a")] and kwargs["named"] == {"scale": 1.0}
    loaded = kwargs["kv_cache"]
    assert torch.equal(loaded[0]["k"], torch.ones(2)) and torch.equal(loaded[1]["k"], torch.zeros(2))


def far_pipeline():
    """AnyFlow FAR at the tiny Wan sizes: 3 causal chunks of one latent frame (32x32 video frames), a cache
    step after each chunk but the last writing the chunk's keys and values into ``kv_cache``."""
    import diffusers

    from diffusion_debug.testing import tiny_pipeline

    wan = tiny_pipeline("wan22")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformer = diffusers.AnyFlowFARTransformer3DModel(
            compressed_patch_size=(1, 4, 4),
            full_chunk_limit=2,
            num_attention_heads=2,
            attention_head_dim=12,
            text_dim=32,
            freq_dim=256,
            ffn_dim=32,
            num_layers=2,
            rope_max_seq_len=32,
            chunk_partition=(1, 1, 1),
        ).eval()
    pipe = diffusers.AnyFlowFARPipeline(
        tokenizer=wan.tokenizer,
        text_encoder=wan.text_encoder,
        transformer=transformer,
        vae=wan.vae,
        scheduler=diffusers.FlowMapEulerDiscreteScheduler(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.skipif(not hasattr(diffusers, "AnyFlowFARPipeline"), reason="this diffusers has no AnyFlow FAR")
def test_a_nan_far_s_cache_step_wrote_into_its_kv_cache_is_its_own_state_s_not_said_read_finite(tmp_path):
    # the cache step's output is thrown away (only its kv_cache is kept): the message said "while the
    # output stayed finite" of a call whose output was NaN and never read
    pipe = far_pipeline()
    calls = [0]

    def nan_in_the_first_cache_step(module, args, output):  # the transformer's third call: after chunk 0
        calls[0] += 1
        if calls[0] == 3:
            output = output.clone()
            output.view(-1)[0] = float("nan")
            return output

    handle = pipe.transformer.get_submodule("blocks.0.attn1.to_k").register_forward_hook(nan_in_the_first_cache_step)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    try:
        with dbg:
            pipe(
                prompt_embeds=torch.linspace(-1, 1, 16 * 32).reshape(1, 16, 32),
                negative_prompt_embeds=torch.zeros(1, 16, 32),
                guidance_scale=2.0,
                height=32,
                width=32,
                num_frames=9,
                chunk_partition=[1, 1, 1],
                num_inference_steps=2,
                generator=torch.Generator().manual_seed(0),
                output_type="pt",
            )
    finally:
        handle.remove()
    (error,) = [a for a in dbg.report().anomalies if a.severity == "error"]
    assert (error.kind, error.component, error.module, error.step, error.details["run"]) == (
        "nonfinite",
        "transformer",
        "",
        0,
        2,
    )
    assert (error.details["localized_by"], error.details["arguments"]) == ("its own state", ["kv_cache"])
    assert error.message == (
        "transformer got NaN/Inf back through its own kv_cache, which its earlier calls fill and read back: one of "
        "its modules made it in an earlier call of this denoise whose output was finite or not read (a cache "
        "step's); check transformer's dtype and weights."
    )
    dbg.close()
