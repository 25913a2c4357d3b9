"""A second origin in one run: after the user's step-end callback cleaned the latents, another module
(or, after a NaN the run was given, a module; or another component's, the VAE's) makes a NaN/Inf from finite
arguments at a later step or in FreeInit's later pass. Each origin is named once, at its module and step; a
repeat of an origin still counts at its entry, also after another's (A, B, A). Not caught (a limit,
``origins.cleaned_away``): the VAE's own NaN made before its decoder call (``post_quant_conv``)."""

from __future__ import annotations

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import tiny_pipeline

FIRST, SECOND = "down_blocks.0.resnets.0.conv1", "up_blocks.1.resnets.0.conv2"


@pytest.fixture(scope="module")
def sd():
    return tiny_pipeline("sd")


def plant_at_steps(unet: torch.nn.Module, module: str, steps: set[int], when=lambda: True):
    """NaN out of ``module`` (a resnet's conv) at the denoising ``steps`` (counted in the order the steps'
    time embeddings are first seen) while ``when()``, told by the ``temb`` its resnet is given: a replay of
    the step's call makes it again, as a real fault does."""
    resnet, seen, now = unet.get_submodule(module.rpartition(".")[0]), [], {}

    def before(block, args, kwargs):
        temb = kwargs["temb"] if "temb" in kwargs else args[1]  # (input_tensor, temb)
        key = float(temb.double().sum())
        if key not in seen:
            seen.append(key)
        now["step"] = seen.index(key)

    def after(conv, args, output):
        return torch.full_like(output, float("nan")) if now["step"] in steps and when() else None

    return [
        resnet.register_forward_pre_hook(before, with_kwargs=True),
        unet.get_submodule(module).register_forward_hook(after),
    ]


def clean(p, i, t, kwargs):
    """The user's step-end callback: NaN in the latents become 0 (the loop goes on finite)."""
    return {"latents": torch.nan_to_num(kwargs["latents"], nan=0.0)}


def nan_at(step: int):
    """The user's step-end callback that puts NaN into the latents at the end of ``step`` and cleans them
    (:func:`clean`) at the end of every other step."""

    def callback(p, i, t, kwargs):
        return {"latents": torch.full_like(kwargs["latents"], float("nan"))} if i == step else clean(p, i, t, kwargs)

    return callback


def given_latents(callback) -> dict:
    """A pipeline call's keyword arguments passing ``callback`` as the step-end callback, given the latents."""
    return dict(callback_on_step_end=callback, callback_on_step_end_tensor_inputs=["latents"])


def call_sd(pipe, tmp_path, plants, probes=None, callback=None):
    """A 5-step call of ``pipe`` under a debugger (full ``probes``, or the default), NaN planted out of each
    ``(module, steps)`` of ``plants``, ``callback`` (None: none) the step-end callback; the report."""
    handles = [h for module, steps in plants for h in plant_at_steps(pipe.unet, module, steps)]
    config = DebugConfig(output_dir=str(tmp_path), log_level="error", **({"probes": probes} if probes else {}))
    dbg = DiffusionModelDebugger(pipe, config)
    kwargs = given_latents(callback) if callback is not None else {}
    try:
        with dbg:
            generator = torch.Generator().manual_seed(0)
            pipe("a cat", num_inference_steps=5, generator=generator, output_type="np", **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    dbg.close()
    return dbg.report()


def freeinit_pipe():
    """The tiny AnimateDiff pipeline denoising twice a call (FreeInit's two passes, no fast sampling)."""
    pipe = tiny_pipeline("animatediff")
    pipe.enable_free_init(num_iters=2, use_fast_sampling=False)
    return pipe


def call_freeinit(pipe, tmp_path, callback, handles=(), **config):
    """One 2-step call of :func:`freeinit_pipe`'s ``pipe`` under a debugger (``config``: its DebugConfig's),
    ``callback`` the step-end callback; the planted ``handles`` removed after it. The debugger, closed."""
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", **config))
    try:
        with dbg:
            kwargs = dict(num_frames=2, height=32, width=32, num_inference_steps=2, output_type="pt")
            pipe("a cat", generator=torch.Generator().manual_seed(0), **given_latents(callback), **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    dbg.close()
    return dbg


def nonfinite(report):
    return [
        (a.severity, a.component, a.module, a.step, a.details["count"])
        for a in report.anomalies
        if a.kind == "nonfinite"
    ]


@pytest.mark.parametrize("probes", [None, "full"])
def test_another_modules_nan_after_the_callback_cleaned_the_latents_is_a_second_origin(sd, tmp_path, probes):
    """Step 1's NaN from one UNet conv, cleaned by the callback, and step 3's from another: two errors,
    each at its module and step (the second had counted at the first: one fold key a component)."""
    report = call_sd(
        sd,
        tmp_path,
        [(FIRST, {1}), (SECOND, {3})],
        probes,
        callback=clean,
    )
    assert nonfinite(report) == [("error", "unet", FIRST, 1, 1), ("error", "unet", SECOND, 3, 1)]
    assert (report.headline.module, report.headline.step) == (FIRST, 1)


def test_the_same_modules_nan_again_after_the_callback_cleaned_still_counts_at_its_entry(sd, tmp_path):
    report = call_sd(sd, tmp_path, [(FIRST, {1, 3})], callback=clean)
    (error,) = [a for a in report.anomalies if a.kind == "nonfinite"]
    assert (error.severity, error.module, error.step, error.details["count"], error.details["last_step"]) == (
        "error",
        FIRST,
        1,
        2,
        3,
    )


def test_a_module_nan_after_the_callbacks_own_nan_was_cleaned_is_a_second_origin(sd, tmp_path):
    """The callback's NaN (the end of step 0: the UNet receives it at step 1, the callback's error) and,
    once it cleaned the latents, a UNet module's at step 3: the callback and the module, each once (the
    module's had counted at the UNet's step 1, a consequence of the callback's)."""
    report = call_sd(sd, tmp_path, [(SECOND, {3})], callback=nan_at(0))
    assert nonfinite(report) == [
        ("error", "callback", "callback_on_step_end", 0, 1),
        ("warning", "unet", "", 1, 1),
        ("error", "unet", SECOND, 3, 1),
    ]
    assert report.anomalies[[a.kind for a in report.anomalies].index("nonfinite") + 1].details["origin"] == (
        "callback callback_on_step_end, step 0"
    )


def test_another_modules_nan_in_freeinits_next_pass_after_the_callback_cleaned_is_a_second_origin(tmp_path):
    """FreeInit's passes are runs of one call sharing its origin: the first pass's NaN at step 1 (cleaned
    by the callback) and another module's at the second pass's step 0 are two errors, each with its run."""
    pipe, ended = freeinit_pipe(), []

    def at(calls: int):
        def hook(module, args, output):
            return torch.full_like(output, float("nan")) if len(ended) == calls else None

        return hook

    def cleaning(p, i, t, kwargs):
        ended.append(i)
        return clean(p, i, t, kwargs)

    handles = [
        pipe.unet.get_submodule(FIRST).register_forward_hook(at(1)),  # the first pass's step 1
        pipe.unet.get_submodule(SECOND).register_forward_hook(at(2)),  # the second pass's step 0
    ]
    dbg = call_freeinit(pipe, tmp_path, cleaning, handles, probes="full")
    found = [
        (a.severity, a.module, a.step, a.details["run"], a.details["count"])
        for a in dbg.report().anomalies
        if a.kind == "nonfinite"
    ]
    assert ended == [0, 1, 0, 1]
    assert found == [("error", FIRST, 1, 1, 1), ("error", SECOND, 0, 2, 1)]


def test_each_freeinit_pass_has_its_own_debug_timeout_of_replays(tmp_path):
    """A pass is a run: the budget of replays (``debug_timeout``) is each pass's, as its steps are; the first
    pass's replay (here: all of a budget of 1e-9 s) leaves the second pass's NaN/Inf, another origin, its own
    replay, which names its module (a shared budget left it named at the UNet alone)."""
    pipe, ended = freeinit_pipe(), []

    def cleaning(p, i, t, kwargs):
        ended.append(i)
        return clean(p, i, t, kwargs)

    handles = [
        *plant_at_steps(pipe.unet, FIRST, {0}, when=lambda: len(ended) < 2),  # the first pass's step 0
        *plant_at_steps(pipe.unet, SECOND, {0}, when=lambda: len(ended) >= 2),  # the second pass's step 0
    ]
    dbg = call_freeinit(pipe, tmp_path, cleaning, handles, debug_timeout=1e-9)
    found = [
        (a.severity, a.module, a.step, a.details["run"], a.details["localized_by"])
        for a in dbg.report().anomalies
        if a.kind == "nonfinite"
    ]
    replayed = "output check -> replay with full probes"
    assert found == [("error", FIRST, 0, 1, replayed), ("error", SECOND, 0, 2, replayed)]
    events = dbg.record.events
    assert [(e["type"], e["component"]) for e in events if e["type"] in ("replay", "replay_skipped")] == [
        ("replay", "unet"),
        ("replay", "unet"),
    ]


@pytest.mark.parametrize("returns", ["nothing", "the latents"])
def test_a_nan_freeinits_own_code_makes_between_passes_is_the_pipelines_not_the_callbacks(tmp_path, returns):
    """FreeInit's re-noising between two passes (its frequency filter) makes the NaN the second pass's step
    0 receives; the step-end callback passed left finite latents at the first pass's end (returning nothing,
    or them unchanged): the pipeline's own code between the passes is named, not the callback, and the message
    says FreeInit and which passes (it had said "between calls")."""
    pipe = freeinit_pipe()
    pipe._apply_freq_filter = lambda x, noise, low_pass_filter: torch.full_like(x, float("nan"))

    def callback(p, i, t, kwargs):
        return {} if returns == "nothing" else {"latents": kwargs["latents"]}

    dbg = call_freeinit(pipe, tmp_path, callback)  # (a pipeline of its own: the planted filter goes with it)
    (error,) = [a for a in dbg.report().anomalies if a.severity == "error"]
    assert (error.kind, error.component, error.module, error.step, error.details["run"]) == (
        "nonfinite",
        "pipeline",
        "",
        0,
        2,
    )
    assert error.message.startswith("unet received non-finite ")
    assert error.message.endswith(
        "that no watched component and no pipeline input made: the pipeline's own code between FreeInit passes 1 "
        "and 2 produced it (FreeInit re-noises the latents there: its frequency filter, a dtype cast); check the "
        "FreeInit options (enable_free_init) and the dtypes of the pipeline's components."
    )
    assert error.details["between_passes"] == [1, 2]


def test_the_callbacks_nan_after_it_cleaned_a_modules_is_a_second_origin(sd, tmp_path):
    """A UNet module's NaN at step 1, which the callback cleans, then the callback's own NaN at the end of
    step 2 (the UNet receives it at step 3): the module and the callback, each once, the UNet's step 3 a
    warning pointing at the callback (it had counted at the module's entry)."""
    report = call_sd(sd, tmp_path, [(FIRST, {1})], callback=nan_at(2))
    assert nonfinite(report) == [
        ("error", "unet", FIRST, 1, 1),
        ("error", "callback", "callback_on_step_end", 2, 1),
        ("warning", "unet", "", 3, 1),
    ]
    warning = [a for a in report.anomalies if a.kind == "nonfinite"][2]
    assert warning.details["origin"] == "callback callback_on_step_end, step 2"


VAE_MODULE = "decoder.up_blocks.0.resnets.0.conv2"


def nan_out(module, args, output):
    """A forward hook: the module's output all NaN, from whatever it was given."""
    return torch.full_like(output, float("nan"))


@pytest.mark.parametrize("probes", [None, "full"])
def test_the_vaes_own_nan_after_the_callback_cleaned_the_unets_is_a_second_origin(sd, tmp_path, probes):
    """The UNet's NaN at step 1, cleaned by the callback, then a VAE module's NaN made from the finite
    latents it decodes: two errors, the VAE's at its module with its finite arguments said (it had been a
    warning pointing at the UNet's)."""
    plant = sd.vae.get_submodule(VAE_MODULE).register_forward_hook(nan_out)
    try:
        report = call_sd(
            sd,
            tmp_path,
            [(FIRST, {1})],
            probes,
            callback=clean,
        )
    finally:
        plant.remove()
    assert nonfinite(report) == [("error", "unet", FIRST, 1, 1), ("error", "vae", VAE_MODULE, None, 1)]
    vae = [a for a in report.anomalies if a.kind == "nonfinite"][1]
    assert vae.details["arguments_finite"] is True
    assert "origin" not in vae.details


def test_the_vaes_nan_after_an_uncleaned_unet_nan_is_still_the_unets_consequence(sd, tmp_path):
    """No callback: the latents the VAE decodes hold the UNet's NaN; the VAE's NaN is a warning pointing at it."""
    plant = sd.vae.get_submodule(VAE_MODULE).register_forward_hook(nan_out)
    try:
        report = call_sd(sd, tmp_path, [(FIRST, {1})])
    finally:
        plant.remove()
    found = [a for a in report.anomalies if a.kind == "nonfinite"]
    assert [(a.severity, a.component, a.module, a.step) for a in found] == [
        ("error", "unet", FIRST, 1),
        ("warning", "vae", "", None),
    ]
    assert found[1].details["origin"] == f"unet {FIRST}, step 1 (t=601)"
    assert "arguments_finite" not in found[1].details


@pytest.fixture(scope="module")
def sd16():
    return tiny_pipeline("sd", dtype=torch.float16)  # its UNet's block sentinel names the block a NaN came out of


@pytest.mark.parametrize(
    ("pipe", "probes", "steps"),
    [("sd16", None, (0, 2, 3)), ("sd", None, (0, 2, 4)), ("sd", "full", (1, 2, 3)), ("sd", "full", (0, 2, 4))],
)
def test_an_origin_again_after_another_counts_at_its_own_entry(request, tmp_path, pipe, probes, steps):
    """A (step a), B (step b), A again (step c), the callback cleaning after each: two errors, A's counted twice
    with its last step c, B's once (A's repeat had counted at B's entry, the latest). c right after b is a repeat,
    not localised again (its block, or its module, says whose); after a clean step it is localised again."""
    a, b, c = steps
    report = call_sd(
        request.getfixturevalue(pipe),
        tmp_path,
        [(FIRST, {a, c}), (SECOND, {b})],
        probes,
        callback=clean,
    )
    found = [e for e in report.anomalies if e.kind == "nonfinite"]
    assert [(e.severity, e.module, e.step, e.details["count"], e.details.get("last_step")) for e in found] == [
        ("error", FIRST, a, 2, c),
        ("error", SECOND, b, 1, None),
    ]


def test_after_an_origin_again_what_follows_points_at_it(sd, tmp_path):
    """A (step 0), B (step 2), A (step 3), the callback cleaning only after steps 0 and 2: the NaN A made at step 3
    reaches step 4's UNet and the VAE, which count at A's entry and point at it (they had B's, the latest origin)."""

    def clean_twice(p, i, t, kwargs):
        return clean(p, i, t, kwargs) if i in (0, 2) else {}

    report = call_sd(
        sd,
        tmp_path,
        [(FIRST, {0, 3}), (SECOND, {2})],
        callback=clean_twice,
    )
    found = [e for e in report.anomalies if e.kind == "nonfinite"]
    assert [(e.severity, e.component, e.module, e.step, e.details["count"]) for e in found] == [
        ("error", "unet", FIRST, 0, 3),
        ("error", "unet", SECOND, 2, 1),
        ("warning", "vae", "", None, 1),
    ]
    assert found[2].details["origin"] == f"unet {FIRST}, step 0 (t=801)"


def test_a_nan_made_between_two_runs_of_one_call_without_freeinit_names_the_runs():
    from diffusion_debug.diffusion.origins import between_origin

    made = between_origin(["sample"], seen_in="unet", step=0, timestep=None, phase="denoise", passes=(2, False))
    assert made.details["between_passes"] == [2, 3]
    assert made.message == (
        "unet received non-finite sample that no watched component and no pipeline input made: the pipeline's own "
        "code between its runs 2 and 3 in one call produced it (a division, a log, a dtype cast); check the "
        "pipeline's options and the dtypes of its components."
    )


def test_a_module_named_where_no_count_ran_is_an_entry_of_its_component():
    """An Inf a block clipped is named without a count (``Localizer._clipped_inf``): its module is an entry all
    the same, so its NaN/Inf again after another origin's counts there, not as a third origin."""
    from diffusion_debug.diffusion.replay.decide import ReplayMemory, Source

    memory = ReplayMemory()
    memory.reported.setdefault("unet", False)  # as _clipped_inf and _nonfinite_at name it
    memory.named.setdefault("unet", FIRST)
    assert memory.count("unet", Source(SECOND, "full probes", False), None, 1) == (False, True)
    assert memory.count("unet", Source(FIRST, "full probes", False), None, 3) == (False, False)
    assert memory.named["unet"] == FIRST


def test_the_vaes_nan_after_a_clipped_unet_inf_is_still_the_unets_consequence(tmp_path):
    """fp16: the UNet's conv_out makes Inf at step 4, clipped to 65504 (no NaN reaches the latents, nothing for a
    callback to clean), and the VAE's conv_in (weights x40) overflows on those latents: the VAE's NaN is a warning
    pointing at the UNet's clipped Inf, not a second origin (finite arguments proved nothing here)."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    with torch.no_grad():
        pipe.vae.decoder.conv_in.weight.mul_(40)
    pipe.unet.conv_out = torch.nn.Sequential(pipe.unet.conv_out, Clip())
    pipe.scheduler.set_timesteps(5)
    last, now = float(pipe.scheduler.timesteps[-1]), {}

    def timestep(unet, args, kwargs):
        now["t"] = float(torch.as_tensor(kwargs.get("timestep", args[1] if len(args) > 1 else None)).flatten()[0])

    def inf(conv, args, output):
        return torch.full_like(output, float("inf")) if now["t"] == last else None

    pipe.unet.register_forward_pre_hook(timestep, with_kwargs=True)
    pipe.unet.conv_out[0].register_forward_hook(inf)
    report = call_sd(pipe, tmp_path, [], callback=lambda p, i, t, kwargs: {})
    found = [a for a in report.anomalies if a.kind == "nonfinite"]
    assert [(a.severity, a.component, a.module, a.step) for a in found] == [
        ("error", "unet", "conv_out.0", 4),
        ("warning", "vae", "decoder.conv_in", None),
    ]
    assert found[0].details["clipped_in"] == "conv_out"
    assert found[1].details["origin"] == "unet conv_out.0, step 4 (t=1)"
    assert "arguments_finite" not in found[1].details


class Clip(torch.nn.Module):
    """float16's clip of an Inf to its largest value (as a model that clamps its output does)."""

    def forward(self, x):
        return x.clamp(-65504, 65504)


def counted_replays(monkeypatch, answer=lambda replay, localizer, call: replay(localizer, *call)):
    """``Localizer.replay`` counted (``answer(replay, localizer, call)``: what each gives back): the count, a list."""
    from diffusion_debug.diffusion.localize import Localizer

    calls, replay = [], Localizer.replay

    def counted(localizer, *call):
        calls.append(call[2])
        return answer(replay, localizer, call)

    monkeypatch.setattr(Localizer, "replay", counted)
    return calls


@pytest.mark.parametrize("gives", ["nothing", "spent"])
def test_a_nan_no_replay_says_whose_after_two_origins_counts_at_the_latest(sd, tmp_path, monkeypatch, gives):
    """A (step 0), B (step 2), A again (steps 3, 4), the callback cleaning after each, fp32 (no reading names the
    block): where the replay at step 3 gives nothing (it failed, or the NaN did not come again), or the run's
    debug_timeout of replays is spent by then (no replay asked), A's NaN counts at the latest entry, B's, as a
    repeat (it had opened a third origin, ``unet ''``); step 4, right after, is not replayed either."""

    def answer(replay, localizer, call):
        if len(calls) > 2 and gives == "nothing":
            return None  # (a failed replay, or one whose NaN did not come again)
        found = replay(localizer, *call)
        if len(calls) == 2 and gives == "spent":
            localizer.memory.seconds = localizer.config.debug_timeout  # the budget spent by B's replay
        return found

    calls = counted_replays(monkeypatch, answer)
    report = call_sd(sd, tmp_path, [(FIRST, {0, 3, 4}), (SECOND, {2})], callback=clean)
    found = [e for e in report.anomalies if e.kind == "nonfinite"]
    assert [(e.severity, e.module, e.step, e.details["count"], e.details.get("last_step")) for e in found] == [
        ("error", FIRST, 0, 1, None),
        ("error", SECOND, 2, 3, 4),
    ]
    assert calls == ([0, 2, 3] if gives == "nothing" else [0, 2])


def test_after_a_replay_placed_a_nan_at_an_entry_the_next_steps_count_there_unreplayed(sd, tmp_path, monkeypatch):
    """A (step 0), B (step 2), A (steps 3 and 4), fp32: step 3's replay places it at A's entry; step 4, right after,
    counts there without a replay (each later NaN call had been replayed until debug_timeout)."""
    calls = counted_replays(monkeypatch)
    report = call_sd(sd, tmp_path, [(FIRST, {0, 3, 4}), (SECOND, {2})], callback=clean)
    found = [e for e in report.anomalies if e.kind == "nonfinite"]
    assert [(e.severity, e.module, e.step, e.details["count"], e.details.get("last_step")) for e in found] == [
        ("error", FIRST, 0, 3, 4),
        ("error", SECOND, 2, 1, None),
    ]
    assert calls == [0, 2, 3]
