"""Per-module gradient health: every module's gradient norm kept in bounded form, and a module
whose gradients die named at the step it became clear.

Each monitored step the per-module norms (already on the host: they ride in the step's one
transfer) go through :meth:`ModuleHealth.update`, on log10 scale:

* each module's own history, an exponential moving average (weight :data:`HISTORY_WEIGHT`) over
  its healthy readings (frozen while it is low, so a dead module does not drag it down);
* the module is *low* at a step when its norm is :data:`DEAD_ORDERS` orders of magnitude below
  the step's median module (its peers) and below its own history (after :data:`SETTLED` healthy
  readings), or, before it ever had a healthy reading, :data:`BORN_DEAD_ORDERS` below its peers
  (a branch detached from the loss from the first step has no healthy history to fall from);
  low for :data:`DEAD_STEPS` steps in a row, it is dead from that step on, and it is reported
  once (again only after it recovered);
* the dead modules are named by the largest block all of whose modules are low or have no
  gradient to speak of (``down_blocks.0`` rather than its 20 convolutions);
* :class:`StepHeat`, the module x step map of the report: log10 norms in at most
  :data:`HEAT_COLUMNS` columns (when full, neighbouring columns merge and each new one spans twice
  the steps).

>>> health = ModuleHealth(["a.0", "a.1", "b", "c", "d"])
>>> for step in range(6):  # a's gradients x1e-11 from step 3
...     dead = health.update(step, [1e-12, 2e-12, 0.5, 0.3, 0.4] if step >= 3 else [0.1, 0.2, 0.5, 0.3, 0.4])
>>> print(judge_modules(0, 5, dead)[0].message)
The gradients of a (2 modules) fell to 1e-12 at step 5, 11 orders of magnitude below the other modules
(1e-1) and 11 below their own history (1e-1), for 3 steps since step 3: check that it still receives
the loss (a detached or bypassed branch, a frozen part, a gradient hook or mask that scales it).

Limits: a module whose gradients were exactly zero or non-finite from the start (a fresh LoRA
``lora_A`` while ``lora_B`` is zero) is never called dead, nor one less than
:data:`BORN_DEAD_ORDERS` below its peers from the start (a small but live module); the peers' median is taken
over the modules with a positive finite norm at that step, so a run where most modules die at once
names none. The map's columns are means of log10 norms: a one-step dip inside a wide column is
diluted (the anomaly, not the map, names it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...record import Anomaly, make_anomaly

DEAD_ORDERS = 4.0
"""Orders of magnitude below the peers' median and below the module's own history."""
BORN_DEAD_ORDERS = 8.0
"""Orders of magnitude below the peers' median for a module with no healthy reading yet: far
beyond any two live modules' spread (at most 4 to 5 orders in the clean training configs)."""
DEAD_STEPS = 3
"""Low readings in a row before a module is dead."""
SETTLED = 3
"""Healthy readings before a module's own history counts."""
HISTORY_WEIGHT = 0.1
HEAT_COLUMNS = 64
_ZERO_LOG10 = -30.0
"""log10 of a zero norm, as the summaries keep it."""
_NAMED = 5


@dataclass(frozen=True)
class DeadGroup:
    """Modules that died together, named by the largest block that holds only low modules."""

    name: str
    modules: list[str]
    since_step: Any
    log10_grad_norm: float
    peers_log10: float
    history_log10: float

    @property
    def orders_below_peers(self) -> float:
        return self.peers_log10 - self.log10_grad_norm

    @property
    def orders_below_history(self) -> float:
        return self.history_log10 - self.log10_grad_norm


class StepHeat:
    """log10 gradient norm per module over steps in at most ``columns`` columns (an even number)."""

    def __init__(self, modules: int, columns: int = HEAT_COLUMNS):
        self.columns = columns
        self.sums = np.zeros((modules, columns))
        self.counts = np.zeros((modules, columns), dtype=np.int64)
        self.nonfinite = np.zeros((modules, columns), dtype=bool)
        self.steps: list[list[Any]] = []
        """First and last step of each column."""
        self.width = 1
        self._filled = 0

    def add(self, step: Any, logs: np.ndarray, read: np.ndarray | None = None) -> None:
        """One step's log10 norms (``read``: the modules the step read; the others' NaN is no NaN/Inf)."""
        if not self.steps or self._filled >= self.width:
            if len(self.steps) == self.columns:
                self._halve()
            self.steps.append([step, step])
            self._filled = 0
        column = len(self.steps) - 1
        finite = np.isfinite(logs)
        self.sums[finite, column] += logs[finite]
        self.counts[finite, column] += 1
        self.nonfinite[~finite if read is None else ~finite & read, column] = True
        self.steps[column][1] = step
        self._filled += 1

    def grow(self, added: int) -> None:
        """``added`` modules at the end (parameters that started training mid-run): unread in the columns so far."""
        self.sums = np.concatenate([self.sums, np.zeros((added, self.columns))])
        self.counts = np.concatenate([self.counts, np.zeros((added, self.columns), dtype=np.int64)])
        self.nonfinite = np.concatenate([self.nonfinite, np.zeros((added, self.columns), dtype=bool)])

    def _halve(self) -> None:
        half = self.columns // 2
        for table in (self.sums, self.counts):
            table[:, :half] = table[:, 0::2] + table[:, 1::2]
            table[:, half:] = 0
        self.nonfinite[:, :half] = self.nonfinite[:, 0::2] | self.nonfinite[:, 1::2]
        self.nonfinite[:, half:] = False
        self.steps = [[a[0], b[1]] for a, b in zip(self.steps[0::2], self.steps[1::2])]
        self.width *= 2
        self._filled = self.width  # the merged columns are full

    def summary(self, names: list[str]) -> dict[str, Any]:
        used = len(self.steps)
        counts = self.counts[:, :used]
        means = np.where(counts > 0, self.sums[:, :used] / np.maximum(counts, 1), np.nan)
        return {
            "modules": list(names),
            "steps": [list(span) for span in self.steps],
            "log10": [[round(float(v), 2) if np.isfinite(v) else None for v in row] for row in means],
            "nonfinite": [[int(i), int(j)] for i, j in zip(*np.nonzero(self.nonfinite[:, :used]))],
        }


class ModuleHealth:
    """Each module's gradient history and the modules that died (see the module's docstring)."""

    def __init__(self, module_names: list[str]):
        n = len(module_names)
        self.names = list(module_names)
        self.history = np.full(n, np.nan)
        self.readings = np.zeros(n, dtype=np.int64)
        self.low_steps = np.zeros(n, dtype=np.int64)
        self.low_since: list[Any] = [None] * n
        self.dead = np.zeros(n, dtype=bool)
        self.last = np.full(n, np.nan)
        self.heat = StepHeat(n)
        self._members: dict[str, np.ndarray] = {}

    def grow(self, module_names: list[str]) -> None:
        """The modules of parameters that started training mid-run (``TrainableParameters.join``), at the end of
        ``module_names``: judged as those trained from the start, from their first reading (a module is called
        dead only after :data:`SETTLED` readings of its own, or low beside its peers from its first)."""
        added = len(module_names) - len(self.names)
        if added <= 0:
            return
        self.names = list(module_names)
        self.history = np.concatenate([self.history, np.full(added, np.nan)])
        self.readings = np.concatenate([self.readings, np.zeros(added, dtype=np.int64)])
        self.low_steps = np.concatenate([self.low_steps, np.zeros(added, dtype=np.int64)])
        self.low_since += [None] * added
        self.dead = np.concatenate([self.dead, np.zeros(added, dtype=bool)])
        self.last = np.concatenate([self.last, np.full(added, np.nan)])
        self.heat.grow(added)
        self._members = {}

    def update(self, step: Any, norms: list[float], read: np.ndarray | None = None) -> list[DeadGroup]:
        """Take one step's per-module norms; the groups of modules that died at this step. ``read``
        (None: all): the modules the step read, those of the parameters its optimizer steps (a GAN's
        generator's at its step); the others are left as they were, neither low nor healthy."""
        values = np.asarray(norms, dtype=np.float64)
        if read is not None:
            values = np.where(read, values, np.nan)
        finite = np.isfinite(values)
        logs = np.empty(values.shape)  # np.full and ndarray.any are Python functions (two calls, one)
        logs.fill(np.nan)
        logs[finite] = np.log10(np.maximum(values[finite], 10.0**_ZERO_LOG10))
        if read is None:
            self.last = logs
        else:
            self.last = np.where(read, logs, self.last)
        self.heat.add(step, logs, read)
        positive = finite & (values > 0)
        if not np.logical_or.reduce(positive):
            return []
        peers = _median(logs[positive])
        with np.errstate(invalid="ignore"):
            low = (
                finite
                & (self.readings >= SETTLED)
                & (peers - logs >= DEAD_ORDERS)
                & (self.history - logs >= DEAD_ORDERS)
            )
            low |= positive & (self.readings == 0) & (peers - logs >= BORN_DEAD_ORDERS)  # dead from the start
            # a zero (or flushed) norm beside a dead one is no live peer (one ``errstate``: three calls each)
            quiet = finite & (peers - logs >= BORN_DEAD_ORDERS)
        healthy = finite & ~low
        first = healthy & (self.readings == 0)
        self.history[first] = logs[first]
        later = healthy & ~first
        self.history[later] += HISTORY_WEIGHT * (logs[later] - self.history[later])
        self.readings[healthy] += 1
        self.dead &= ~healthy  # recovered: reported again if it dies again
        self.low_steps[~low if read is None else ~low & read] = 0  # an unread module's run of lows goes on
        for i in (low & (self.low_steps == 0)).nonzero()[0]:  # the method: no Python dispatch a call
            self.low_since[i] = step
        self.low_steps[low] += 1
        newly = low & (self.low_steps >= DEAD_STEPS) & ~self.dead
        self.dead |= newly
        return self._groups(newly.nonzero()[0], low | quiet, logs, peers)

    def _groups(self, newly: np.ndarray, low: np.ndarray, logs: np.ndarray, peers: float) -> list[DeadGroup]:
        named: dict[str, None] = {}
        for i in newly:
            named.setdefault(self._block(self.names[i], low))
        out = []
        for name in named:
            members = self.members(name)
            out.append(
                DeadGroup(
                    name=name,
                    modules=[self.names[i] for i in members],
                    since_step=min((self.low_since[i] for i in members), key=_order),
                    log10_grad_norm=float(np.median(logs[members])),
                    peers_log10=peers,
                    history_log10=float(np.median(self.history[members])),
                )
            )
        return out

    def _block(self, name: str, low: np.ndarray) -> str:
        """The largest block holding ``name`` whose modules are all low."""
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            if low[self.members(prefix)].all():
                return prefix
        return name

    def members(self, block: str) -> np.ndarray:
        """Indices of the modules that are ``block`` or inside it."""
        found = self._members.get(block)
        if found is None:
            inside = block + "."
            found = np.array([i for i, n in enumerate(self.names) if n == block or n.startswith(inside)], dtype=int)
            self._members[block] = found
        return found

    def summary(self) -> dict[str, Any]:
        """For the report: the module x step map and each module's history and last reading (log10)."""

        def rounded(values: np.ndarray) -> dict[str, float | None]:
            return {n: round(float(v), 2) if np.isfinite(v) else None for n, v in zip(self.names, values)}

        return {
            "module_grad_map": self.heat.summary(self.names),
            "module_grad_log10_history": rounded(self.history),
            "module_grad_log10_last": rounded(self.last),
            "dead_modules": [n for n, d in zip(self.names, self.dead) if d],
        }


def _order(step: Any) -> Any:
    return (0, step) if isinstance(step, (int, float)) else (1, str(step))


def _finite_or_none(value: float) -> float | None:
    return value if np.isfinite(value) else None


def judge_modules(rank: int, step: Any, groups: list[DeadGroup]) -> list[Anomaly]:
    """``gradient_vanishing`` (reason ``module``) for each group of modules that died at ``step``."""
    return [
        make_anomaly(
            kind="gradient_vanishing",
            severity="warning",
            component="model",
            module=group.name,
            step=step,
            rank=rank,
            details={
                "reason": "module",
                "modules": len(group.modules),
                "dead_modules": group.modules[:_NAMED],
                "log10_grad_norm": group.log10_grad_norm,
                "peers_log10": group.peers_log10,
                # None: no module of the group ever had a healthy reading (dead from the start)
                "history_log10": _finite_or_none(group.history_log10),
                "orders_below_peers": group.orders_below_peers,
                "orders_below_history": _finite_or_none(group.orders_below_history),
                "since_step": group.since_step,
                "steps": DEAD_STEPS,
            },
        )
        for group in groups
    ]


def _median(values: np.ndarray) -> float:
    """``np.median`` of finite ``values`` (a copy, sorted in place): the same float, without its
    fifteen Python calls a step (the mean of the two middle values is their sum halved, as here)."""
    values.sort()
    n = len(values)
    return float(values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2)
