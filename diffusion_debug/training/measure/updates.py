"""The update the optimizer really applied, read from the weights themselves, whatever the
optimizer (AdamW, Adafactor, 8-bit Adam, SGD, Prodigy): a fixed sample of each parameter
(:class:`UpdateSketch`), the per-module ``||dw|| / ||w||`` it gives (:meth:`UpdateSketch.ratios`),
the judgement of an update that moved modules by more than their own norm
(:func:`judge_applied_update`), and which weights went non-finite (:func:`nonfinite_weight_mask`).

The sketch keeps one block of :data:`SAMPLED` consecutive elements of each trainable parameter (its
middle; an embedding table's end; the whole parameter when smaller) as it was at the previous
monitored step, which is read before ``optimizer.step()``: the difference at the next monitored step
is the update the step applied. The blocks of one device and dtype live in one flat buffer: per step
one ``cat`` of the blocks (which is the next step's kept copy), the difference, their squares and
both per-block squared norms in one ``segment_reduce``: a handful of ops whatever the number of
parameters (a ``_foreach_*`` op is a kernel per tensor on a CPU, and its host cost per tensor shows
on a GPU). Each block's squares are scaled to its parameter's size and summed per module on the
device too (three ops): two values per sampled module ride to the host in the step's one transfer,
not two per parameter (390 modules against 684 parameters on an SD UNet: the host read them into a
list and then into numpy, a tenth of a millisecond a step).

>>> model = torch.nn.Linear(4, 2)
>>> with torch.no_grad():  # ||w||^2 = 8 x 1 + 2 x 4 = 16
...     _ = model.weight.fill_(1.0), model.bias.fill_(2.0)
>>> sketch = UpdateSketch(TrainableParameters.of(model))
>>> sketch.measure(torch.device("cpu")) is None  # the first step: nothing to compare with yet
True
>>> with torch.no_grad():  # an update: ||dw||^2 = 8 x 2^2 + 2 x 2^2 = 40
...     _ = model.weight.mul_(3.0), model.bias.zero_()
>>> sketch.ratios(read_now(sketch.measure(torch.device("cpu"))))  # one module, the root; exact under 128 elements
{'': 1.5811388300841898}

Limits: for a parameter of more than 128 elements the block is a sample, not the whole: the ratio is a
sketch (on the tiny UNet's first AdamW update: 1.7% median error, 33% at worst); a parameter whose
storage is not dense is left out; when parameters' storage is replaced the sketch starts again, at once
when the first parameter's was, else within :data:`STORAGE_ROUND` monitored steps (a replaced
parameter's block reads as unmoved until then); anything else that writes the weights between two
monitored steps counts as the update. A module that starts at zero (LoRA's ``lora_B``, ControlNet's zero
convolutions) grows from nothing: its ratio is not judged where it was zero at this sketch's first
comparison. A debugger made a few steps into the run (a resume from an early checkpoint) finds it grown
a little: under a warmup each update is larger than the last, and the one read first may be 1-2x the
weight it has grown to. So a module above the threshold at the first comparison while the learning rate
rises, by at most :data:`GROWTH_FIRST_MAX`, is taken as growing: told once a later update reads more
than :data:`GROWTH_MARGIN` times the smallest ratio it read (growth reads falling ratios), and judged as
any other once one reads under the threshold; a real spike at that very first comparison under a warmup
is told only above that bound. An
``nn.Embedding``'s block is its last rows: the tokens a script adds are appended there
(``resize_token_embeddings``), and textual inversion and Custom Diffusion train only those, putting
every other row back after each step (its middle rows never move: the update read 0, and a new token's
row moved 100 times its norm in a step went unseen; an ``lr_spike`` there says the figure is the last
rows', not the whole table's); a full fine-tune's last CLIP rows are its start and end tokens, in every
prompt (on the tiny CLIP, AdamW: the last rows' ratio 3.5e-3, the whole table's 7.4e-4, the middle's
1.0e-6, weight decay alone). A table whose last row is its ``padding_idx`` (zero, never trained) is
sampled in its middle. One whose last rows no prompt uses (T5's vocabulary padded to 32128, Llama 3's
reserved tokens) reads weight decay alone there in a full fine-tune: a spike is seen at the model's
other modules, and ``not_learning`` checks the whole weights. The blocks are views, each holding its
parameter's whole storage: a model moved or cast mid-run (``model.to``) keeps its old weights' memory
until the sketch's next keep or reading (the steps around a scheduled one, ``step.detail``) takes them
again; ``TrainingDebugger.close`` lets go of them (:meth:`UpdateSketch.release`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ...record import Anomaly, make_anomaly
from ...stats import read_now, to_device
from .gradients import TrainableParameters
from .wrappers import local_part

SAMPLED = 128
"""Consecutive elements kept of each parameter."""
GROWTH_MARGIN = 1.25
"""How much more than the smallest ratio it has read a growing module's update may read and still be
growth: a weight grown from zero under a warmup reads about ``2 / k`` after ``k`` updates, FALLING; a
ratio that rises (3, 5, 9, ... each under twice its last) is no growth."""
GROWTH_FIRST_MAX = 4.0
"""The largest ratio at the first comparison taken as growth: a weight grown from zero by one update,
its next under a linear warmup from 0 reads 2 (twice the lr), its sign flipped or not."""
STORAGE_ROUND = 8
"""Monitored steps in which the storage check (:meth:`UpdateSketch._moved`) goes round every parameter."""
_TOP_MODULES = 5


class UpdateSketch:
    """A fixed block of each trainable parameter, kept from one monitored step to the next."""

    def __init__(self, params: TrainableParameters, sampled: int = SAMPLED):
        self.params = params
        self.sampled = sampled
        self._pointers: list[int] | None = None
        self._turn = 0
        self._groups: list[_Blocks] = []
        self._order: list[int] = []
        """Parameter index of each value of a group-ordered reading (each half of it)."""
        self._scales: list[float] = []
        self._sampled_names: list[str] = []
        """The sampled modules, in module order: a reading's order (each half of it)."""
        self._sums: dict[torch.device, _ModuleSums] = {}
        """Per device, how the blocks' squares become per-module sums there."""
        self._plan: tuple[list[float], list[int], list[int], list[int] | None] | None = None
        """Each block's scale, each block's position among the sampled modules, each sampled
        module's number of blocks, and the blocks in module order (None: they are already)."""
        self.grown_from_zero: set[str] | None = None
        """Modules whose sampled weights were all zero at the first comparison (never judged)."""
        self.growing: dict[str, float] = {}
        """Modules taken as still growing from zero (:func:`judge_applied_update`), each with the smallest
        ratio it read."""
        self.table_modules: frozenset[str] = frozenset()
        """The sampled modules whose block is an embedding table's last rows (their ratio is those rows')."""
        self.kept_at: int | None = None
        """The monitored step whose blocks are kept for the next reading (:meth:`keep`)."""
        self._current_at: int | None = None
        """The monitored step whose values the blocks' kept row holds (the last reading's or keep's)."""

    def measure(self, device: torch.device, at: int | None = None) -> torch.Tensor | None:
        """Per sampled module (float64, on ``device``) the squared norm of its blocks at the
        previous call, then the squared norm of their change since, each block's scaled to its
        parameter's size; None on the first call, and when a parameter's storage changed (the
        blocks are taken again). ``at``: the monitored step (from 1) on a schedule: read only when
        the blocks were kept at step ``at - 1`` (:meth:`keep`), else None and nothing done (None:
        every call reads). Without grad mode, switched
        off here (``torch.no_grad()`` as a decorator is seven Python calls a step)."""
        if at is not None and self._pointers is not None and self.kept_at != at - 1:
            return None  # nothing kept at the previous monitored step: no update of its to read
        enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            squares = self._measure(device)
            self._current_at = at  # a reading holds the blocks as they are now: a :meth:`keep` of them is free
            return squares
        finally:
            torch._C._set_grad_enabled(enabled)

    def keep(self, at: int) -> None:
        """Keep the blocks as they are now, at monitored step ``at`` (before its ``optimizer.step()``),
        so that the next monitored step reads the update that step applies (one ``cat`` of the blocks)."""
        if self._current_at == at and self._pointers is not None:
            self.kept_at = at  # read at this step: its values are the kept ones already
            return
        enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            params = self.params.local_parameters()
            if self._pointers is None or self._moved(params):
                self._retake(params)
            else:
                for group in self._groups:
                    group.keep()
            self.kept_at = self._current_at = at
        finally:
            torch._C._set_grad_enabled(enabled)

    def release(self) -> None:
        """Let go of the blocks (views into the weights: each holds its parameter's whole storage, so a
        model moved or cast afterwards would keep its old storage alive through them); a later
        :meth:`measure` takes them again, as at the first step."""
        self._pointers, self._groups, self._sums, self.kept_at, self._current_at = None, [], {}, None, None

    def _retake(self, params: list[torch.Tensor]) -> None:
        self._pointers = list(map(torch.Tensor.data_ptr, params))
        self._take_blocks()

    def _measure(self, device: torch.device) -> torch.Tensor | None:
        params = self.params.local_parameters()
        if self._pointers is None or self._moved(params):
            self._retake(params)
            return None
        if not self._groups:
            return None
        if len(self._groups) == 1:
            squares = self._groups[0].step()  # (2, blocks): the kept blocks', the change's
        else:  # the groups' blocks side by side, in group order (a float32 group's promoted exactly)
            squares = torch.cat([group.step() for group in self._groups], dim=1)
        sums = self._sums.get(squares.device)
        if sums is None:
            sums = self._sums[squares.device] = _ModuleSums(*self._plan, squares.device)
        return sums(squares).reshape(-1).to(device)  # a view: no op

    def _moved(self, params: list[torch.Tensor]) -> bool:
        """Whether a parameter's storage changed since the blocks were taken: the first parameter
        at every call (``model.to``, a dtype cast or a sharding moves them all), and a rotating
        :data:`STORAGE_ROUND`-th of all of them, so one parameter replaced alone (``p.data = ...``)
        is found within :data:`STORAGE_ROUND` calls; its block reads as unmoved until then. Every
        parameter's ``data_ptr`` at every call was 684 reads a step on an SD UNet, each a cold
        read after backward: 0.4-0.5 ms of a CPU step."""
        if params[0].data_ptr() != self._pointers[0]:
            return True
        self._turn = turn = (self._turn + 1) % STORAGE_ROUND
        return list(map(torch.Tensor.data_ptr, params[turn::STORAGE_ROUND])) != self._pointers[turn::STORAGE_ROUND]

    def _take_blocks(self) -> None:
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[int], list[torch.Tensor]]] = {}
        self._scales = [0.0] * len(self.params)
        tables = self.params.tables
        for i, p in enumerate(self.params.params):
            local = local_part(p)  # a sharded parameter: a block of this rank's shard
            view = _block(local, self.sampled, last=i in tables)
            if view is None:
                continue
            self._scales[i] = local.numel() / view.numel()
            indices, views = groups.setdefault((view.device, view.dtype), ([], []))
            indices.append(i)
            views.append(view)
        self._groups = [_Blocks(views) for _, views in groups.values()]
        self._order = [i for indices, _ in groups.values() for i in indices]
        modules = np.array([self.params.module_of[i] for i in self._order], dtype=np.int64)
        sampled, position, lengths = np.unique(modules, return_inverse=True, return_counts=True)
        # a module's blocks summed in the blocks' order, as a float loop over them would (contiguous
        # unless a module's parameters are of several devices or dtypes: then put in module order)
        order = np.argsort(modules, kind="stable")
        in_order = bool((order == np.arange(len(order))).all())
        self._plan = (
            [self._scales[i] for i in self._order],
            position.tolist(),
            lengths.tolist(),
            None if in_order else order.tolist(),
        )
        self._sums = {}
        self._sampled_names = [self.params.module_names[m] for m in sampled.tolist()]
        self.table_modules = frozenset(self.params.module_of_parameter(i) for i in self._order if i in tables)
        self.grown_from_zero, self.growing = None, {}

    def ratios(self, values: list[float]) -> dict[str, float]:
        """``||dw|| / ||w||`` per module from a :meth:`measure` reading back on the host
        (``inf`` for a module whose weights were zero)."""
        weight, change = np.asarray(values, dtype=np.float64).reshape(2, -1)  # (kept, change) x modules
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(weight > 0, np.sqrt(change / weight), math.inf)
        out = dict(zip(self._sampled_names, ratio.tolist()))
        if self.grown_from_zero is None:
            self.grown_from_zero = {m for m, ratio in out.items() if math.isinf(ratio)}
        return out


class _Blocks:
    """The sampled blocks of one device and dtype: views into the weights, and their values at the
    previous step in a flat buffer (float32; float64 weights stay float64), with each block's
    length.

    Two (2, elements) buffers take turns: the kept values are one's first row; a step writes the
    current values into the other's first row (``cat(out=)``), the change into the first's second
    row (``sub(out=)``) and squares the first in place: four ops a step, no allocation (a stack of
    the kept values and the change was one op and one copy more)."""

    def __init__(self, views: list[torch.Tensor]):
        self.views = views
        first = self._current()
        self._buffers = [first.new_empty((2, first.numel())) for _ in range(2)]
        self._buffers[0][0].copy_(first)
        self._turn = 0
        self._direct = all(v.dtype == first.dtype for v in views)
        """The views have the buffer's dtype: written with ``cat(out=)`` (else cast through a copy)."""
        self._sizes = torch.tensor([v.numel() for v in views])
        # each block's length, for both rows of a step's (2, elements) buffer
        self.lengths: torch.Tensor | None = self._sizes.expand(2, -1).contiguous().to(first.device)
        self._block_of: torch.Tensor | None = None
        """Each element's block, for ``index_add_`` where torch was built without ``segment_reduce``."""

    @property
    def kept(self) -> torch.Tensor:
        """The blocks' values at the previous step (flat)."""
        return self._buffers[self._turn][0]

    def _current(self) -> torch.Tensor:
        flat = torch.cat(self.views)
        return flat if flat.dtype in (torch.float32, torch.float64) else flat.float()

    def keep(self) -> None:
        """The current values become the kept ones (no reading)."""
        if self._direct:
            torch.cat(self.views, out=self.kept)
        else:
            self.kept.copy_(self._current())

    def step(self) -> torch.Tensor:
        """The kept blocks' squared L2 norms and their change's, as a (2, blocks) tensor of the
        buffer's dtype (squared: the host sums squares per module, and a root is one more op); the
        current values are kept for the next step."""
        both, after = self._buffers[self._turn], self._buffers[1 - self._turn]
        if self._direct:
            current = torch.cat(self.views, out=after[0])
        else:
            current = after[0].copy_(self._current())
        torch.sub(current, both[0], out=both[1])
        self._turn = 1 - self._turn
        both.mul_(both)  # the kept row is no longer needed: the other buffer holds the current values
        if self.lengths is not None:
            # one segmented sum per block, in the elements' order (an ``index_add_`` into zeros was
            # two ops, a third slower on a CPU, and adds in no fixed order on a GPU); ``unsafe``: the
            # lengths are the blocks' own, and the check of them would read them back (a sync on a GPU)
            try:
                return torch.segment_reduce(both, "sum", lengths=self.lengths, axis=1, unsafe=True)
            except (NotImplementedError, RuntimeError):  # a build without it (Windows, CUDA 12.9+)
                self.lengths = None
        if self._block_of is None:  # made once: 0,0,...,1,1,...
            self._block_of = torch.repeat_interleave(torch.arange(len(self.views)), self._sizes).to(both.device)
        squares = torch.zeros(2, len(self.views), dtype=both.dtype, device=both.device)
        return squares.index_add_(1, self._block_of, both)


class _ModuleSums:
    """The blocks' squared norms (a (2, blocks) reading of the groups) scaled to their parameters'
    sizes and summed per sampled module, in module order, on one device: a multiplication and one
    ``segment_reduce`` (an ``index_add_`` into zeros where torch was built without it), each sum in
    the blocks' order, as a float loop would (float64: the same figures to the last bit)."""

    def __init__(self, scales: list[float], position: list[int], lengths: list[int], order: list[int] | None, device):
        self.scales = to_device(scales, torch.float64, device)
        self.order = to_device(order, torch.long, device) if order is not None else None
        self.lengths: torch.Tensor | None = to_device(lengths, torch.long, device).expand(2, -1).contiguous()
        self._position = position
        self.modules = len(lengths)
        self._module_of: torch.Tensor | None = None
        """Each block's position among the modules, for ``index_add_`` (made at its first use)."""

    def __call__(self, squares: torch.Tensor) -> torch.Tensor:
        # (kept, change) x blocks, in float64: a float32 reading is promoted exactly by the product
        # itself (one kernel; a float64 copy first was a launch more a step)
        scaled = squares * self.scales
        if self.lengths is not None:
            ordered = scaled if self.order is None else scaled.index_select(1, self.order)
            # ``unsafe``: the lengths are the blocks' own, and the check of them would read them back
            try:
                return torch.segment_reduce(ordered, "sum", lengths=self.lengths, axis=1, unsafe=True)
            except (NotImplementedError, RuntimeError):  # a build without it (Windows, CUDA 12.9+)
                self.lengths = None
        if self._module_of is None:
            self._module_of = to_device(self._position, torch.long, scaled.device)
        sums = torch.zeros(2, self.modules, dtype=torch.float64, device=scaled.device)
        return sums.index_add_(1, self._module_of, scaled)


def _block(p: torch.Tensor, sampled: int, last: bool = False) -> torch.Tensor | None:
    """A view of ``sampled`` consecutive elements in the middle of ``p``'s storage (``last``: at its
    end; all of it when smaller); None when its storage is not dense (a strided view, a sharded parameter)."""
    dense = p.is_contiguous() or (p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last))
    if not dense or p.numel() == 0 or p.device.type == "meta":
        return None
    count = min(sampled, p.numel())
    start = p.storage_offset() + ((p.numel() - count) if last else (p.numel() - count) // 2)
    return torch.as_strided(p.detach(), (count,), (1,), start)


def judge_applied_update(
    rank: int,
    update_step: Any,
    ratios: dict[str, float],
    threshold: float,
    *,
    detected_at: Any,
    skip: set[str] = frozenset(),
    tables: frozenset[str] = frozenset(),
    growing: dict[str, float] | None = None,
    first: bool = False,
    warming: bool = False,
) -> list[Anomaly]:
    """``lr_spike`` (reason ``applied_update``) for the optimizer step of ``update_step`` when it
    moved a module (outside ``skip``) by more than ``threshold`` times its norm. ``tables``: the
    modules whose figure is an embedding table's last rows' (``details["last_rows"]``: the top one
    is such a table, whose whole norm moved far less where only those rows train). ``growing``
    (``UpdateSketch.growing``, updated here): the modules taken as still growing from zero, each with
    the smallest ratio it read; at the ``first`` comparison while ``warming`` (the learning rate rose) each module
    above the threshold (up to :data:`GROWTH_FIRST_MAX`) joins it; one leaves it at an update under the
    threshold, or is told at one of more than :data:`GROWTH_MARGIN` times that smallest ratio.

    >>> growing = {}
    >>> judge_applied_update(0, 3, {"lora_B": 2.0}, 1.0, detected_at=4, growing=growing, first=True, warming=True)
    []
    >>> judge_applied_update(0, 4, {"lora_B": 1.5}, 1.0, detected_at=5, growing=growing), growing
    ([], {'lora_B': 1.5})
    >>> [a.module for a in judge_applied_update(0, 5, {"lora_B": 30.0}, 1.0, detected_at=6, growing=growing)]
    ['lora_B']
    >>> spike = judge_applied_update(0, 3, {"conv": 10.0}, 1.0, detected_at=4, growing={}, first=True, warming=True)
    >>> [a.module for a in spike]  # above GROWTH_FIRST_MAX at the first comparison: no growth
    ['conv']
    """
    values = np.fromiter(ratios.values(), dtype=np.float64, count=len(ratios))
    finite = np.isfinite(values)  # one numpy pass where a per-module loop ran every step
    hits = (finite & (values > threshold)).nonzero()[0]
    if growing:  # a resumed run's first updates (no call on a run with none)
        _grown(growing, ratios, threshold)
    if not len(hits):  # the usual step: no list or sort made (two Python calls)
        return []
    names = list(ratios)
    above = [(names[i], ratios[names[i]]) for i in hits.tolist()]
    if growing is not None and (growing or (first and warming)):
        above = _not_growth(above, growing, first and warming)
    over = sorted(((m, r) for m, r in above if m not in skip), key=lambda kv: -kv[1])
    if not over:
        return []
    measured = int(finite.sum()) - sum(1 for m in skip if m in ratios and math.isfinite(ratios[m]))
    details = {
        "reason": "applied_update",
        "update_to_weight_ratio": over[0][1],
        "threshold": threshold,
        "modules_over": len(over),
        "modules_measured": measured,
        "top_modules": dict(over[:_TOP_MODULES]),
        "detected_at_step": detected_at,
    }
    if over[0][0] in tables:
        details["last_rows"] = True
    return [
        make_anomaly(
            kind="lr_spike",
            component="optimizer",
            module=over[0][0],
            step=update_step,
            rank=rank,
            details=details,
        )
    ]


def _grown(growing: dict[str, float], ratios: dict[str, float], threshold: float) -> None:
    """Each growing module whose update read at most ``threshold`` leaves ``growing``: grown, judged from now on."""
    for module in [m for m in growing if m in ratios and ratios[m] <= threshold]:
        del growing[module]


def _not_growth(above: list[tuple[str, float]], growing: dict[str, float], joins: bool) -> list[tuple[str, float]]:
    """The modules over the threshold whose update is not a growing module's (``joins``: those above it now
    join ``growing``); each growing one keeps the smallest ratio it read, and one told leaves it."""
    told = []
    for module, ratio in above:
        least = growing.get(module)
        if least is None and joins and ratio <= GROWTH_FIRST_MAX:
            growing[module] = ratio
        elif least is not None and ratio <= GROWTH_MARGIN * least:
            growing[module] = min(least, ratio)
        else:
            growing.pop(module, None)
            told.append((module, ratio))
    return told


@torch.no_grad()
def nonfinite_weight_mask(params: TrainableParameters) -> list[bool]:
    """Exactly which trainable weights hold a NaN/Inf (one reduction each and one transfer: run
    only on a step whose loss or gradients are non-finite already)."""
    device = params.params[0].device
    flags = [(~torch.isfinite(local_part(p).detach())).any().to(device) for p in params.params]
    return read_now(torch.stack(flags))
