"""A reused debugger's added time on a 1-step call, with the components' own compute taken out of
each round's difference: what resolves a millisecond on the fp16 tiny SD call, whose plain call is
~170 ms of CPU fp16 kernels that scatter by ~5 ms a call (the 30 rounds of :mod:`.call_cost` give
it a 95% interval 5 ms wide).

Each round runs the plain call and the same call watched by one reused debugger (``with dbg:``),
mirrored (A B, B A) as :func:`~benchmarks.harness.interleaved` does, and reads, beside each call's
whole time, the time spent inside the forwards of the text encoder, the UNet and the VAE decoder
(:func:`compute_clock`; the call sites' hooks are outside those forwards, so the debugger's own
work at a component call is not in them). A round's figure is its difference of the whole calls
minus its difference of the compute inside them (a control variate with coefficient 1): the
kernels' scatter, common to the two terms, cancels, and what is left is the time the watched call
spends outside the components' kernels, which is where the debugger's work is. The estimate is the
median of those per-round figures, with the distribution-free interval of
:meth:`~benchmarks.harness.Comparison.added_ms_interval` (a sign count: no resampling).

What it assumes, and how it is checked:

- The debugger does not slow the kernels inside the forwards (it reads no tensor there on a call
  its sentinels do not read, 3 calls in 4: :mod:`diffusion_debug.diffusion.components.sentinel_pace`).
  The difference of the compute alone is printed with its own interval (wide in fp16, centred on
  0 if so), and in fp32 and bf16, whose plain calls scatter little, the adjusted and the plain
  paired figures can be set side by side.
- On a call its sentinels read, their block hooks run inside the forwards: their Python
  (``Probe._read_output``, timed by a wrapper put on for the run and taken off after, a microsecond
  or so a hook: counted against the debugger) is taken out of the compute, so it stays in the
  figure; torch's dispatch of those 14 hooks (its slow path of a module call with hooks, a few
  microseconds each on tiny SD) is not, and is left out of the figure.

Rounds are told by whether a sentinel hook ran in the watched call (``read``; none in fp32 and bf16),
and by which components' sentinels ran (``groups``: an fp16 debugger's 1st and 2nd runs read all;
from the 3rd each group reads runs of its own, the text encoder's 3, 7..., the UNet's step 0 5, 9...,
the VAE's 6, 10...: :mod:`diffusion_debug.diffusion.components.sentinel_pace`): the figure of each
kind is printed too. Where a pipeline has sentinels (fp16), a third case runs in the same rounds: a
second reused debugger whose groups all read the same runs (1, 2, 5, 9...: every ``phases`` 1, the
pace before cost23), the A/B of the two paces, on a deep copy of the pipeline: a debugger attached
to a pipeline another debugger attached to since its last call finds its components again and
builds its probes afresh (~520 Python calls, ~0.4 ms on tiny SD fp16), which with one pipeline fell
on whichever watched case followed the other (cost23's sitting: see RESULTS.md).
``python -m benchmarks.call_control fp16 [--rounds N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion.components.sentinel_pace import SENTINEL_PHASES
from diffusion_debug.probes.readings import Probe

from .call_cost import REUSED, one_step
from .harness import CLOCKS, Comparison, machine, warm_up_rounds

COMPUTED = ("text_encoder", "unet", "vae.decoder")
"""The modules whose ``forward`` is timed: each component's call site (the VAE's is its decoder)."""
TOGETHER = "reused, every group on the same runs"
"""The case of a second reused debugger whose sentinel groups all read the same runs (before cost23)."""


@contextlib.contextmanager
def compute_clock(
    pipe: Any, spent: list[float], now: Callable[[], float], seen: set[int] | None = None, twins: tuple = ()
) -> Iterator[None]:
    """While open, ``spent[0]`` gathers the time inside the ``forward`` of each of :data:`COMPUTED`
    (of ``pipe``, and of each pipeline of ``twins``)
    (their classes swapped for same-named subclasses whose ``forward`` reads the clock around the
    class's own; the hooks torch runs for the module itself are outside it), and ``spent[1]`` the
    time inside the debugger's sentinel block hooks (``Probe._read_output``, wrapped on the class),
    which run inside those forwards on a call the sentinels read (``seen``: the ids of the probes
    whose hooks ran). Made before any debugger is (a reused probe keeps its hooks' bound methods),
    taken off after."""
    swapped: list[tuple[torch.nn.Module, type]] = []

    def timed(base: type) -> Callable[..., Any]:
        @functools.wraps(base.forward)
        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            start = now()
            try:
                return base.forward(self, *args, **kwargs)
            finally:
                spent[0] += now() - start

        return forward

    read = Probe._read_output

    @functools.wraps(read)
    def read_output(self: Probe, *args: Any) -> None:
        start = now()
        try:
            return read(self, *args)
        finally:
            spent[1] += now() - start
            if seen is not None:
                seen.add(id(self))

    try:
        for path, timed_pipe in [(path, p) for p in (pipe, *twins) for path in COMPUTED]:
            module = timed_pipe
            for name in path.split("."):
                module = getattr(module, name, None)
            if isinstance(module, torch.nn.Module):
                base = type(module)
                names = {"__module__": base.__module__, "__qualname__": base.__qualname__, "forward": timed(base)}
                module.__class__ = type(base.__name__, (base,), names)
                swapped.append((module, base))
        Probe._read_output = read_output
        yield
    finally:
        Probe._read_output = read
        for module, base in swapped:
            module.__class__ = base


@dataclass
class Controlled:
    """Per case (plain, then the reused debugger, and in fp16 :data:`TOGETHER`), per round: the whole
    call's seconds, the compute inside its components (the sentinel hooks' time taken out), whether the
    sentinels read the reused debugger's call (``read``) and, per watched case, whose sentinels ran in
    it (``groups``: the components, joined by ``+``; ``""`` none)."""

    title: str
    whole: dict[str, list[float]] = field(default_factory=dict)
    compute: dict[str, list[float]] = field(default_factory=dict)
    read: list[bool] = field(default_factory=list)
    clock: str = "cpu"
    groups: dict[str, list[str]] = field(default_factory=dict)

    def comparison(
        self, kind: str = "adjusted", rounds: bool | str | None = None, case: str | None = None
    ) -> Comparison:
        """A :class:`~benchmarks.harness.Comparison` (plain and every case, or ``case`` alone) of ``kind``:
        ``"adjusted"`` (each call's whole time minus its compute: the per-round differences are the
        adjusted figures), ``"whole"`` (the calls as timed), ``"compute"`` (the compute alone); of the
        rounds whose watched call (``case``'s, else the reused debugger's) the sentinels read
        (``rounds=True``), did not (False), read as ``groups`` names (a str), or all (None)."""
        reads = self.groups.get(case or REUSED) or ["read" if read else "" for read in self.read]
        keep = [
            i
            for i, read in enumerate(reads)
            if rounds is None or (read == rounds if isinstance(rounds, str) else bool(read) == rounds)
        ]
        times = {}
        for name in self.whole if case is None else ("plain", case):
            whole, compute = self.whole[name], self.compute[name]
            values = {"adjusted": [w - c for w, c in zip(whole, compute)], "whole": whole, "compute": compute}[kind]
            times[name] = [values[i] for i in keep]
        return Comparison(f"{self.title} ({kind})", times, self.clock)

    def markdown(self) -> str:
        tables = []
        for case in [name for name in self.whole if name != "plain"]:
            reads = self.groups.get(case) or ["read" if read else "" for read in self.read]
            lines = [
                f"| {self.title} | rounds | plain CPU ms | {case}: ms added, compute taken out (95% interval) "
                "| ms added, as timed (95% interval) | compute: ms added (95% interval) |",
                "| --- | ---: | ---: | ---: | ---: | ---: |",
            ]
            rows: list[tuple[str, bool | str | None]] = [("all rounds", None), ("not read", False)]
            kinds = list(dict.fromkeys(read for read in reads if read))
            rows += [("read", True)] if kinds == ["read"] else [(f"read: {k}", k) for k in kinds]
            if len(kinds) > 1:
                rows.append(("read, any", True))
            for label, rounds in rows:
                count = len(self.comparison("whole", rounds, case).times[case])
                if not count:
                    continue
                cells = []
                for kind in ("adjusted", "whole", "compute"):
                    table = self.comparison(kind, rounds, case)
                    low, high = table.added_ms_interval(case)
                    cells.append(f"{table.added_ms(case):+.2f} ({low:+.2f} to {high:+.2f})")
                plain = 1e3 * statistics.median(self.comparison("whole", rounds, case).times["plain"])
                lines.append(f"| {label} | {count} | {plain:.1f} | " + " | ".join(cells) + " |")
            tables.append("\n".join(lines))
        return "\n\n".join(tables)


def run(pipe: Any, *, repeats: int, output_dir: str, label: str, clock: str = "cpu", warmup: int = 4) -> Controlled:
    """``pipe`` as :func:`~benchmarks.call_cost.one_step` gives it; ``repeats`` mirrored rounds of the
    plain call and the reused debugger's (and :data:`TOGETHER`'s where ``pipe`` has an fp16 component),
    after ``warmup`` rounds (the debuggers' first calls: their full probes on the components called
    once per image), by ``clock``, collected outside the timed calls as
    :func:`~benchmarks.harness.interleaved` does."""
    now, spent, seen = CLOCKS[clock], [0.0, 0.0], set()
    result = Controlled(f"1-step {label} call, output_type='pil'", clock=clock)
    twin = copy.deepcopy(pipe) if any(p.dtype == torch.float16 for p in pipe.unet.parameters()) else None
    with compute_clock(pipe, spent, now, seen, twins=(twin,) if twin is not None else ()):
        debuggers = {REUSED: DiffusionModelDebugger(pipe, DebugConfig(output_dir=output_dir))}
        if twin is not None:  # the A/B of the paces, on a pipeline of its own
            debuggers[TOGETHER] = DiffusionModelDebugger(twin, DebugConfig(output_dir=output_dir))
            debuggers[TOGETHER]._steps.probes.pace.phases = dict.fromkeys(SENTINEL_PHASES, 1)

        def called(pipe: Any) -> Callable[[], None]:
            def call() -> None:
                generator = torch.Generator().manual_seed(0)
                pipe("a photo of a cat", num_inference_steps=1, output_type="pil", generator=generator)

            return call

        def watched(debugger: DiffusionModelDebugger) -> Callable[[], None]:
            plain = called(debugger.pipe)

            def call() -> None:
                with debugger:
                    plain()

            return call

        cases = {"plain": called(pipe), **{name: watched(debugger) for name, debugger in debuggers.items()}}
        try:
            controlled_rounds(result, cases, debuggers, REUSED, now, spent, seen, repeats=repeats, warmup=warmup)
        finally:
            for debugger in debuggers.values():
                debugger.close()
    return result


def controlled_rounds(
    result: Controlled,
    cases: dict[str, Callable[[], None]],
    debuggers: dict[str, DiffusionModelDebugger],
    read_by: str,
    now: Callable[[], float],
    spent: list[float],
    seen: set[int],
    *,
    repeats: int,
    warmup: int,
) -> None:
    """Fill ``result`` with ``repeats`` mirrored rounds of ``cases`` (the plain call first, then one per
    debugger of ``debuggers``, by name) after ``warmup`` rounds, by ``now``: each call's whole time, the
    compute inside its components (``spent`` and ``seen``, which :func:`compute_clock` fills, set back
    before each call), whose sentinel hooks ran in each watched call (``groups``) and whether
    ``read_by``'s ran (``read``). The collector runs before each call, everything older frozen, as
    :func:`~benchmarks.harness.interleaved` does."""
    for name in cases:
        result.whole[name], result.compute[name] = [], []
    for name in debuggers:
        result.groups[name] = []
    for _ in range(warm_up_rounds(warmup)):
        for call in cases.values():
            call()
    gc.collect()
    gc.freeze()
    try:
        for round_ in range(repeats):
            for name in reversed(cases) if round_ % 2 else cases:
                gc.collect()
                spent[0] = spent[1] = 0.0
                seen.clear()
                start = now()
                cases[name]()
                result.whole[name].append(now() - start)
                result.compute[name].append(spent[0] - spent[1])
                if name in debuggers:  # whose sentinel hooks ran
                    kept = debuggers[name]._steps.probes._kept
                    ran = sorted(c for c, entry in kept.items() if id(entry[2]) in seen)
                    result.groups[name].append("+".join(ran))
            result.read.append(bool(result.groups[read_by][-1]))
    finally:
        gc.unfreeze()


def main(argv: list[str] | None = None) -> int:
    from diffusion_debug.testing import tiny_pipeline

    from .user_path import DTYPES

    parser = argparse.ArgumentParser(prog="python -m benchmarks.call_control", description=__doc__.splitlines()[0])
    parser.add_argument("dtypes", nargs="*", choices=list(DTYPES), default=["fp16"])
    parser.add_argument("--rounds", type=int, default=160)
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        print(f"machine: {machine()}\n")
        for name in args.dtypes:
            pipe = one_step(tiny_pipeline("sd", dtype=DTYPES[name]))
            pipe.set_progress_bar_config(disable=True)
            started = time.time()
            found = run(pipe, repeats=args.rounds, output_dir=tempfile.mkdtemp(), label=f"tiny SD {name}")
            print(found.markdown())
            print(f"\n({time.time() - started:.0f} s)\n")
    finally:
        torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
