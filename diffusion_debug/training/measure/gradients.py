"""Gradient norms of the trainable parameters: per parameter, per module and global, with fused
``torch._foreach_norm`` reductions that stay on the device until the step's one transfer.

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
>>> model(torch.ones(1, 2)).sum().backward()
>>> params = TrainableParameters.of(model)
>>> params.names
['0.weight', '0.bias', '1.weight', '1.bias']
>>> params.module_names
['0', '1']

Limits: norms are of ``.grad`` as it is when read (the caller reads them before ``optimizer.step()`` and before
any clipping: the *pre-clipping* norm); a gradient that is ``None`` counts as zero; per-parameter norms are
accumulated in float32 (a gradient holding values above ~1e19 overflows to inf: the exact non-finite check,
:func:`nonfinite_mask`, is then run to tell overflow from a real NaN/Inf). A sharded parameter (FSDP2
``fully_shard``: a ``DTensor`` parameter and gradient) is read through this process's shard (:func:`local_part`):
the norms here are the shard's; the step's measurer sums their squares over the ranks. Under DeepSpeed ZeRO the
shards are the engine's fragments (:attr:`TrainableParameters.partitions`, ``deepspeed_zero``), summed the same
way; under Accelerate's DeepSpeed plugin the norms are those its step kept (:attr:`TrainableParameters.deepspeed`).
The model inside its engine's wrappers, named as the user wrote it: ``wrappers``.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Iterable

import numpy as np
import torch
from torch import nn

from ...stats import read_now, to_device
from .deepspeed_zero import DeepSpeedSteps, ZeroPartitions
from .wrappers import local_part, unwrap_model, wrapper_free


def embedding_tables(*models: nn.Module) -> frozenset[int]:
    """The ids of the ``nn.Embedding`` tables in ``models`` (read once, when the debugger is made), but
    those whose last row is their ``padding_idx`` (zero and never trained; nothing appended after it)."""
    return frozenset(
        id(m.weight)
        for model in models
        for m in model.modules()
        if isinstance(m, nn.Embedding) and m.padding_idx != m.num_embeddings - 1
    )


@dataclass
class TrainableParameters:
    """The parameters with ``requires_grad``, in registration order, with their module."""

    names: list[str]
    params: list[nn.Parameter]
    module_of: list[int]
    """Index into :attr:`module_names` of each parameter's module."""
    module_names: list[str]
    _index_on: dict[torch.device, torch.Tensor] = field(repr=False, default_factory=dict)
    _segments_on: dict[torch.device, torch.Tensor | None] = field(repr=False, default_factory=dict)
    """Per device: :attr:`module_of` as a tensor; each module's number of parameters (None: not consecutive)."""
    _one_kind: tuple[tuple, torch.Tensor | None] | None = field(repr=False, default=None)
    """:meth:`one_kind_zero`'s answer, with the first parameter's device and dtype when it was made."""
    partitions: ZeroPartitions | None = field(repr=False, default=None)
    """DeepSpeed ZeRO's fragments of these parameters on this rank (their gradients are there, not in ``.grad``)."""
    deepspeed: DeepSpeedSteps | None = field(repr=False, default=None)  # partitions under ZeRO, else stage 0's
    sparse_gradients: bool = field(repr=False, default=False)
    """Some gradient was sparse (``nn.Embedding(sparse=True)``): from then on each sparse one is
    measured through its coalesced values (:func:`measured_gradients`). Set by the first fused norm
    that torch refused it (no look at each gradient's layout on a dense run)."""
    paths: list[str] | None = field(repr=False, default=None)
    """Each parameter's name as the modules hold it (``named_parameters()``'s), where some differ
    from :attr:`names` (FSDP1 units, checkpoint wrappers: :func:`wrapper_free`); None: the same.
    What ``watched_models.ParameterSwaps`` walks the modules by."""
    tables: frozenset[int] = field(repr=False, default=frozenset())
    """Indices of the parameters that are an ``nn.Embedding``'s table, whose trained rows may be its
    last ones only (``updates.UpdateSketch`` samples them there)."""

    @classmethod
    def of(cls, model: nn.Module) -> "TrainableParameters":
        inner = unwrap_model(model)
        return cls.from_named(inner.named_parameters(), tables=embedding_tables(inner))

    @classmethod
    def from_named(
        cls, named: Iterable[tuple[str, nn.Parameter]], tables: frozenset[int] = frozenset()
    ) -> "TrainableParameters":
        """From ``(qualified name, parameter)`` pairs, as ``named_parameters()`` gives them; named
        without wrappers' components (:func:`wrapper_free`), the names as given kept in :attr:`paths`;
        ``tables``: the ids of the embedding tables among them (:func:`embedding_tables`)."""
        names, params, module_of, module_names, index, paths = [], [], [], [], {}, []
        for path, param in named:
            if not param.requires_grad:
                continue
            paths.append(path)
            name = wrapper_free(path)
            module = name.rpartition(".")[0]
            if module not in index:
                index[module] = len(module_names)
                module_names.append(module)
            names.append(name)
            params.append(param)
            module_of.append(index[module])
        rows = frozenset(i for i, p in enumerate(params) if id(p) in tables)
        return cls(names, params, module_of, module_names, paths=paths if paths != names else None, tables=rows)

    def join(self, named: Iterable[tuple[str, nn.Parameter]], tables: frozenset[int] = frozenset()) -> list[str]:
        """Add, at the end, the parameters of ``named`` (``named_parameters()``' pairs) that train now and are not
        here yet: a part unfrozen mid-run (``text_encoder.requires_grad_(True)``), a module or adapter added. The
        parameters here keep their indices and their modules theirs (a module's later parameters are its own
        again: the segmented sum then takes the index sum). Returns the paths added (as :attr:`paths` holds
        them); what was cached of the old list is dropped. ``tables``: as :meth:`from_named`'s."""
        have = set(map(id, self.params))
        index = {module: i for i, module in enumerate(self.module_names)}
        added = []
        for path, param in named:
            if not param.requires_grad or id(param) in have:
                continue
            have.add(id(param))
            name = wrapper_free(path)
            if self.paths is None and name != path:  # the first name that differs from its path
                self.paths = list(self.names)
            module = name.rpartition(".")[0]
            if module not in index:
                index[module] = len(self.module_names)
                self.module_names.append(module)
            self.names.append(name)
            if id(param) in tables:
                self.tables = self.tables | {len(self.params)}
            self.params.append(param)
            self.module_of.append(index[module])
            if self.paths is not None:
                self.paths.append(path)
            added.append(path)
        if added:
            self._index_on.clear()
            self._segments_on.clear()
            self._one_kind = None
            self.__dict__.pop("_dtensors", None)
        return added

    def __len__(self) -> int:
        return len(self.params)

    @functools.cached_property
    def _dtensors(self) -> bool:
        """Some parameter is a ``DTensor`` (FSDP2): read once, the list of parameters being fixed;
        every monitored step reads each parameter's local part up to three times otherwise."""
        return any(local_part(p) is not p for p in self.params)

    def one_kind_zero(self) -> torch.Tensor | None:
        """A zero of the parameters' one device and dtype (a ``None`` gradient's stand-in), or None
        when they have several, or their gradients live elsewhere (ZeRO's fragments). A gradient
        has its parameter's device and dtype, so the step's norms are one fused kernel without
        looking at every gradient (a set of 684 devices and dtypes a step on an SD UNet). Looked at
        again when the first parameter moved (``model.to``)."""
        first = self.params[0]
        cached = self._one_kind
        if cached is None or cached[0] != (first.device, first.dtype):
            kinds = {(p.device, p.dtype) for p in self.local_parameters()}
            one = self.partitions is None and len(kinds) == 1
            zero = torch.zeros((), device=first.device, dtype=first.dtype) if one else None
            cached = self._one_kind = ((first.device, first.dtype), zero)
        return cached[1]

    @property
    def sharded(self) -> bool:
        """Some parameter is sharded over the ranks (a ``DTensor``: FSDP2 ``fully_shard``; DeepSpeed ZeRO)."""
        return self.partitions is not None or self._dtensors

    def local_gradients(self) -> list[torch.Tensor | None]:
        """Each parameter's gradient as this rank holds it (its shard, ZeRO's fragment; None: none)."""
        if self.partitions is not None:
            return self.partitions.gradients()
        if not self._dtensors:
            return list(map(operator.attrgetter("grad"), self.params))  # a loop in C: no comprehension's frame
        return [local_part(p.grad) if p.grad is not None else None for p in self.params]

    def local_parameters(self) -> list[torch.Tensor]:
        """Each parameter as this rank holds it (a ``DTensor``'s local shard; else the parameter)."""
        return [local_part(p) for p in self.params] if self._dtensors else self.params

    def local_weights(self) -> list[torch.Tensor]:
        """Each parameter's weight as this rank holds it, matching :meth:`local_gradients`."""
        if self.partitions is not None:
            return self.partitions.weights()
        return [p.detach() for p in self.local_parameters()]

    def __iter__(self):
        """The parameters in registration order: the indices of a ``probes.BackwardOrder``."""
        return iter(self.params)

    def module_of_parameter(self, index: int) -> str:
        """The qualified name of the module that holds parameter ``index``."""
        return self.module_names[self.module_of[index]]

    def module_norms(self, param_norms: torch.Tensor) -> torch.Tensor:
        """Per-module L2 norms from per-parameter L2 norms (host or device float tensor)."""
        return self.module_norms_of_squares(param_norms.double().square())

    def module_norms_of_squares(self, squares: torch.Tensor) -> torch.Tensor:
        """Per-module L2 norms from the per-parameter squared L2 norms (float64, host or device): one segmented
        sum where each module's parameters are consecutive (``named_parameters``' order), in registration order
        as the ``index_add_`` into zeros it replaces (a launch fewer a step)."""
        device, of, modules = squares.device, self.module_of, len(self.module_names)
        if device not in self._segments_on:  # modules are numbered in order of first appearance
            consecutive = [m for i, m in enumerate(of) if i == 0 or of[i - 1] != m] == list(range(modules))
            lengths = to_device(np.bincount(of, minlength=modules).tolist(), torch.long, device)
            self._segments_on[device] = lengths if consecutive else None
        segments = self._segments_on[device]
        if segments is not None:
            try:  # ``unsafe``: the lengths are the modules' own (checking them would read them back)
                return torch.segment_reduce(squares, "sum", lengths=segments, unsafe=True).sqrt()
            except (NotImplementedError, RuntimeError):  # a build without it (Windows, CUDA 12.9+)
                self._segments_on[device] = None
        if device not in self._index_on:  # made once per device
            self._index_on[device] = to_device(of, torch.long, device)
        out = torch.zeros(modules, dtype=torch.float64, device=device)
        return out.index_add_(0, self._index_on[device], squares).sqrt()


def stacked_norms(tensors: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The L2 norm of each tensor (one device and dtype) as one 1-D tensor of ``dtype``, by one
    fused ``_foreach_norm``: accumulated in ``dtype``, or for float64 in float64 and then cast (a
    norm may not narrow). The same values as ``torch.stack`` of the norms, and on a GPU with no
    stack: torch's fused kernel writes every norm into one buffer and returns a view of each of
    its elements, in order, and that buffer is the answer (the stack of 684 views, an SD UNet's,
    was 684 ``unsqueeze`` dispatches and a ``cat``: host time at every monitored step). Told by the
    first and the last norm alone: views of one 1-D buffer of exactly as many elements, at its two
    ends (the kernel's buffer holds one element per non-empty tensor; an empty tensor's norm is a
    zero of its own, and then the ends are not both in it). Otherwise (a CPU's per-tensor norms, a
    cast, an empty tensor) the norms are stacked.

    >>> stacked_norms([torch.tensor([3.0, 4.0]), torch.tensor([1.0])])
    tensor([5., 1.])
    """
    if tensors[0].dtype == torch.float64 and dtype != torch.float64:
        norms = [norm.to(dtype) for norm in torch._foreach_norm(tensors, 2)]
    elif tensors[0].dtype == dtype:  # the same norms; on a CPU, asked for a dtype, torch takes 45% longer
        norms = torch._foreach_norm(tensors, 2)
    else:
        norms = torch._foreach_norm(tensors, 2, dtype=dtype)
    first, last = norms[0], norms[-1]
    base = first._base
    if (
        base is not None
        and last._base is base
        and base.dim() == 1
        and base.shape[0] == len(norms)
        and base.stride(0) == 1
        and first.storage_offset() == base.storage_offset()
        and last.storage_offset() == base.storage_offset() + len(norms) - 1
    ):
        return base
    return torch.stack(norms)


@torch.no_grad()
def _grouped_norms(tensors: list[torch.Tensor], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """L2 norm of each tensor, as ``dtype`` on ``device``, one fused kernel per (device, dtype)."""
    if len({(t.device, t.dtype) for t in tensors}) == 1:  # one pass in the comprehension, no generator
        return stacked_norms(tensors, dtype).to(device)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    out = torch.empty(len(tensors), dtype=dtype, device=device)
    for indices in groups.values():
        norms = stacked_norms([tensors[i] for i in indices], dtype)
        out[to_device(indices, torch.long, device)] = norms.to(device)
    return out


def grad_norms(params: TrainableParameters, device: torch.device, grads: list | None = None) -> torch.Tensor:
    """Per-parameter gradient L2 norms (float32, on ``device``; ``grads``: listed already); None ones give 0."""
    captured = params.deepspeed.captured() if params.deepspeed is not None else None
    if captured is not None:  # DeepSpeed under Accelerate: kept before the step that ran in backward
        return captured.norms.to(device)
    one_kind = params.one_kind_zero()
    grads = params.local_gradients() if grads is None else grads
    if params.sparse_gradients:  # an attribute read: the dense path's ops and calls are as they were
        grads = measured_gradients(grads)
    if one_kind is not None:
        # a gradient left None (a frozen branch this step) is normed as a one-element zero of its kind
        tensors = (
            grads
            if not any(map(operator.is_, grads, repeat(None)))
            else [g if g is not None else one_kind for g in grads]
        )
        enabled = torch.is_grad_enabled()  # torch.no_grad() is four Python calls a step
        torch._C._set_grad_enabled(False)
        try:
            return stacked_norms(tensors, torch.float32).to(device)
        except NotImplementedError:  # a sparse gradient (free on a dense run: 3.11's zero-cost try)
            if not _found_sparse(params, grads):
                raise
        finally:
            torch._C._set_grad_enabled(enabled)
        return grad_norms(params, device)
    zero = torch.zeros((), device=device)
    try:
        return _grouped_norms([g if g is not None else zero for g in grads], device, torch.float32)
    except NotImplementedError:
        if not _found_sparse(params, grads):
            raise
    return grad_norms(params, device)


def measured_gradients(grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Each gradient as its norm and non-finite check read it: a sparse one (``nn.Embedding(...,
    sparse=True)``) as the values of its coalesced copy (the rows it holds, repeated indices summed:
    the same L2 norm and the same NaN/Inf; the gradient itself is left as it is), a dense one as it is."""
    return [g.coalesce()._values() if g is not None and g.is_sparse else g for g in grads]


def _found_sparse(params: TrainableParameters, grads: list[torch.Tensor | None]) -> bool:
    """Whether a fused op failed on a sparse gradient seen for the first time (then measured from now on)."""
    if params.sparse_gradients or not any(g is not None and g.is_sparse for g in grads):
        return False
    params.sparse_gradients = True
    return True


def weight_norms(
    params: TrainableParameters, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Per-parameter weight L2 norms (``dtype``, on ``device``). Parameters of one device and dtype
    (:meth:`TrainableParameters.one_kind_zero`) are normed as they are, with grad mode off: no
    ``detach`` of each (684 on an SD UNet, a fifth of a refresh's host time) and no look at each
    one's device and dtype; the same norms."""
    if params.one_kind_zero() is None:
        return _grouped_norms(params.local_weights(), device, dtype)
    enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        return stacked_norms(params.local_parameters(), dtype).to(device)
    finally:
        torch._C._set_grad_enabled(enabled)


def weight_fingerprint(params: TrainableParameters) -> list[float]:
    """Each parameter's L2 norm in float64, on the host (one fused kernel per device and dtype, one
    read): equal before and after only if no weight moved, for any practical purpose (a float64
    norm resolves a change of one float32 element)."""
    return read_now(weight_norms(params, params.params[0].device, torch.float64))


def nonfinite_mask(params: TrainableParameters) -> list[bool]:
    """Exactly which gradients hold a NaN/Inf (one transfer; run only when a norm is not finite)."""
    device = params.params[0].device
    captured = params.deepspeed.captured() if params.deepspeed is not None else None
    if captured is not None:
        return read_now(~torch.isfinite(captured.largest))
    none = torch.zeros((), dtype=torch.bool, device=device)
    grads = params.local_gradients()
    if params.sparse_gradients:
        grads = measured_gradients(grads)
    flags = [(~torch.isfinite(g.detach())).any().to(device) if g is not None else none for g in grads]
    return read_now(torch.stack(flags))


def parameter_checksums(params: TrainableParameters, device: torch.device) -> torch.Tensor:
    """Sum of each parameter in float64: equal across ranks when the replicas agree."""
    return torch.stack([w.sum(dtype=torch.float64).to(device) for w in params.local_weights()])


def zero_gradients(params: TrainableParameters) -> None:
    """Set every existing gradient to zero in place (not to None: a GradScaler or DDP that
    expects the gradient tensors keeps working)."""
    grads = [g for g in params.local_gradients() if g is not None and g.numel()]
    if grads:
        torch._foreach_zero_(grads)


@dataclass
class ModuleNormBook:
    """Per-module gradient norms across steps: each module's largest and last norm, and the
    weight norms (the denominator of the update-to-weight ratio) read at the last refresh.

    Weights move slowly and reading them costs as much as reading the gradients, so they are
    re-read every ``refresh_every`` monitored steps (:meth:`refresh_due`) and cached in between.
    The per-module figures are numpy arrays (a monitored step of an SD UNet has about 400
    modules: a Python loop over them was a tenth of a millisecond of host time a step, and on a
    GPU the step's host time is what the debugger costs).
    """

    module_names: list[str]
    module_of: list[int]
    refresh_every: int = 10
    weight_norms: list[float] | None = None
    _largest: np.ndarray = field(init=False, repr=False)
    """Each module's largest finite norm (-1: none yet)."""
    _first_seen: np.ndarray = field(init=False, repr=False)
    """When each module first had a finite norm (its place among the others; the summary's ties)."""
    last_norms: np.ndarray = field(init=False, repr=False)
    """The last update's norms as an array (NaN before the first; read it, do not write it)."""
    _updates: int = field(init=False, repr=False, default=0)
    _groups: dict[tuple, np.ndarray] = field(init=False, repr=False, default_factory=dict)
    _weights: tuple[Any, np.ndarray] | None = field(init=False, repr=False, default=None)
    """:attr:`weight_norms` as an array, with the list it was made of (made once a refresh)."""

    def __post_init__(self) -> None:
        n = len(self.module_names)
        self._largest = np.full(n, -1.0)
        self._first_seen = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
        self.last_norms = np.full(n, np.nan)

    def grow(self) -> None:
        """Modules added at the end of :attr:`module_names` (``TrainableParameters.join``): no norm of theirs
        yet; the weight norms are read again at the next step."""
        added = len(self.module_names) - len(self._largest)
        self._largest = np.concatenate([self._largest, np.full(added, -1.0)])
        self._first_seen = np.concatenate([self._first_seen, np.full(added, np.iinfo(np.int64).max, dtype=np.int64)])
        self.last_norms = np.concatenate([self.last_norms, np.full(added, np.nan)])
        self.weight_norms, self._weights, self._groups = None, None, {}

    def refresh_due(self, monitored: int) -> bool:
        """Whether the ``monitored``-th monitored step (from 1) reads the weight norms."""
        return self.weight_norms is None or (monitored - 1) % self.refresh_every == 0

    def update(self, values: list[float]) -> dict[str, float]:
        """Take this step's per-module norms; returns them by module name."""
        norms = np.asarray(values, dtype=np.float64)
        self.last_norms = norms
        larger = np.isfinite(norms) & (norms > self._largest)  # a comparison with NaN sets no FP flag
        first = larger & (self._largest < 0)
        self._first_seen[first] = self._updates * len(norms) + first.nonzero()[0]
        self._largest[larger] = norms[larger]
        self._updates += 1
        return dict(zip(self.module_names, values))

    def update_ratios(
        self,
        module_norms: dict[str, float],
        param_groups: list[dict] | None,
        params: list[torch.Tensor],
        clip_scale: float = 1.0,
        *,
        norms: np.ndarray | None = None,
    ) -> dict[str, float]:
        """``lr * ||grad|| / ||weight||`` per module, with the weight norms of the last refresh:
        exact on refresh steps, with weights at most ``refresh_every`` steps old in between.
        ``clip_scale``: what clipping after monitoring multiplies the gradients by; ``norms``:
        ``module_norms``' values as an array already (:attr:`last_norms`: not read out of the dict again)."""
        if param_groups is None or self.weight_norms is None:
            return {}
        key = (id(param_groups), len(param_groups), tuple([len(g["params"]) for g in param_groups]))  # no generator
        if key not in self._groups:  # each module's group, per optimizer (a GAN's two alternate; the last 8)
            self._groups = {**dict(list(self._groups.items())[-7:]), key: self._group_of_modules(param_groups, params)}
        # each module's lr (a module in no group with an lr: the 0.0 appended last, index -1)
        # an lr of None (Adafactor's relative_step computes its own): no ratio to give, as no group
        lrs = [float(g["lr"]) if "lr" in g and g["lr"] is not None else np.nan for g in param_groups]
        lrs = np.array(lrs + [0.0])[self._groups[key]]
        grads = norms if norms is not None else np.fromiter(module_norms.values(), np.float64, len(module_norms))
        cached = self._weights
        if cached is None or cached[0] is not self.weight_norms:  # a refresh: a new list
            cached = self._weights = (self.weight_norms, np.asarray(self.weight_norms, dtype=np.float64))
        weights = cached[1]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            ratios = np.where(weights > 0, lrs * grads * clip_scale / weights, np.inf)  # the order a float loop takes
        return dict(zip(module_norms, ratios.tolist()))

    def _group_of_modules(self, param_groups: list[dict], params: list[torch.Tensor]) -> np.ndarray:
        """The param group of each module's first trainable parameter (-1: in no group with an lr)."""
        group_of = {id(p): i for i, g in enumerate(param_groups) if "lr" in g for p in g["params"]}
        out = np.full(len(self.module_names), -1, dtype=np.int64)
        seen = [False] * len(out)
        for p, m in zip(params, self.module_of):
            if not seen[m]:
                seen[m] = True
                out[m] = group_of.get(id(p), -1)
        return out

    @property
    def largest(self) -> dict[str, float]:
        """Each module's largest finite norm so far, in the order modules first had one."""
        seen = np.nonzero(self._largest >= 0)[0]
        seen = seen[np.argsort(self._first_seen[seen], kind="stable")]
        return {self.module_names[i]: float(self._largest[i]) for i in seen}

    @property
    def last(self) -> dict[str, float]:
        """Each module's norm at the last update that read it (its optimizer's; none before the first)."""
        if not self._updates:
            return {}
        return dict(zip(self.module_names, self.last_norms.tolist()))

    def summary(self) -> dict[str, dict[str, float]]:
        """For the report: the 50 largest norms seen, and the last norms of (up to) 200 modules."""
        return {
            "module_grad_norm_max": dict(sorted(self.largest.items(), key=lambda kv: -kv[1])[:50]),
            "module_grad_norm_last": dict(list(self.last.items())[:200]),
        }
