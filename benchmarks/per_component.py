"""Where a call's time goes, component by component: each text encoder, the denoiser and the VAE
decode timed inside the real pipeline call, plain and watched, and what the debugger adds to each
(the median of the per-round differences) and outside them (its per-call bookkeeping).

A component's time encloses every hook torch runs for it (the debugger's call site and probes):
its class is swapped for a subclass of the same name whose ``__call__`` reads the clock around
``nn.Module``'s, and ``vae.decode`` (a method, not a module call) is wrapped on the instance, both
for the measurement only and before any debugger is made. On CUDA each timed call is synced
before and after (in plain and watched calls alike), so a component's time is its own.
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from .harness import CLOCKS, warm_up_rounds

TIMED = ("text_encoder", "text_encoder_2", "unet", "transformer")
"""The pipeline's attributes timed as module calls; the VAE is timed at ``vae.decode``."""
OUTSIDE = "outside the components"
WHOLE = "whole call"


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextlib.contextmanager
def component_clock(pipe: Any, times: dict[str, float], now: Callable[[], float]) -> Iterator[None]:
    """While open, each call of a timed component adds its duration to ``times[name]``."""

    def timed(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            _sync()
            start = now()
            try:
                return call(*args, **kwargs)
            finally:
                _sync()
                times[name] = times.get(name, 0.0) + now() - start

        return run

    swapped: list[tuple[torch.nn.Module, type]] = []
    vae = getattr(pipe, "vae", None)
    try:
        for name in TIMED:
            module = getattr(pipe, name, None)
            if isinstance(module, torch.nn.Module):
                base = type(module)
                call = timed(name, lambda self, *a, _base=base, **k: _base.__call__(self, *a, **k))
                names = {"__module__": base.__module__, "__qualname__": base.__qualname__}
                module.__class__ = type(base.__name__, (base,), {"__call__": call, **names})
                swapped.append((module, base))
        if vae is not None:
            vae.decode = timed("vae.decode", vae.decode)
        yield
    finally:
        for module, base in swapped:
            module.__class__ = base
        if vae is not None and "decode" in vars(vae):
            del vae.decode


@dataclass
class Split:
    """Per case, per round: each component's seconds, what was outside them, and the whole call."""

    title: str
    rounds: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    clock: str = "wall"

    @property
    def baseline(self) -> str:
        return next(iter(self.rounds))

    def parts(self) -> list[str]:
        seen = dict.fromkeys(part for rounds in self.rounds.values() for r in rounds for part in r)
        return [p for p in seen if p not in (OUTSIDE, WHOLE)] + [OUTSIDE, WHOLE]

    def median_ms(self, case: str, part: str) -> float:
        return 1e3 * statistics.median(r.get(part, 0.0) for r in self.rounds[case])

    def added_ms(self, case: str, part: str) -> float:
        pairs = zip(self.rounds[case], self.rounds[self.baseline])
        return 1e3 * statistics.median(r.get(part, 0.0) - b.get(part, 0.0) for r, b in pairs)

    def markdown(self) -> str:
        cases = list(self.rounds)[1:]
        unit = "CPU ms" if self.clock == "cpu" else "ms"
        head = f"| {self.title} | {self.baseline} {unit} | " + " | ".join(f"{c}: {unit} added" for c in cases) + " |"
        lines = [head, "| --- | ---: |" + " ---: |" * len(cases)]
        for part in self.parts():
            added = " | ".join(f"{self.added_ms(c, part):+.1f}" for c in cases)
            lines.append(f"| {part} | {self.median_ms(self.baseline, part):.1f} | {added} |")
        return "\n".join(lines)


def split(
    pipe: Any,
    make_cases: Callable[[contextlib.ExitStack], dict[str, Callable[[], object]]],
    *,
    title: str,
    repeats: int,
    warmup: int = 3,
    clock: str = "wall",
) -> Split:
    """Time the cases ``make_cases(stack)`` returns (made once the components are timed; what they
    must close goes on ``stack``), interleaved like :func:`~benchmarks.harness.interleaved`, the
    first the baseline."""
    now, times = CLOCKS[clock], {}
    with component_clock(pipe, times, now), contextlib.ExitStack() as stack:
        cases = make_cases(stack)
        for _ in range(warm_up_rounds(warmup)):  # one under harness.smoke_warm_ups
            for run in cases.values():
                run()
        result = Split(title, {name: [] for name in cases}, clock)
        for _ in range(repeats):
            for name, run in cases.items():
                times.clear()
                _sync()
                start = now()
                run()
                _sync()
                whole = now() - start
                result.rounds[name].append({**times, OUTSIDE: whole - sum(times.values()), WHOLE: whole})
    return result
