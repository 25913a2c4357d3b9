"""Which steps a UNet denoiser's sentinel reads, and which runs the sentinels of the components
called once per image read: :class:`SentinelPace`.

At the default level an fp16 (or fp8) UNet's sentinel reads its block outputs (11 at SD1.5
topology) for a near-overflow and a NaN/Inf, taken together in one reduction a call. On a GPU a
watched step's cost is host time: a hook's dispatch (torch's slow path of a module call with hooks,
and the hook's own Python) and a reduction's launch, 11 hooks and 3 ops a step at SD1.5 topology.
So it reads some steps, not all: a run's first :data:`SENTINEL_FIRST_STEPS`, then every
:data:`SENTINEL_EVERY`-th step (4, 8, 12...), and every step while a block output it read was
within :data:`SENTINEL_WARM` of the overflow warning (``overflow_fraction`` of fp16's largest value).
A run's step 0 likewise across the runs a debugger watches: its first :data:`SENTINEL_FIRST_STEPS`
runs', then every :data:`SENTINEL_EVERY`-th run's (5, 9, 13...), and while warm: a served 1-step
pipeline, whose every call is a run of one step, paid the sentinel at every call (7 hooks, their
readings and a flush on tiny SD; 0.4-0.8 ms of the 1-step fp16 call's ~3 ms a reused debugger added
on the CPU benchmark, ``benchmarks.user_path``).
At the other steps its hooks are out of the modules' hook dicts
(:class:`~diffusion_debug.probes.handles.PausedHooks`): torch's fast path, nothing held or reduced.

>>> [step for step in range(20) if reads(step, warm=False)]
[0, 1, 4, 8, 12, 16]
>>> [run for run in range(1, 14) if reads(0, warm=False, run=run)]
[1, 2, 5, 9, 13]

What it costs (the trade-off):

- A NaN/Inf is found at every step, at the step's output (measured every step: no diffusers UNet
  block clips its values, so an Inf or a NaN that one makes reaches the output), and named by the
  replay of the step's kept call with full probes, at its exact module and step.
- A near-overflow block output (``overflow_risk``) at a step not read is warned at the next step
  read if it is still there: at most ``SENTINEL_EVERY - 1`` steps later (a step 0 not read: at
  step 1, or in a run of one step at most ``SENTINEL_EVERY - 1`` runs later), named at that step.
  One that comes and goes between two steps read is not warned.

Read at every step: a transformer denoiser's sentinel (diffusers' Flux, Sana, QwenImage... blocks
clip their fp16 streams to +-65504, so an Inf made there reaches no output; their sentinels read a
block list's end, 2 to 10 hooks a step), ControlNets and adapters (outputs the step does not
measure). Paced, its step 0 read at every call (not by run: :attr:`SentinelPace.projected`) and every
:data:`SENTINEL_EVERY_PROJECTED`-th step after the first two: a float32 transformer's under float16
autocast, which reads each block's float16 projections too (:func:`~.sentinel_blocks.block_projections`;
PixArt-alpha's 84, a hook each and their bytes: ~12 flushes a step read at 1024 px, 11 more than its
block lists' ends, the held bytes bounded by ``HELD_BYTES``), where its streams are float32 (PixArt's:
its adaLN gate is a float32 parameter) or float16 in blocks of a class known not to clip them (SD3's
``JointTransformerBlock``: :func:`~.sentinel_blocks.unclipped_float16`), so an Inf a projection makes
reaches the step's output. Any other float16 stream (Flux's: its x_embedder and gates run in float16,
its blocks clip) is told by its block lists' ends at the first call: its projections' hooks go and its
sentinel leaves the pace (:meth:`SentinelPace.read_every_step`: every step of every call from then, as
main's); from the next attach it is main's (block lists' ends, not paced). Its pace is its own: a UNet paced
beside it (a Kandinsky combined pipeline's float32 prior and UNet, UnCLIP's, under float16 autocast) is read
as on main (step 0 by run, every :data:`SENTINEL_EVERY`-th step), and stays so when it leaves the pace.

The components called once per image (an fp16 VAE's decoder blocks, a text or image encoder's last
layer: :attr:`SentinelPace.once`) are paced by run the same way: their sentinels read a debugger's
first :data:`SENTINEL_FIRST_STEPS` runs (a run counts from the debugger's first with a component
probed: the first, where a component's first call is read with full probes, is one), then every
:data:`SENTINEL_EVERY`-th, and every run after one where a block output their group read was within
:data:`SENTINEL_WARM` of the warning (or not finite). A served 1-step fp16 call paid them at every
call: 7 hooks on tiny SD (the VAE decode's 5, the text encoder's last layer at the prompt's and the
negative prompt's calls), their readings and their flush, what made its reused-debugger cost 1 ms
over bf16's on the CPU benchmark.

Each group reads runs of its own (:data:`SENTINEL_PHASES`): the UNet's step 0 at 5, 9, 13..., the
VAE decode at 6, 10, 14..., the encoders at 3, 7, 11..., so that no call after a debugger's 2nd pays
two groups (all three had read runs 5, 9...: such a call added 3.2 ms on the CPU benchmark, over the
3 ms budget, where the others added 2.4). The groups share no cost a run: each one's readings join
the flush and the host read its own component's output check takes at every call (the encoders'
calls read together, the VAE decode's, the step's), so reading them apart adds no op, sync or host
read; a call reads each group 1 in 4 as before (timed against the pace before on a twin pipeline, load
~3.5: the costliest call 3.27 -> 2.89 ms added, the median call the same within noise; an earlier
sitting at load 7-9 saw the mean ~0.09 ms more: RESULTS.md, cost23).

>>> {group: [run for run in range(1, 12) if reads(0, warm=False, run=run, phase=phase)]
...  for group, phase in SENTINEL_PHASES.items()}
{'steps': [1, 2, 5, 9], 'decoders': [1, 2, 6, 10], 'encoders': [1, 2, 3, 7, 11]}

What it costs:

- A NaN/Inf is found at every call, at the call's output (checked at every call: a VAE decode's,
  each encoder call's), and named by the replay of the kept call with full probes at its module;
  an fp16 VAE's black image keeps its upcast advice (the advice is the component's, not the probe's).
- A near-overflow block output at a run not read is warned at the next run its group reads if it is
  still there: at most ``SENTINEL_EVERY - 1`` runs (pipeline calls) later, named at its module by the
  replay. One that reaches the call's output is flagged at every call (the output check). One that
  comes and goes between two runs read is not warned.

Limits: a UNet run with an attention processor of the user's that clips has such an Inf named at
the next step read, as a near-overflow is. With deferred reads (policy ``record`` or ``warn``) a
step's readings are known a step later, so warmth read at step ``s`` paces step ``s + 2``. A call
of a component called once per image outside a pipeline run (``pipe.vae.decode`` on its own after
a run) is read as that run was; one before an attach's first run begins (a modular pipeline's encoders,
``vae.decode`` alone) as that run will be (:meth:`SentinelPace.left_out`: the hooks of a group the run
does not read are left out at the attach).
"""

from __future__ import annotations

from itertools import chain
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

import torch

from ...probes import ModuleReading
from ...probes.handles import ForwardHooks, PausedHooks
from .roles import role

SENTINEL_FIRST_STEPS = 2
"""A run's first steps, which the sentinel reads whatever else."""
SENTINEL_EVERY = 4
"""After them, the steps it reads: every ``SENTINEL_EVERY``-th (and every step while warm)."""
SENTINEL_EVERY_PROJECTED = 8
"""The same for a float32 transformer's sentinel under float16 autocast, which reads its blocks' projections too
(PixArt-alpha's 84, ~12 flushes a step read at 1024 px; its step 0 read at every call): every 4th step added 28.4
ops a step over a 20-step run (DESIGN: <= 25), every 8th 23.6 (benchmarks/RESULTS.md, dit31); since main's
flushes stack outside the user's autocast (no ``_to_copy`` a flush), every 4th 22.8, every 8th 19.2 (dit32)."""
SENTINEL_WARM = 4
"""Warm: a block output read was within this factor of the overflow warning (8188 at the default
``overflow_fraction`` 0.5 of fp16's 65504)."""
SENTINEL_PHASES: Mapping[str, int] = MappingProxyType({"steps": 1, "decoders": 2, "encoders": 3})
"""After a debugger's first :data:`SENTINEL_FIRST_STEPS` runs, the runs each group of sentinels reads,
``SENTINEL_EVERY`` apart, by the run they fall on: ``"steps"`` a UNet's step 0 (5, 9, 13...),
``"decoders"`` the VAE decode's blocks and any other component called once per image that begins no
run (6, 10, 14...), ``"encoders"`` the text and image encoders' last layers (3, 7, 11...): no run after
the 2nd reads two groups (but while warm), and no group waits more than ``SENTINEL_EVERY`` runs."""
_HALF_MAX = float(torch.finfo(torch.float16).max)
_NONE: frozenset[str] = frozenset()
_NO_PROJECTED: tuple[list[str], list] = ([], [])  # (read only: a watch without a "projected" group)
_ONCE_GROUPS = ("encoders", "decoders")


def reads(step: int, *, warm: bool, run: int = 1, phase: int = 1) -> bool:
    """Whether the sentinel reads ``step`` of a run, the ``run``-th (from 1) its debugger watches; its
    step 0 by the group's ``phase`` (:data:`SENTINEL_PHASES`; 1: a UNet's)."""
    if step == 0:
        return run <= SENTINEL_FIRST_STEPS or (run - phase) % SENTINEL_EVERY == 0 or warm
    return step < SENTINEL_FIRST_STEPS or step % SENTINEL_EVERY == 0 or warm


def run_group(role_name: str) -> str:
    """The group (:data:`SENTINEL_PHASES`) whose runs the sentinel of a component called once per image
    of role ``role_name`` reads: ``"encoders"`` for a role whose call begins a run (text and image
    encoders), ``"decoders"`` for the others (the VAE).

    >>> run_group("text_encoder"), run_group("image_encoder"), run_group("vae")
    ('encoders', 'encoders', 'decoders')
    """
    return "encoders" if role(role_name).begins_run else "decoders"


class SentinelPace:
    """The steps the UNet denoisers' sentinels of one debugger read (and a float32 transformer's under float16
    autocast), and the runs its sentinels of the
    components called once per image read (see the module)."""

    def __init__(self, overflow_fraction: float):
        self.sampled: list[str] = []
        """The denoisers whose sentinel reads some steps, at this attach (empty: nothing paced): the UNets, and the
        float32 transformers under float16 autocast."""
        self.once: dict[str, str] = {}
        """The components called once per image whose sentinel reads some runs, at this attach, each with
        its group (``"encoders"`` or ``"decoders"``, :data:`SENTINEL_PHASES`)."""
        self.phases: Mapping[str, int] = SENTINEL_PHASES
        """Each group's phase (:data:`SENTINEL_PHASES`); every phase 1 reads the three groups at the same
        runs (``benchmarks.call_control`` times that against the default)."""
        self.every = SENTINEL_EVERY
        """The steps after a run's first two that the UNets of :attr:`sampled` read: every ``every``-th."""
        self.projected: list[str] = []
        """The float32 transformers of :attr:`sampled` under float16 autocast (their projections read), each paced on
        its own: its step 0 read at every run, not by run (its first call tells whether its streams may be clipped
        with every hook in: ``component_probes._StreamDtype``; main read its step 0 at every call), then every
        :data:`SENTINEL_EVERY_PROJECTED`-th step; a UNet beside it keeps its own pace (:attr:`every`, by run)."""
        self._projected: dict[str, Any] = {}
        self._projected_paused: dict[str, PausedHooks] = {}
        """Per component of :attr:`projected`: its probe, and its hooks taken out (found at its first step unread)."""
        self.paced = False
        """Whether this attach probes a component (a sentinel or full probes): a run's beginning asks
        :meth:`at` then, which counts it (:attr:`runs`) and paces :attr:`sampled` and :attr:`once`."""
        self.once_warm: dict[str, bool] = dict.fromkeys(_ONCE_GROUPS, False)
        """Per group of :attr:`once`: a block output its sentinels read in the last run they read was within
        :data:`SENTINEL_WARM` of the overflow warning (:attr:`warm_at`, or not finite): the next run reads
        the group. Set by the call's check as it reads them (``CallEvents.check_call``: a loop there, no call)."""
        self._once_hooks: dict[str, Callable[[], Iterable[tuple[Any, Callable]]]] = {}
        self._once_paused: dict[str, PausedHooks] = {}
        self._members: dict[str, frozenset[str]] = {}
        """Per group of :attr:`once` at this attach: its components."""
        self.warm = False
        """A block output the sentinels read last was within :data:`SENTINEL_WARM` of the overflow
        warning (or not finite): every step is read (:meth:`note`)."""
        self.warm_at = overflow_fraction * _HALF_MAX / SENTINEL_WARM
        """A block output this large or more (or not finite) is warm."""
        self._hooks: Callable[[], Iterable[tuple[Any, Callable]]] | None = None
        self._paused: PausedHooks | None = None
        """The sentinels' hooks, found at this attach's first step not read."""
        self._late: list[Iterable[tuple[Any, Callable]]] | None = None
        self._once_late: dict[str, list[Iterable[tuple[Any, Callable]]]] = {}
        """The ``(module, hook)`` pairs of :attr:`sampled`'s and of each group of :attr:`once`'s sentinels
        that this attach left out (:meth:`left_out`: its first run reads none of them), put in at the first
        step or run read."""
        self.once_out: frozenset[str] | set[str] = _NONE
        """The components of :attr:`once` whose sentinel hooks are out (a run that does not read their group,
        or before the first run of an attach that left them out): their calls are then checked at their
        output alone, as an unprobed component's (``CallEvents``: no hold, no take)."""
        self._put_in: list[ForwardHooks] = []
        """What put :attr:`_late` and :attr:`_once_late` in: removed at :meth:`forget`."""
        self.runs = 0
        """The runs begun with a component probed (``at(0)``), across attaches: the pace of a UNet's
        step 0 and of the components called once per image (whose first call, read with full probes,
        is the 1st)."""

    def left_out(self) -> dict[str | None, list | None]:
        """At an attach, before :meth:`watch`: per sentinel group (``"steps"``: the UNets', :attr:`sampled`;
        ``"encoders"`` and ``"decoders"``: those of :attr:`once`) an empty list where the next run does not
        read it (its step 0; its calls: as :meth:`at` will decide as the run begins), to collect the group's
        reused hooks left out at the attach (``late`` and ``once_late`` in :meth:`watch`); None where it
        reads it. A reused debugger's 1-step call not read puts no sentinel hook in and takes none out, as a
        bf16 call. Limit: a call of a component called once per image before the attach's first run
        begins (a modular pipeline's encoders, ``vae.decode`` alone) is read as that run will be."""
        runs = self.runs + 1
        if runs <= SENTINEL_FIRST_STEPS:
            return {None: None}
        phases, warm = self.phases, self.once_warm
        return {
            "steps": None if (runs - phases["steps"]) % SENTINEL_EVERY == 0 or self.warm else [],
            "encoders": None if (runs - phases["encoders"]) % SENTINEL_EVERY == 0 or warm["encoders"] else [],
            "decoders": None if (runs - phases["decoders"]) % SENTINEL_EVERY == 0 or warm["decoders"] else [],
            None: None,
        }

    def watch(
        self,
        paced: dict[str | None, tuple[list[str], list]],
        late: dict[str | None, list | None],
    ) -> None:
        """An attach (after :meth:`forget`): ``paced``, per group (``"steps"``, ``"encoders"``, ``"decoders"``, and
        ``"projected"``: :attr:`projected`, optional), its components' names and probes, their hooks in but those of
        the groups ``late`` (:meth:`left_out`) holds a non-empty list for (their ``(module, hook)`` pairs: put in at
        the first step or run read; never ``"projected"``'s, whose step 0 every run reads)."""
        names, unets = paced["steps"]
        projected, transformers = paced["projected"] if "projected" in paced else _NO_PROJECTED
        self.sampled, self._paused, self._late = names + projected, None, late.get("steps") or None
        self._hooks = (lambda: chain.from_iterable(probe.output_hooks() or () for probe in unets)) if unets else None
        # (no comprehension: no frame an attach; and no C call where nothing is projected: a UNet's attach)
        self.projected, self._projected_paused = projected[:], {}
        self._projected = dict(zip(projected, transformers)) if projected else {}
        once: dict[str, str] = {}
        members: dict[str, frozenset[str]] = {}
        hooks: dict[str, Callable[[], Iterable[tuple[Any, Callable]]]] = {}
        left: dict[str, list[Iterable[tuple[Any, Callable]]]] = {}
        out: frozenset[str] = _NONE
        for group in _ONCE_GROUPS:  # (a loop: no Python call a group)
            names, probes = paced[group]
            if not names:
                continue
            members[group] = frozenset(names)
            once.update(dict.fromkeys(names, group))
            hooks[group] = lambda ps=probes: chain.from_iterable(p.output_hooks(unread=True) or () for p in ps)
            if late.get(group):  # left out at the attach: their calls checked at their output alone
                left[group], out = late[group], out | members[group]
        self.once, self._members, self._once_hooks, self._once_late = once, members, hooks, left
        self._once_paused, self.once_out, self.paced = {}, out, True

    def forget(self) -> None:
        """At detach (the hooks removed, or about to be): nothing taken out is put back, what was put in
        late is taken out."""
        paused, self._paused, self.sampled, self._hooks = self._paused, None, [], None
        if self._projected_paused:  # (no .values() call where nothing was projected: a UNet's detach)
            for held in self._projected_paused.values():
                held.remove()
        self.projected, self._projected, self._projected_paused = [], {}, {}
        once, self._once_paused, self.once, self._once_hooks = self._once_paused, {}, {}, {}
        self.paced, self._late, self._once_late, self.once_out = False, None, {}, _NONE
        if paused is not None:
            paused.remove()
        for held in once.values():
            held.remove()
        if self._put_in:
            put_in, self._put_in = self._put_in, []
            for added in put_in:
                added.remove()

    def at(self, step: int) -> None:
        """The sentinels read step ``step`` of the run or not (asked as the step before ends, but for
        the schedule's last step, and with 0 as a run begins): their hooks put back in or taken out."""
        paused = self._paused
        if not step:
            self.runs = runs = self.runs + 1
            first, phases = runs <= SENTINEL_FIRST_STEPS, self.phases
            if self.once:  # the sentinels of the components called once per image, group by group
                out: frozenset[str] | set[str] = _NONE
                warm = self.once_warm
                for group, hooks in self._once_hooks.items():
                    if first or (runs - phases[group]) % SENTINEL_EVERY == 0 or warm[group]:  # (reads(), inline)
                        warm[group] = False  # what this run's readings show
                        late = self._once_late.pop(group, None)
                        if late is not None:  # left out at the attach: in now
                            self._put_in.append(ForwardHooks(chain.from_iterable(late)))
                        else:
                            held = self._once_paused.get(group)
                            if held is not None and held.paused:
                                held.resume()
                        continue
                    out = self._members[group] if not out else out | self._members[group]
                    if group in self._once_late:  # out already
                        continue
                    held = self._once_paused.get(group)
                    if held is None:
                        held = self._once_paused[group] = PausedHooks(hooks())
                    if not held.paused:
                        held.pause()
                self.once_out = out
            if not self.sampled:
                return
            read = first or (runs - phases["steps"]) % SENTINEL_EVERY == 0 or self.warm
        else:
            read = step < SENTINEL_FIRST_STEPS or step % self.every == 0 or self.warm
        if self._projected:  # each its own: step 0 of every run, then every SENTINEL_EVERY_PROJECTED-th (a loop)
            now = not step or step < SENTINEL_FIRST_STEPS or step % SENTINEL_EVERY_PROJECTED == 0 or self.warm
            for name, probe in self._projected.items():
                held = self._projected_paused.get(name)
                if now:
                    if held is not None and held.paused:
                        held.resume()
                    continue
                if held is None:
                    held = self._projected_paused[name] = PausedHooks(probe.output_hooks() or ())
                if not held.paused:
                    held.pause()
        if read:
            if self._late is not None:  # left out at the attach: in now
                self._put_in.append(ForwardHooks(chain.from_iterable(self._late)))
                self._late = None
            elif paused is not None and paused.paused:
                paused.resume()
            return
        if self._late is not None:  # out already
            return
        if paused is None:
            if self._hooks is None:
                return
            paused = self._paused = PausedHooks(self._hooks())
        if not paused.paused:
            paused.pause()

    def read_every_step(self, name: str) -> None:
        """The projected transformer ``name`` (:attr:`projected`) out of the pace for the rest of this attach: every
        step of every run read, as main reads a transformer's sentinel (one whose first call showed float16 streams
        its blocks may clip; the next attach does not pace it). Its hooks are in (asked at a step 0, which every run
        reads for it); any paused go back in. A UNet paced beside it (a Kandinsky combined pipeline's prior and UNet)
        keeps its own pace, as on main."""
        if name not in self._projected:
            return
        del self._projected[name]
        self.projected = [n for n in self.projected if n != name]
        self.sampled = [n for n in self.sampled if n != name]
        held = self._projected_paused.pop(name, None)
        if held is not None:
            if held.paused:
                held.resume()
            held.remove()

    def note(self, readings: dict[str, list[ModuleReading]]) -> None:
        """A step's readings, read: warm while a sampled sentinel's block output is within
        :data:`SENTINEL_WARM` of the overflow warning; kept as it was after a step not read."""
        bound, read = self.warm_at, False
        for name in self.sampled:
            found = readings.get(name)
            if not found:
                continue
            if not read:
                read, self.warm = True, False
            for reading in found:  # a loop: no frame a reading
                value = reading.output_value
                if value is not None and not value < bound:  # (NaN: warm)
                    self.warm = True
                    return
