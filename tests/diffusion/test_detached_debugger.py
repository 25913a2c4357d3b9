"""A detached debugger the user keeps (to call ``report()`` later) holds the pipeline's components
weakly (``diffusion.components.detached``): a component replaced or deleted after ``with dbg:`` is
let go at once, as without the debugger; ``report()`` still works, and the next attach follows the
pipeline as it is now and names a fault of the new component at its module and step."""

from __future__ import annotations

import collections
import copy
import dataclasses
import gc
import weakref

import pytest
import torch
from diffusion_helpers import run

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion.components import detached
from diffusion_debug.testing import tiny_pipeline

CONV = "up_blocks.1.resnets.0.conv2"


def with_nan_weight(module: torch.nn.Module, name: str) -> torch.nn.Module:
    copied = copy.deepcopy(module)
    with torch.no_grad():
        copied.get_submodule(name).weight[0, 0, 0, 0] = float("nan")
    return copied


@pytest.mark.usefixtures("only_the_tests_objects")  # its gc.collect() walks only what the test made
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # fp16: the sentinel's and full probes' state
def test_a_kept_detached_debugger_lets_a_replaced_component_go_reports_and_follows_the_new_one(tmp_path, dtype):
    pipe = tiny_pipeline("sd", dtype=dtype)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    for _ in range(2):  # a reused debugger: what its attach worked out is kept
        with dbg:
            run(pipe, steps=2)
    unet, vae = weakref.ref(pipe.unet), weakref.ref(pipe.vae)
    parts = [weakref.ref(part) for c in (pipe.unet, pipe.vae) for part in (*c.modules(), *c.parameters())]
    pipe.unet = with_nan_weight(pipe.unet, CONV)
    del pipe.vae  # deleted: the pipeline runs without it below (output_type="latent")
    pipe.register_modules(vae=None)
    gc.collect()
    assert unet() is None and vae() is None  # nothing of the debugger's holds what the pipeline let go of
    assert [part for part in parts if part() is not None] == []  # nor a block of it (fp16: its sentinel's)
    report = dbg.report()
    assert [row["step"] for row in report.steps] == [0, 1, 0, 1] and set(report.components) >= {"unet", "vae"}
    with dbg:
        run(pipe, steps=2, output_type="latent")
    (error,) = [a for a in dbg.report().anomalies if a.kind == "nonfinite" and a.details.get("run") == 3]
    assert (error.component, error.module, error.step) == ("unet", CONV, 0)
    changes = [(e["component"], e["change"]) for e in dbg.record.events if e["type"] == "component_replaced"]
    assert changes == [("unet", "replaced"), ("vae", "removed")]
    dbg.close()


def test_a_reattach_with_every_component_alive_holds_them_again_as_they_were(tmp_path):
    """Detached, each place holds a weak reference; the next attach puts the very modules back (no
    change recorded, the same call sites), and the images stay bitwise the unwatched pipeline's."""
    pipe = tiny_pipeline("sd")
    plain = run(pipe, steps=2)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        run(pipe, steps=2)
    sites = list(dbg._steps.calls.sites)
    assert all(isinstance(c.module, weakref.ref) for c in dbg._components)  # (dbg.components: held again)
    assert [c.module for c in dbg.components] == [pipe.unet, pipe.vae, pipe.text_encoder]
    with dbg:
        assert [c.module for c in dbg.components] == [pipe.unet, pipe.vae, pipe.text_encoder]
        assert dbg._steps.calls.sites == sites and all(isinstance(s.module, torch.nn.Module) for s in sites)
        images = run(pipe, steps=2)
    assert (images == plain).all()
    assert not [e for e in dbg.record.events if e["type"] == "component_replaced"]
    dbg.close()


@pytest.mark.usefixtures("only_the_tests_objects")
@pytest.mark.parametrize("kind", ["sd3", "flux"])  # flux: a diffusers hook registry on the transformer
def test_a_kept_detached_debugger_lets_a_replaced_transformer_go(tmp_path, kind):
    """The tree memo's key holds a component's diffusers hook registry (which holds the component):
    parked too, so a transformer replaced after detach goes, and the next attach reuses nothing of it."""
    from diffusion_debug.testing.features import kind_missing

    if missing := kind_missing(kind):
        pytest.skip(missing)
    pipe = tiny_pipeline(kind)
    call = dict(prompt="a cat", num_inference_steps=2, output_type="latent")
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    for _ in range(2):
        with dbg:
            pipe(**call, generator=torch.Generator().manual_seed(0))
    old = weakref.ref(pipe.transformer)
    pipe.transformer = copy.deepcopy(pipe.transformer)
    gc.collect()
    assert old() is None
    with dbg:
        pipe(**call, generator=torch.Generator().manual_seed(0))
    changes = [(e["component"], e["change"]) for e in dbg.record.events if e["type"] == "component_replaced"]
    assert changes == [("transformer", "replaced")]
    assert not [a for a in dbg.report().anomalies if a.kind == "debugger_error"]
    dbg.close()


def test_a_detached_debugger_s_component_collected_leaves_another_debugger_s_memo_alone(tmp_path):
    """Two debuggers of one pipeline share its tree memo. ``a`` detached holds the VAE weakly; ``b``,
    attached, read the memo (held strongly again) and follows a VAE replaced between its calls: the
    old VAE, collected inside ``b``'s call, must not empty the memo ``b`` is using (it held nothing
    weakly of ``a``'s any more): ``b``'s trees stay those of the components it watches."""
    pipe = tiny_pipeline("sd")
    a = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path / "a"), log_level="error"))
    with a:
        run(pipe, steps=1)
    b = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path / "b"), log_level="error"))
    with b:
        run(pipe, steps=1)
        vae = weakref.ref(pipe.vae)
        pipe.vae = copy.deepcopy(pipe.vae)
        run(pipe, steps=1)
        assert vae() is None  # collected in b's call, a's weak reference's callback ran
        assert sorted(b._trees._trees) == sorted(id(c.module) for c in b.components)
    assert not [x for x in b.report().anomalies if x.kind == "debugger_error"]
    a.close(), b.close()


@pytest.mark.usefixtures("only_the_tests_objects")
def test_a_component_replaced_under_another_debugger_is_not_kept_by_a_detached_one(tmp_path):
    """``kept`` detached shares the memo's lists (a component's OOM targets) in its call sites' plans;
    ``b`` reads the memo (its modules held strongly again) and follows a UNet replaced in its call:
    the old UNet goes once ``b`` lets go of it, not kept by ``kept``'s plans till ``kept`` attaches."""
    pipe = tiny_pipeline("sd")
    kept = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path / "kept"), log_level="error"))
    with kept:
        run(pipe, steps=2, output_type="latent")
    b = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path / "b"), log_level="error"))
    with b:
        old = weakref.ref(pipe.unet)
        pipe.unet = copy.deepcopy(pipe.unet)
        run(pipe, steps=2, output_type="latent")
    gc.collect()
    assert old() is None
    with kept:  # kept follows the pipeline as it is now
        run(pipe, steps=2, output_type="latent")
    assert [row["step"] for row in kept.report().steps] == [0, 1, 0, 1]
    assert not [x for x in kept.report().anomalies if x.kind == "debugger_error"]
    kept.close(), b.close()


@pytest.mark.usefixtures("only_the_tests_objects")  # its gc.collect() walks only what the test made
def test_a_component_collected_under_a_detached_debugger_takes_its_own_memo_entry_alone(tmp_path):
    """A detached debugger (kept for ``report()``, or one made per call not collected yet: it is a
    cycle) holds the pipeline's modules weakly. A VAE replaced then is collected at once, and with it
    the memo's entry of that VAE alone, every part of it let go: what was worked out of the unchanged
    UNet and text encoder stays (their fp16 trees read fully once), so the next attach reads the text
    encoder by its sentinel and the new VAE fully. (The whole memo was emptied: the text encoder was
    read fully again, seen as a flaky second full read in CI, where it hung on when the garbage
    collector ran.)"""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        run(pipe, steps=1)
    memo, unet, text_encoder = dbg._trees, pipe.unet, pipe.text_encoder
    old, decoder = weakref.ref(pipe.vae), weakref.ref(pipe.vae.decoder)
    pipe.vae = tiny_pipeline("sd", dtype=torch.float16, seed=1).vae
    gc.collect()
    assert old() is None and decoder() is None  # nothing of the memo's holds a part of it
    assert sorted(memo._values) == sorted([id(unet), id(text_encoder)])
    assert memo._values[id(text_encoder)]["read_fully"] == {"float16"}
    with dbg:  # the memo's lists held again as they were
        assert dbg._steps.probes.levels == {"unet": "sentinel", "text_encoder": "sentinel", "vae": "full"}
        assert memo._trees[id(text_encoder)][1][0] is text_encoder
        run(pipe, steps=1)
    with DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error")) as another:
        assert another._steps.probes.levels == {"unet": "sentinel", "text_encoder": "sentinel", "vae": "sentinel"}
    assert not [a for a in dbg.report().anomalies if a.kind == "debugger_error"]
    dbg.close()


def write_while_detached(dbg, pipe, parking):
    dbg._steps.localizer.modules["extra"] = pipe.vae  # between park and revive: read at revive, after it
    parking()
    return dbg._steps.localizer.modules["extra"]


def swap_an_equal_component(dbg, pipe, parking):
    index, swapped = [c.name for c in dbg._components].index("vae"), []

    def swap():  # attached: the module held again
        swapped.append(dataclasses.replace(dbg._components[index]))  # equal, not the same
        dbg._components[index] = swapped[0]

    parking(attached=swap)
    return swapped[0].module


def another_debugger_reads_the_memo(dbg, pipe, parking):
    with DiffusionModelDebugger(pipe, DebugConfig(output_dir=dbg.config.output_dir, log_level="error")) as other:
        run(pipe, steps=1, output_type="latent")
    other.close()
    parking()
    return dbg._components[0].module


def a_mapping_that_is_no_dict(dbg, pipe, parking):
    localizer = dbg._steps.localizer
    parking(attached=lambda: setattr(localizer, "modules", collections.ChainMap(dict(localizer.modules))))
    parking()  # its version cannot be read (dict_version: a RuntimeError): looked through at each park
    return dbg._steps.localizer.modules["unet"]


@pytest.mark.parametrize(
    "change",
    [write_while_detached, swap_an_equal_component, another_debugger_reads_the_memo, a_mapping_that_is_no_dict],
)
def test_a_reused_debugger_s_detach_looks_for_its_places_again_after_a_change_and_parks_them(
    tmp_path, monkeypatch, change
):
    """A reused debugger's detach parks its last places again as they are when nothing changed since
    the attach (``detached.park``); a change to them (a dict written, even while detached, an item
    swapped for an equal new one, the memo read by another debugger, a mapping whose version cannot
    be read) sends it through the full search, and the module the change put there is parked."""
    pipe = tiny_pipeline("sd")
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    for _ in range(2):
        with dbg:
            run(pipe, steps=1, output_type="latent")
    searches = []
    find_places = detached._find_places
    monkeypatch.setattr(detached, "_find_places", lambda *args: searches.append(1) or find_places(*args))

    def parking(attached=lambda: None):  # as an attach and a detach do, ``attached()`` run between them
        detached.revive(dbg._parked)
        attached()
        detached.park(dbg._parked, dbg._components, dbg._held, dbg._steps, dbg._trees, dbg._dropped)

    parking()
    assert searches == []  # nothing changed: the last park's places, parked again
    held = change(dbg, pipe, parking)
    assert searches and isinstance(held, weakref.ref) and held() is not None
    assert all(isinstance(c.module, weakref.ref) for c in dbg._components)
    count = len(searches)
    parking()  # (the mapping that is no dict: looked through again)
    assert len(searches) == count + (change is a_mapping_that_is_no_dict)
    with dbg:
        run(pipe, steps=1, output_type="latent")
    assert not [a for a in dbg.report().anomalies if a.kind == "debugger_error"]
    dbg.close()
