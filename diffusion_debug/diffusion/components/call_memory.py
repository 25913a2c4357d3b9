"""Memory across the calls of a pipeline: what the OOM watch hooks, and ``memory_growth`` when a
pipeline called again and again keeps more memory after each call.

>>> growth = CallMemoryGrowth(threshold_mb=30)
>>> found = [growth.after_call(call, {"rss_mb": mb}) for call, mb in enumerate([500, 520, 521, 533, 545, 557])]
>>> [a.details["first_call"] if a else None for a in found]
[None, None, None, None, None, 3]
>>> found[-1].message  # doctest: +NORMALIZE_WHITESPACE
'Process memory grew by 36 MB over 3 pipeline calls (12.0 MB a call), from call 3 on: something keeps
 what each call made (outputs appended to a list, a cache, state kept by a callback).'

A sample is taken after each call (when the next one begins, and at detach): host RSS, and CUDA
allocated memory when CUDA is in use; a call *grows* when it left more than ``floor_mb`` more than
the call before (default: 1% of ``memory_growth_mb``, at least 1 MB). ``memory_growth`` is recorded
once per source when at least 3 calls in a row grew and together by the streak's threshold:
``memory_growth_mb``, or :data:`PROCESS_SHARE` of the source's first sample (what the process held
before the first call: its weights, its libraries) when that is less, so a steady leak is seen
within a few calls whatever the process's size (40 MB a call in a 550 MB process: at the 3rd of
them; 1 GB in all would take 26); ``first_call`` is the first call of that streak (calls are
numbered from 1, as the rows' ``run``).
The first call's own growth (warm-up: lazy buffers, allocator caches) is no streak of its own
unless the calls after it grow too.

Limits: RSS also moves with the allocator's caching; a slow leak under ``floor_mb`` a call is not
seen; memory freed during a call (a garbage collection of other objects) offsets what it kept; a
leak of small tensors (under glibc's mmap threshold, up to 32 MB each) reuses the pages memory freed
before it left resident, and RSS grows only once they are used up (a 32 MB-a-call leak in 1 MB
tensors after 200 MB were collected: 0.0 MB a call, for some 6 calls). The C heap in use would see
it at once, but glibc's ``mallinfo2`` walks every free chunk (149 ms a read on a fragmented heap):
not read here.
Sampling takes no device synchronisation (CUDA figures are the allocator's counters).
"""

from __future__ import annotations

from typing import Any

from ...core.out_of_memory import Watched
from ...probes import sentinel_modules
from ...record import Anomaly, make_anomaly
from .compiled import compile_state
from .inventory import Component, call_phase, call_sites, is_loop_role
from .structure import TreeMemo

STREAK = 3
PROCESS_SHARE = 0.1
"""A streak that grew by this share of the memory held before the first call is a leak, even
under ``memory_growth_mb`` (never under ``STREAK`` times the floor)."""
_SOURCES = ("rss_mb", "cuda_allocated_mb")


class CallMemoryGrowth:
    """The per-call memory samples of one debugger, judged as they come."""

    def __init__(self, threshold_mb: float, floor_mb: float | None = None):
        self.threshold_mb = threshold_mb
        self.floor_mb = floor_mb if floor_mb is not None else max(1.0, threshold_mb / 100)
        self.sampled: int | None = None
        """The last call a sample was taken after (0: before the first)."""
        self._last: dict[str, float] = {}
        self._first: dict[str, float] = {}  # source -> its first sample, the size the threshold scales with
        self._streak: dict[str, tuple[int, float, int]] = {}  # source -> (first call, MB grown, calls)
        self._flagged: set[str] = set()

    def after_call(self, call: int, sample: dict[str, Any]) -> Anomaly | None:
        """Take the sample left after ``call``; the ``memory_growth`` anomaly when it completes a streak."""
        self.sampled = call
        found = None
        for source in _SOURCES:
            value = sample.get(source)
            if value is None:
                continue
            before, self._last[source] = self._last.get(source), value
            if before is None:
                self._first[source] = value
                continue
            grown = value - before
            if grown <= self.floor_mb:
                self._streak.pop(source, None)
                continue
            first, total, calls = self._streak.get(source, (call, 0.0, 0))
            self._streak[source] = (first, total + grown, calls + 1)
            threshold = min(self.threshold_mb, max(PROCESS_SHARE * self._first[source], STREAK * self.floor_mb))
            if calls + 1 >= STREAK and total + grown >= threshold and source not in self._flagged:
                self._flagged.add(source)
                found = found or _anomaly(source, value, first, total + grown, calls + 1, call)
        return found

    def clear(self) -> None:
        self.__init__(self.threshold_mb, self.floor_mb)


def _anomaly(source: str, value: float, first: int, grown: float, calls: int, call: int) -> Anomaly:
    per_call = grown / calls
    return make_anomaly(
        "memory_growth",
        details={
            "source": source.removesuffix("_mb"),
            "growth_mb": grown,
            "per_call_mb": per_call,
            "first_call": first,
            "calls": calls,
            "last_call": call,
            source: value,
        },
    )


def oom_targets(components: list[Component], memo: TreeMemo | None = None) -> list[Watched]:
    """Every call site and its blocks, for the OOM watch (a compiled component: its call site only
    when hooks there run outside the compiled code, else nothing: the fallback of ``with`` /
    ``watch`` records it). ``memo``: reused while a component's module tree is unchanged."""
    memo = memo or TreeMemo()
    targets: list[Watched] = []
    for c in components:  # (memo.get spelled out, a loop: no Python call a component when kept, at every attach)
        values = memo.current.get(id(c.module), {})
        targets += (
            values["oom_targets"] if "oom_targets" in values else values.setdefault("oom_targets", _targets(c, memo))
        )
    return targets


def _targets(component: Component, memo: TreeMemo) -> list[Watched]:
    module = component.module
    state = memo.get(module, "compile_state", lambda: compile_state(module))
    if state in ("in_place", "method", "regional"):  # hooks around compiled code: no post-hook sees an error
        return []
    out = []
    for site in call_sites(component):
        modules = [(site.prefix, site.module)]
        if state is None:
            prefix = f"{site.prefix}." if site.prefix else ""
            modules += [(prefix + name, m) for name, m in sentinel_modules(site.module)]
        phase = call_phase(site.role, site.prefix)
        out.append(Watched(site.component, site.role, modules, phase, in_loop=is_loop_role(site.role)))
    return out
