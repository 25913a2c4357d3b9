"""Loose ends of earlier sessions: what the debugger keeps of a user's pipeline after it is done
with it (a kept report, a debugger dropped while attached, a call that raised), a NaN/Inf made
between two modules of a component named at a readable place, and two threads each watching its
own pipeline."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from diffusion_helpers import run

from diffusion_debug import DebugConfig, DiffusionDebugError, DiffusionModelDebugger
from diffusion_debug.testing import tiny_pipeline


def cfg(tmp_path, **kwargs):
    return DebugConfig(output_dir=str(tmp_path), log_level="error", **kwargs)


def inf_from(module):
    """A hook making ``module``'s output Inf on every call (its handle)."""
    return module.register_forward_hook(lambda m, a, output: torch.full_like(output, float("inf")))


# -- a debugger never keeps a user's pipeline alive ------------------------------------------------------


def test_a_kept_report_lets_its_pipeline_go_and_why_then_says_so(tmp_path):
    """The report's ``why()`` replays on the live pipeline: it held the pipeline (and every component)
    for as long as the user kept the report. Held weakly now; once the pipeline is gone ``why()`` says
    to replay from the run directory."""
    pipe = tiny_pipeline("sd")
    gone = weakref.ref(pipe)
    handle = inf_from(pipe.unet.conv_in)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        run(pipe, steps=2)
    handle.remove()
    report = dbg.report()
    run_dir = report.save()
    del pipe, dbg, handle
    gc.collect()
    assert gone() is None
    with pytest.raises(DiffusionDebugError) as raised:
        report.why()
    assert str(raised.value) == (
        "why() replays on the pipeline this report was made of, which is gone; "
        f"run `diffusion-debug why {run_dir}` to replay on the pipeline the run directory names."
    )


def test_a_stop_policy_debugger_dropped_while_attached_lets_its_pipeline_go(tmp_path):
    """Policy ``stop`` sets ``pipe._interrupt`` through a patch that a class-level dict of stacks held
    (with its owner) until detach: a debugger dropped while attached kept its pipeline for ever."""
    pipe = tiny_pipeline("sd")
    gone = weakref.ref(pipe)
    handle = inf_from(pipe.unet.conv_in)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, policy="stop"))
    dbg.attach()
    run(pipe, steps=2)
    assert vars(pipe)["_interrupt"] is True
    del pipe, dbg, handle
    gc.collect()
    assert gone() is None


# -- a call that raised: its frame (its locals) let go by report() ---------------------------------------


def test_report_lets_go_of_a_raised_calls_frame_and_its_latents(tmp_path):
    """The busy check keeps the running call's ``__call__`` frame; a call that raised and was caught kept
    it (and its latents, embeddings) until the debugger's next hook or detach, so a user's ``except``
    that dropped everything and asked for the report still held the call's tensors."""
    pipe = tiny_pipeline("sd")
    made = {}

    def raises(pipe, step, timestep, values):
        if step == 1:
            made["latents"] = weakref.ref(values["latents"])
            raise RuntimeError("stopped by the user")
        return values

    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        with pytest.raises(RuntimeError):
            run(pipe, steps=3, callback_on_step_end=raises)
        report = dbg.report()
        gc.collect()
        assert made["latents"]() is None
        assert [row["step"] for row in report.steps] == [0, 1]
        assert [row["step"] for row in dbg.report().steps] == [0, 1]  # the same run, ended once
        run(pipe, steps=2)  # the next call: a run of its own
        try:
            run(pipe, steps=3, callback_on_step_end=raises)
        except RuntimeError:
            dbg.report()  # asked in the handler: its exception holds the frame (the detach may see it raised on)
        dbg.report()  # after it: let go
        gc.collect()
        assert made["latents"]() is None
    assert dbg.get_summary()["runs"] == 3


# -- a ComponentsManager's call that raised: its held findings in the report -------------------------------


def test_a_managers_held_encoder_finding_is_in_the_report_after_a_call_that_raised(tmp_path):
    """A ComponentsManager keeps no pipeline frame, so no call of its pipelines is seen ending: an encoder's
    NaN/Inf in a hidden state the loop may not read (SDXL's CLIP last layer) stayed held, missing from every
    ``report()`` until detach, after a call that raised and also after a whole call. Settled now by
    ``report()`` when no pipeline call runs, as a DiffusionPipeline's is."""
    from diffusers.modular_pipelines import ComponentsManager
    from diffusers.modular_pipelines.stable_diffusion_xl import StableDiffusionXLAutoBlocks

    from diffusion_debug.testing import plant_nonfinite
    from diffusion_debug.testing.features import HAS_MODULAR

    if not HAS_MODULAR:
        pytest.skip("this diffusers has no modular pipelines")
    components = {k: v for k, v in tiny_pipeline("sdxl").components.items() if v is not None}
    manager = ComponentsManager()
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        manager.add(name, components[name])
    pipe = StableDiffusionXLAutoBlocks().init_pipeline(components_manager=manager)
    pipe.update_components(**components)
    module = next(n for n, _ in pipe.text_encoder.named_modules() if n.endswith("encoder.layers.1.mlp.fc2"))

    def call():
        generator = torch.Generator().manual_seed(0)
        return pipe(prompt="a cat", num_inference_steps=2, height=32, width=32, generator=generator)

    def stop(module, args):
        raise RuntimeError("stopped inside the UNet")

    def found():
        return [(a.severity, a.module, a.details.get("unread_output")) for a in dbg.report().anomalies]

    dbg = DiffusionModelDebugger(manager, cfg(tmp_path))
    with plant_nonfinite(pipe.text_encoder.get_submodule(module), value=float("nan")), dbg:
        handle = pipe.unet.conv_in.register_forward_pre_hook(stop)  # inside the UNet's call: given finite values
        with pytest.raises(RuntimeError):
            call()
        handle.remove()
        assert found() == [("warning", module, True)]
        call()
        # the same module's finding folded; then the 2 'leading' steps of the scheduler the manager holds,
        # watched as a pipeline's (a run a call)
        assert found() == [("warning", module, True), ("warning", "", None)]
        assert dbg.report().anomalies[-1].kind == "scheduler_config"


# -- a NaN/Inf a component's own forward makes at either end of its modules: a readable place -------------


def reading(module: str, given: float, made: float):
    from diffusion_debug.probes import ModuleReading

    return ModuleReading(module, 0, "float32", given, made)


INF = float("inf")


def test_between_modules_names_a_place_at_either_end_of_the_modules():
    """Where no module inside the producer returned before the first one given the NaN/Inf (its own code
    made it before its first module), or none was given it (after them): no place was named before."""
    from diffusion_debug.diffusion.replay.decide import between_modules

    middle = [reading("a", 1, 1), reading("b.x", INF, INF), reading("b", INF, INF), reading("", 1, INF)]
    first = [reading("a.x", INF, INF), reading("a", INF, INF), reading("b", INF, INF), reading("", 1, INF)]
    last = [reading("a", 1, 1), reading("b.x", 1, 1), reading("b", 1, 1), reading("", 1, INF)]
    leaf = [reading("", 1, INF)]
    inner = [reading("a", 1, 1), reading("b.x", 1, 1), reading("b", 1, INF), reading("", INF, INF)]
    assert between_modules(middle, "") == {"after": "a", "before": "b"}
    assert between_modules(first, "") == {"before": "a"}
    assert between_modules(last, "") == {"after": "b"}
    assert between_modules(leaf, "") == {}
    assert between_modules(inner, "b") == {"after": "b.x"}


@pytest.mark.parametrize("level", ["basic", "extreme"])
def test_an_inf_made_after_a_components_last_module_is_named_there(tmp_path, level):
    """The UNet's output made Inf by its own code after its modules (a hook on the UNet itself here): the
    error said only "unet produced NaN/Inf from finite inputs"; now where, in words. Full probes (level
    ``extreme``) named no place even between two modules, where a replay did."""
    pipe = tiny_pipeline("sd")

    def inf_output(module, args, output):  # (the pipeline asks for a tuple)
        return (output[0] * INF, *output[1:])

    handle = pipe.unet.register_forward_hook(inf_output)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level=level))
    with dbg:
        run(pipe, steps=2)
    handle.remove()
    (error,) = [a for a in dbg.report().anomalies if a.severity == "error"]
    assert (error.component, error.module, error.step, error.details["after"]) == ("unet", "", 0, "conv_out")
    assert "before" not in error.details
    assert error.message == (
        "unet produced NaN/Inf from finite inputs in its own forward, after its modules: every module in it was "
        "given and returned finite values (the last to return: unet.conv_out), its output was not (check its "
        "dtype, inputs and weights; try float32 or bfloat16)."
    )


def test_full_probes_name_an_inf_made_between_two_modules_as_a_replay_does(tmp_path):
    """The input of the UNet's conv_in made Inf by its own code (a pre-hook here): a replay named it between
    time_embedding and conv_in; full probes named only the UNet."""
    pipe = tiny_pipeline("sd")
    handle = pipe.unet.conv_in.register_forward_pre_hook(lambda module, args: (args[0] * INF,))
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="extreme"))
    with dbg:
        run(pipe, steps=2)
    handle.remove()
    (error,) = [a for a in dbg.report().anomalies if a.severity == "error"]
    assert (error.module, error.details["after"], error.details["before"]) == ("", "time_embedding", "conv_in")


# -- two threads, each watching its own pipeline -----------------------------------------------------------


def test_two_threads_each_watching_its_own_pipeline_run_as_plain_runs(tmp_path):
    """The class-level registries (a scheduler class's dispatcher, ``_COPIES``, the patch chains) are shared
    by the two debuggers, whose pipelines' schedulers are of one class: attached, run and detached at once
    in two threads, three times, each run returns its plain image and each report its own steps, and the
    class is as it was."""
    import sys
    import threading

    import numpy as np

    pipes = [tiny_pipeline("sd", seed=seed) for seed in (0, 1)]
    plain = [run(pipe, steps=2) for pipe in pipes]
    scheduler_class = type(pipes[0].scheduler)
    before = dict(vars(scheduler_class))
    start = threading.Barrier(2)
    results: dict[int, list] = {0: [], 1: []}
    failures: list[BaseException] = []

    def watch(index: int) -> None:
        try:
            for round_ in range(3):
                dbg = DiffusionModelDebugger(pipes[index], cfg(tmp_path / f"{index}-{round_}"))
                start.wait(timeout=60)
                with dbg:
                    image = run(pipes[index], steps=2)
                results[index].append((image, [row["step"] for row in dbg.report().steps], dbg.report().anomalies))
                dbg.close()
        except BaseException as error:  # noqa: BLE001 (the test's thread: raised again in the test)
            failures.append(error)
            start.abort()

    threads = [threading.Thread(target=watch, args=(index,)) for index in (0, 1)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads switch at nearly every bytecode: the registries' races show
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        sys.setswitchinterval(interval)
    assert failures == []
    for index in (0, 1):
        assert len(results[index]) == 3
        for image, steps, anomalies in results[index]:
            assert np.array_equal(image, plain[index])
            assert steps == [0, 1]
            assert [a.kind for a in anomalies if a.kind != "scheduler_config"] == []
    assert dict(vars(scheduler_class)) == before


def test_two_threads_patching_one_class_at_once_leave_it_as_it_was(monkeypatch):
    """Thread one, making the class's dispatcher, is paused where another thread's attach could run (before
    it registers it); thread two patches another instance of the class meanwhile. Unlocked, one then
    registered its dispatcher over two's, whose detach put two's back on the class for good; now two waits
    for one (it says so as it waits, and one goes on)."""
    import threading

    from diffusion_debug.diffusion import pipeline_patches as patches

    class Stepper:
        def step(self, x):
            return x + 1

    original, first, second = Stepper.__dict__["step"], Stepper(), Stepper()
    inside, waited = threading.Event(), threading.Event()
    wraps, lock = patches._wraps, getattr(patches, "_LOCK", None)

    def paused(wrapper, wrapped):
        if threading.current_thread().name == "one" and wrapper.__name__ == "dispatch":
            inside.set()
            waited.wait(timeout=60)
        return wraps(wrapper, wrapped)

    class Announcing:  # the lock, saying when thread two waits for it
        def __enter__(self):
            if threading.current_thread().name == "two":
                waited.set()
            return lock.__enter__()

        def __exit__(self, *raised):
            return lock.__exit__(*raised)

    monkeypatch.setattr(patches, "_wraps", paused)
    if lock is not None:
        monkeypatch.setattr(patches, "_LOCK", Announcing())
    made = {}

    def one():
        made["one"] = patches.MethodPatch(first, "step", lambda inner: lambda x: inner(x) * 10)

    def two():
        inside.wait(timeout=60)
        made["two"] = patches.MethodPatch(second, "step", lambda inner: lambda x: inner(x) * 100)
        waited.set()

    threads = [threading.Thread(target=one, name="one"), threading.Thread(target=two, name="two")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert (first.step(1), second.step(1), Stepper().step(1)) == (20, 200, 2)
    made["one"].remove()
    made["two"].remove()
    assert Stepper.__dict__["step"] is original
    assert (Stepper, "step") not in patches._DISPATCHERS


def test_a_kept_report_of_a_raised_call_with_faster_cache_lets_its_pipeline_go(tmp_path):
    """read24: the raised call's hooks' state the report keeps for ``why()`` (a WeakKeyDictionary by
    component) holds the hooks' attributes: FasterCache's denoiser hook, on the transformer itself, holds
    its ``fn_ref`` (the transformer's bound forward), so the value keeps its own key, and the
    ``current_timestep_callback`` keeps the pipeline."""
    from diffusers import FasterCacheConfig

    from diffusion_debug.testing.faults import plant_nonfinite

    pipe = tiny_pipeline("flux")
    pipe.transformer.enable_cache(
        FasterCacheConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 901),
            current_timestep_callback=lambda p=pipe: p.current_timestep,
            is_guidance_distilled=True,
        )
    )
    gone, component = weakref.ref(pipe), weakref.ref(pipe.transformer)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, policy="raise"))
    with dbg, plant_nonfinite(pipe.transformer.get_submodule("transformer_blocks.0.ff.net.2"), from_call=2):
        with pytest.raises(DiffusionDebugError):
            pipe("a cat", num_inference_steps=3, height=32, width=32, output_type="latent")
    assert dbg._steps.calls.raised_states  # the raise's state was kept
    report = dbg.report()
    del pipe, dbg
    gc.collect()
    assert (gone(), component()) == (None, None)
    assert report is not None
