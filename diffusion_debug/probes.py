"""Probes: watch what modules produce, with torch's own hooks, and find the first bad one.

A :class:`Probe` registers a forward pre-hook (inputs) and a forward hook (outputs) on each
watched module (it never replaces ``.forward``: accelerate and diffusers both do, and a
third system would break them).  Each hook queues one reduction per tensor on the tensors'
device (:func:`stats.finite_signal`: the abs-max for fp16/bf16/fp8, a sum otherwise);
:meth:`Probe.collect` fetches everything queued in one transfer.

Two granularities:

* ``"sentinel"``: the blocks of a model (:func:`sentinel_modules`), one op per tensor: cheap
  enough to leave on. With ``measure_inputs=False, dtypes=OVERFLOW_DTYPES`` it watches only the
  block outputs that can overflow (fp16, fp8): a NaN/Inf in a wider dtype reaches the
  component's output, which a caller checks anyway (the denoiser's sentinel in the diffusion
  debugger works so).
* ``"full"``: every module, inputs and outputs: names the exact producer.

The readings come in the order modules finish, so the *producer* of a NaN/Inf is the first
reading whose output is non-finite while its inputs were finite: the module that made it, not its
parent (which finishes later) nor the next module (whose input is already bad).

Limits: only tensors passed as arguments (positional or keyword) count as inputs; a NaN made by
functional code inside a parent's ``forward`` between two child modules is attributed to that
parent.  Parameters are not inputs: a module whose weight holds an Inf is a producer.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from .stats import cuda_devices, dtype_max, dtype_name, finite_signal, is_low_precision, iter_tensors, to_host

GRANULARITIES = ("sentinel", "full")
#: The dtypes whose largest finite value an activation can reach (fp16's is 65504; bf16's is as
#: large as float32's): what a sentinel watches by default.
OVERFLOW_DTYPES: tuple[torch.dtype, ...] = (torch.float16,) + tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)


class ProbeHandle:
    """Removes the hooks one attach added. ``remove()`` is idempotent; usable as a context
    manager (``with probe.attach(): ...``)."""

    def __init__(self, handles: Iterable[Any], on_remove: Callable[[], None] | None = None):
        self._handles = list(handles)
        self._on_remove = on_remove

    @property
    def attached(self) -> bool:
        return bool(self._handles) or self._on_remove is not None

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        on_remove, self._on_remove = self._on_remove, None
        try:
            for handle in handles:
                handle.remove()
        finally:
            if on_remove is not None:
                on_remove()

    def __enter__(self) -> "ProbeHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


@dataclass(frozen=True)
class ModuleReading:
    """One call of one watched module, as fetched by :meth:`Probe.collect`."""

    module: str
    """Qualified name inside the probed model (``""`` for the model itself)."""
    call: int
    """Calls of this module before this one since the last ``collect`` (0 for the first)."""
    dtype: str | None
    """dtype of the first output tensor."""
    input_value: float | None
    """:func:`stats.finite_signal` over the floating tensors passed in: non-finite exactly when
    one of them was (``None``: none measured)."""
    output_value: float | None
    input_dtype: str | None = None
    """dtype of the first floating input tensor."""

    @property
    def input_finite(self) -> bool:
        return _finite(self.input_value)

    @property
    def output_finite(self) -> bool:
        return _finite(self.output_value)

    @property
    def output_absmax(self) -> float | None:
        """The output's abs-max, known for fp16/bf16/fp8 outputs (``None`` otherwise)."""
        return self.output_value if _low(self.dtype) else None

    @property
    def input_absmax(self) -> float | None:
        """The inputs' abs-max, known when they are fp16/bf16/fp8 (``None`` otherwise)."""
        return self.input_value if _low(self.input_dtype) else None

    @property
    def dtype_max_fraction(self) -> float | None:
        """Output abs-max as a share of the output dtype's largest finite value."""
        absmax = self.output_absmax
        if absmax is None or not self.output_finite:
            return None
        return absmax / dtype_max(getattr(torch, self.dtype))

    @property
    def input_dtype_max_fraction(self) -> float | None:
        """Input abs-max as a share of the output dtype's largest finite value (``None`` when the
        input abs-max is not known; non-finite when the inputs were)."""
        absmax = self.input_absmax
        return None if absmax is None or self.dtype is None else absmax / dtype_max(getattr(torch, self.dtype))


def _low(dtype: str | None) -> bool:
    return dtype is not None and is_low_precision(getattr(torch, dtype))


def _finite(value: float | None) -> bool:
    return value is None or (value == value and abs(value) != float("inf"))


def sentinel_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks of ``model`` that a sentinel probe watches.

    One rule serves UNets, transformers, VAEs and text encoders: every element of an
    ``nn.ModuleList`` is a block (``down_blocks.1``, ``transformer_blocks.3``,
    ``text_model.encoder.layers.0``); a child whose subtree holds no ``ModuleList`` is a block
    as a whole (``conv_in``, ``time_embedding``, ``norm_out``); the rest is descended into.
    A model with no ``ModuleList`` at all is watched through its direct children.
    """
    has_list: dict[nn.Module, bool] = {}

    def holds_list(module: nn.Module) -> bool:
        if module not in has_list:
            has_list[module] = isinstance(module, nn.ModuleList) or any(holds_list(c) for c in module.children())
        return has_list[module]

    picks: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            qualified = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.ModuleList):
                picks.extend((f"{qualified}.{i}", block) for i, block in child.named_children())
            elif holds_list(child):
                visit(qualified, child)
            else:
                picks.append((qualified, child))

    visit("", model)
    return picks or list(model.named_children())


# Modules that cannot turn finite inputs into NaN/Inf (elementwise activations that never
# exceed their input's magnitude by much, dropout, reshapes): a full probe could never name one
# as the producer, so it skips them.  They are a fifth of a UNet's module calls.
PASS_THROUGH: tuple[type[nn.Module], ...] = (
    nn.Identity,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.SiLU,
    nn.GELU,
    nn.Tanh,
    nn.Sigmoid,
    nn.Mish,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Flatten,
    nn.Unflatten,
)


def all_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module of ``model``, the model itself included (as ``""``), except the
    :data:`PASS_THROUGH` ones."""
    return [
        (name, m)
        for name, m in model.named_modules(remove_duplicate=False)
        if name == "" or not isinstance(m, PASS_THROUGH)
    ]


class Probe:
    """Watches the inputs and outputs of named modules; readings stay on device until
    :meth:`collect`.

    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    >>> probe = Probe(model, "full")
    >>> with probe.attach():
    ...     _ = model(torch.ones(1, 2))
    >>> [r.module for r in probe.collect()]  # the ReLU cannot make NaN/Inf: not watched
    ['0', '2', '']

    The probe holds its model weakly and adds no attribute to any module.  A failure inside a
    hook is kept in :attr:`errors` and the forward goes on, unless ``strict``.
    """

    def __init__(
        self,
        model: nn.Module,
        granularity: str = "sentinel",
        *,
        modules: list[tuple[str, nn.Module]] | None = None,
        measure_inputs: bool = True,
        dtypes: tuple[torch.dtype, ...] | None = None,
        strict: bool = False,
    ):
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, not {granularity!r}.")
        self._model = weakref.ref(model)
        self.granularity = granularity
        if modules is None:
            modules = all_modules(model)
            if granularity == "sentinel":  # a block that cannot make NaN/Inf (SiLU, ...) is not watched
                modules = [(n, m) for n, m in sentinel_modules(model) if not isinstance(m, PASS_THROUGH)]
        self.module_names = [name for name, _ in modules]
        self._modules = [weakref.ref(m) for _, m in modules]
        self.measure_inputs = measure_inputs
        self.dtypes = dtypes
        """Measure only tensors of these dtypes (``None``: every floating tensor). A sentinel that
        only looks for overflow watches the dtypes that can overflow (fp16, fp8): a NaN or Inf in
        a wider dtype reaches the component's output, which is checked anyway."""
        self.strict = strict
        self.errors: list[tuple[str, str]] = []
        self._values: list[torch.Tensor] = []
        # per finished call: (name, call, dtype, input value indices, output value indices, input dtype)
        self._calls: list[tuple[str, int, str | None, tuple[int, ...], tuple[int, ...], str | None]] = []
        self._open: dict[int, list[tuple[tuple[int, ...], str | None]]] = {}  # id(module) -> inputs measured
        self._counts: dict[str, int] = {}
        self._seen: dict[tuple[int, int], tuple[weakref.ref, int]] = {}  # tensor -> its value index

    # -- hooks -------------------------------------------------------------------------
    def _measure(self, obj: Any) -> tuple[tuple[int, ...], str | None]:
        """Queue the finite signal of every floating tensor in ``obj``; return their value
        indices and the first one's dtype.  Each tensor is measured once (a module's input is
        usually the previous module's output), remembered by identity and version counter, so an
        in-place change is measured again, and weakly, so no activation is kept alive.  Several
        values are combined on the host after the transfer, not with more device work here."""
        indices, dtype = [], None
        dtypes = self.dtypes
        for tensor in _tensors(obj):
            if dtypes is not None and tensor.dtype not in dtypes:
                continue
            # an inference tensor (torch.inference_mode) has no version counter: measured each time
            key = None if tensor.is_inference() else (id(tensor), tensor._version)
            seen = self._seen.get(key) if key is not None else None
            if seen is not None and seen[0]() is tensor:
                index = seen[1]
            else:
                value = finite_signal(tensor)
                if value is None:
                    continue
                index = len(self._values)
                self._values.append(value)
                if key is not None:
                    self._seen[key] = (weakref.ref(tensor), index)
            indices.append(index)
            if dtype is None:
                dtype = dtype_name(tensor.dtype)
        return tuple(indices), dtype

    def _make_hooks(self, name: str):
        # finite_signal works on detached tensors: no grad mode needed, even while training
        def pre_hook(module, args, kwargs):
            try:
                self._open.setdefault(id(module), []).append(self._measure((args, kwargs)))
            except Exception as error:  # never break the forward we watch
                self._fail(name, error)

        def post_hook(module, args, kwargs, output):
            try:
                stack = self._open.get(id(module))
                inputs, in_dtype = stack.pop() if stack else ((), None)
                outputs, dtype = self._measure(output)
                call = self._counts.get(name, 0)
                self._counts[name] = call + 1
                if outputs or inputs or self.dtypes is None:  # a call with nothing watched: no reading
                    self._calls.append((name, call, dtype, inputs, outputs, in_dtype))
            except Exception as error:
                self._fail(name, error)

        return pre_hook, post_hook

    def _fail(self, name: str, error: Exception) -> None:
        self.errors.append((name, f"{type(error).__name__}: {error}"))
        if self.strict:
            raise error

    # -- public ------------------------------------------------------------------------
    def attach(self) -> ProbeHandle:
        """Register the hooks; the returned handle removes exactly them."""
        handles = []
        try:
            for name, ref in zip(self.module_names, self._modules):
                module = ref()
                if module is None:
                    continue
                pre_hook, post_hook = self._make_hooks(name)
                if self.measure_inputs:
                    handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
                handles.append(module.register_forward_hook(post_hook, with_kwargs=True))
        except BaseException:
            for handle in handles:
                handle.remove()
            raise
        return ProbeHandle(handles)

    @property
    def pending(self) -> int:
        """Number of module calls finished and not yet collected."""
        return len(self._calls)

    def take(self) -> tuple[list[torch.Tensor], Callable[[list[float]], list[ModuleReading]]]:
        """Hand over the queued device values and a function that turns their host copies into
        readings, and start afresh: for fetching them with other values in one transfer.
        :meth:`collect` is ``take`` plus that fetch."""
        values, calls = self._values, self._calls
        self.reset()

        def readings(host: list[float]) -> list[ModuleReading]:
            return [
                ModuleReading(name, call, dtype, _combine(host, i), _combine(host, o), in_dtype)
                for name, call, dtype, i, o, in_dtype in calls
            ]

        return values, readings

    def collect(self) -> list[ModuleReading]:
        """Fetch every queued value (one transfer per device) and return the readings in the
        order the calls finished; then start afresh."""
        values, readings = self.take()
        return readings(_fetch(values))

    def reset(self) -> None:
        """Drop whatever is queued (the activations it measured were never kept)."""
        self._values, self._calls, self._open, self._counts, self._seen = [], [], {}, {}, {}


def probe_call(module: nn.Module, args: tuple, kwargs: dict) -> list[ModuleReading]:
    """Run ``module(*args, **kwargs)`` once with every module probed (``"full"``) and return the
    readings: under ``torch.no_grad()``, with the torch RNG state (CPU and the CUDA devices the
    call may draw on) saved and restored around it, so the run it is taken from does not change."""
    probe = Probe(module, "full")
    devices = cuda_devices((args, kwargs, list(module.parameters())[:1]))
    with torch.random.fork_rng(devices=devices), torch.no_grad(), probe.attach():
        module(*args, **kwargs)
    return probe.collect()


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in a module's arguments or output; plain tuples, lists and dicts take a fast
    path (this runs twice per module call), anything else goes through ``iter_tensors``."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    kind = type(obj)
    if kind is tuple or kind is list:
        return [t for item in obj for t in _tensors(item)]
    if kind is dict:
        return [t for item in obj.values() for t in _tensors(item)]
    if obj is None or kind in (int, float, bool, str):
        return []
    return [t for _, t in iter_tensors(obj)]


def _combine(host: list[float], indices: tuple[int, ...]) -> float | None:
    """One value for several tensors: NaN if any is NaN, else the largest magnitude (so a
    -inf sum still reads as non-finite)."""
    if not indices:
        return None
    if len(indices) == 1:
        return host[indices[0]]
    values = [host[i] for i in indices]
    return math.nan if any(v != v for v in values) else max(abs(v) for v in values)


def _fetch(values: list[torch.Tensor]) -> list[float]:
    """Host floats for 0-d device values: one transfer per device."""
    return [row[0] for row in to_host(values)]
