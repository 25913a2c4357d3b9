"""A debugger attached once and reused call after call (a served pipeline) holds a bounded amount: its step
rows and events are ring buffers of ``history_size`` entries (anomalies 10x as many), its latent previews at
most 32; nothing else a clean call leaves behind accumulates. Counted as gc-tracked objects by type after
``gc.collect()``, a bounded number whatever the number of calls."""

from __future__ import annotations

import collections
import gc
import weakref

import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import tiny_pipeline

BUILTIN = type(len)
PREVIEWS = {"KeptLatents", "Tensor", "tuple"}  # the latent previews' (step, KeptLatents(tensor)): at most 32


def abc_cache(o: object) -> bool:
    """An entry of an ABC's isinstance cache (a weak reference to a class, its ``_destroy`` callback): the
    interpreter's, bounded by classes x ABCs, filled whenever a library first checks a class against one."""
    if type(o) is weakref.ReferenceType:  # (type() only: getattr on any object may import a lazy module)
        return isinstance(o(), type)
    return type(o) is BUILTIN and o.__name__ == "_destroy" and type(o.__self__) is weakref.ReferenceType


def counts() -> collections.Counter:
    gc.collect()
    return collections.Counter(type(o).__name__ for o in gc.get_objects() if not abc_cache(o))


def test_a_reused_debugger_s_objects_stop_growing_once_its_rings_are_full(tmp_path):
    pipe = tiny_pipeline("sd")
    debugger = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), run_name="served", history_size=4))

    def call():
        with debugger:
            pipe("a cat", num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="latent")

    for _ in range(8):  # warm-up: the rings (4 rows, 4 events) fill, lazy imports are made
        call()
    before = counts()
    for _ in range(16):
        call()
    grown = counts() - before
    debugger.close()
    assert {k: n for k, n in grown.items() if k not in PREVIEWS and n > 1} == {}
    assert len(debugger._steps.previews.latents) <= 32
    assert len(debugger.record.steps) == 4 and len(debugger.record.events) == 4
