"""Watch a diffusers pipeline: per-step record, the module that made a NaN/Inf, fp16 overflow
risk, previews, repro bundles. See :class:`DiffusionModelDebugger`.

- ``components/``: what a pipeline is made of (each component and its role) and how each call of
  one is watched (call sites, compiled components, diffusers' caching hooks, memory per call);
- ``replay/``: which replays a call's readings call for and what a replay names (``decide``), a
  failing call replayed offline (repro bundles) and with one factor changed (``why``);
- ``compare/``: two setups of a pipeline on the same call and seed, and the first component, step
  and module where they drift apart, made there or received (``compare_pipelines``);
- a step: ``pipeline_patches`` (the scheduler and prompt-encoding wrappers), ``steps`` (hook
  events in, rows and findings out), ``step_values`` (one transfer to the host), ``checks`` and
  ``setup_checks``, ``guidance``, ``blackouts``, ``previews``;
- an origin: ``localize`` (the module that made a NaN/Inf), ``origins`` (an input, the callback,
  the scheduler);
- the face: ``debugger``, ``signatures``, ``reporting``, ``determinism``, ``profiling``.
"""

from .debugger import DiffusionModelDebugger
from .replay.bundle import replay, save_bundle

__all__ = ["DiffusionModelDebugger", "replay", "save_bundle"]
