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
measure).

The components called once per image (an fp16 VAE's decoder blocks, a text or image encoder's last
layer: :attr:`SentinelPace.once`) are paced by run the same way: their sentinels read a debugger's
first :data:`SENTINEL_FIRST_STEPS` runs (a run counts from the debugger's first with a component
probed: the first, where a component's first call is read with full probes, is one), then every
:data:`SENTINEL_EVERY`-th (5, 9, 13...), and every run after one where a block output they read
was within :data:`SENTINEL_WARM` of the warning (or not finite). A
served 1-step fp16 call paid them at every call: 7 hooks on tiny SD (the VAE decode's 5, the text
encoder's last layer at the prompt's and the negative prompt's calls), their readings and their
flush, what made its reused-debugger cost 1 ms over bf16's on the CPU benchmark. What it costs:

- A NaN/Inf is found at every call, at the call's output (checked at every call: a VAE decode's,
  each encoder call's), and named by the replay of the kept call with full probes at its module;
  an fp16 VAE's black image keeps its upcast advice (the advice is the component's, not the probe's).
- A near-overflow block output at a run not read is warned at the next run read if it is still
  there: at most ``SENTINEL_EVERY - 1`` runs (pipeline calls) later, named at its module by the
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
from typing import Any, Callable, Iterable

import torch

from ...probes import ModuleReading
from ...probes.handles import ForwardHooks, PausedHooks

SENTINEL_FIRST_STEPS = 2
"""A run's first steps, which the sentinel reads whatever else."""
SENTINEL_EVERY = 4
"""After them, the steps it reads: every ``SENTINEL_EVERY``-th (and every step while warm)."""
SENTINEL_WARM = 4
"""Warm: a block output read was within this factor of the overflow warning (8188 at the default
``overflow_fraction`` 0.5 of fp16's 65504)."""
_HALF_MAX = float(torch.finfo(torch.float16).max)


def reads(step: int, *, warm: bool, run: int = 1) -> bool:
    """Whether the sentinel reads ``step`` of a run, the ``run``-th (from 1) its debugger watches."""
    if step == 0:
        return run <= SENTINEL_FIRST_STEPS or (run - 1) % SENTINEL_EVERY == 0 or warm
    return step < SENTINEL_FIRST_STEPS or step % SENTINEL_EVERY == 0 or warm


class SentinelPace:
    """The steps the UNet denoisers' sentinels of one debugger read, and the runs its sentinels of the
    components called once per image read (see the module)."""

    def __init__(self, overflow_fraction: float):
        self.sampled: list[str] = []
        """The UNet denoisers whose sentinel reads some steps, at this attach (empty: nothing paced)."""
        self.once: tuple[str, ...] = ()
        """The components called once per image whose sentinel reads some runs, at this attach."""
        self.paced = False
        """Whether this attach probes a component (a sentinel or full probes): a run's beginning asks
        :meth:`at` then, which counts it (:attr:`runs`) and paces :attr:`sampled` and :attr:`once`."""
        self.once_warm = False
        """A block output the sentinels of :attr:`once` read in the last run they read was within
        :data:`SENTINEL_WARM` of the overflow warning (:attr:`warm_at`, or not finite): the next run is
        read. Set by the call's check as it reads them (``CallEvents.check_call``: a loop there, no call)."""
        self._once_hooks: Callable[[], Iterable[tuple[Any, Callable]]] | None = None
        self._once_paused: PausedHooks | None = None
        self.warm = False
        """A block output the sentinels read last was within :data:`SENTINEL_WARM` of the overflow
        warning (or not finite): every step is read (:meth:`note`)."""
        self.warm_at = overflow_fraction * _HALF_MAX / SENTINEL_WARM
        """A block output this large or more (or not finite) is warm."""
        self._hooks: Callable[[], Iterable[tuple[Any, Callable]]] | None = None
        self._paused: PausedHooks | None = None
        """The sentinels' hooks, found at this attach's first step not read."""
        self._late: list[Iterable[tuple[Any, Callable]]] | None = None
        self._once_late: list[Iterable[tuple[Any, Callable]]] | None = None
        """The ``(module, hook)`` pairs of :attr:`sampled`'s and :attr:`once`'s sentinels that this attach
        left out (:meth:`left_out`: its first run reads none of them), put in at the first step or run read."""
        self.once_out = False
        """Whether :attr:`once`'s sentinel hooks are out (a run not read, or before the first run of an attach
        that left them out): their components' calls are then checked at their output alone, as an
        unprobed component's (``CallEvents``: no hold, no take)."""
        self._put_in: list[ForwardHooks] = []
        """What put :attr:`_late` and :attr:`_once_late` in: removed at :meth:`forget`."""
        self.runs = 0
        """The runs begun with a component probed (``at(0)``), across attaches: the pace of a UNet's
        step 0 and of the components called once per image (whose first call, read with full probes,
        is the 1st)."""

    def left_out(self) -> dict[str | None, list | None]:
        """At an attach, before :meth:`watch`: per sentinel group (``"steps"``: the UNets', :attr:`sampled`;
        ``"runs"``: the components' called once per image, :attr:`once`) an empty list where the next run
        does not read it (its step 0; its calls: as :meth:`at` will decide as the run begins), to collect
        the group's reused hooks left out at the attach (``late`` in :meth:`watch`); None where it reads
        it. A reused debugger's 1-step call not read puts no sentinel hook in and takes none out, as a
        bf16 call. Limit: a call of a component called once per image before the attach's first run
        begins (a modular pipeline's encoders, ``vae.decode`` alone) is read as that run will be."""
        runs = self.runs + 1
        due = runs <= SENTINEL_FIRST_STEPS or (runs - 1) % SENTINEL_EVERY == 0
        return {"steps": None if due or self.warm else [], "runs": None if due or self.once_warm else [], None: None}

    def watch(
        self,
        sampled: list[str],
        hooks: Callable[[], Iterable[tuple[Any, Callable]]],
        once: tuple[str, ...] = (),
        once_hooks: Callable[[], Iterable[tuple[Any, Callable]]] | None = None,
        late: list[Iterable[tuple[Any, Callable]]] | None = None,
        once_late: list[Iterable[tuple[Any, Callable]]] | None = None,
    ) -> None:
        """An attach (after :meth:`forget`): ``sampled`` and ``once`` (their hooks in, but those of
        ``late`` and ``once_late``: put in at the first step or run read), ``hooks()`` and ``once_hooks()``
        their ``(module, hook)`` pairs."""
        self.sampled, self._hooks, self._paused, self._late = sampled, hooks, None, late
        self.once, self._once_hooks, self._once_paused, self._once_late = once, once_hooks, None, once_late
        self.paced, self.once_out = True, once_late is not None

    def forget(self) -> None:
        """At detach (the hooks removed, or about to be): nothing taken out is put back, what was put in
        late is taken out."""
        paused, self._paused, self.sampled, self._hooks = self._paused, None, [], None
        once, self._once_paused, self.once, self._once_hooks = self._once_paused, None, (), None
        self.paced, self._late, self._once_late, self.once_out = False, None, None, False
        if paused is not None:
            paused.remove()
        if once is not None:
            once.remove()
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
            due = runs <= SENTINEL_FIRST_STEPS or (runs - 1) % SENTINEL_EVERY == 0  # (reads(), inline)
            if self.once:  # the sentinels of the components called once per image
                once, read = self._once_paused, due or self.once_warm
                self.once_out = not read
                if read:
                    self.once_warm = False  # what this run's readings show
                    if self._once_late is not None:  # left out at the attach: in now
                        self._put_in.append(ForwardHooks(chain.from_iterable(self._once_late)))
                        self._once_late = None
                    elif once is not None and once.paused:
                        once.resume()
                elif self._once_late is not None:  # out already
                    pass
                elif once is not None or self._once_hooks is not None:
                    if once is None:
                        once = self._once_paused = PausedHooks(self._once_hooks())
                    if not once.paused:
                        once.pause()
            if not self.sampled:
                return
            read = due or self.warm
        else:
            read = step < SENTINEL_FIRST_STEPS or step % SENTINEL_EVERY == 0 or self.warm
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
