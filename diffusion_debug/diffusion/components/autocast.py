"""The ``torch.autocast`` a pipeline run computes under: read once as each run begins (:func:`autocast_state`),
answered per component by the device type it computes on (:func:`autocast_dtype`, :func:`execution_device_type`),
and entered again around a replay of a kept call (:func:`autocast_as`), which would otherwise run in the weights'
dtype: a float32 component's float16 overflow under autocast did not reproduce.

Limits: an autocast region entered inside the pipeline's own code (around one component's call) is not the
run's; a component whose device is not known as the run begins (an offload hook moves it at its call, meta
weights) is answered as under any autocast open (:data:`UNKNOWN_DEVICE`)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from ...stats import ANY_AUTOCAST  # noqa: F401 (re-exported: asked as each run begins)

AutocastState = tuple[tuple[str, torch.dtype], ...]
"""Each device type whose autocast region is open, with the dtype it computes in: ``(("cuda", torch.float16),)``;
``()`` when none is."""

DEVICE_TYPES = ("cuda", "cpu", "xpu", "mps")
"""The device types whose autocast state is read."""

UNKNOWN_DEVICE = "?"
"""The device type of a component whose device is not known as the run begins: any open autocast is its."""


def _enabled(device: str) -> bool:
    """``torch.is_autocast_enabled(device)`` (a device type since torch 2.4; the floor, 2.5.1, takes one); a torch
    that takes none is asked the old way (no argument: CUDA's; the CPU's its own function)."""
    try:
        return torch.is_autocast_enabled(device)
    except TypeError:
        if device == "cpu":
            return torch.is_autocast_cpu_enabled()
        return device == "cuda" and torch.is_autocast_enabled()


def _dtype(device: str) -> torch.dtype:
    try:
        return torch.get_autocast_dtype(device)
    except (AttributeError, TypeError):  # (before torch 2.4)
        return torch.get_autocast_cpu_dtype() if device == "cpu" else torch.get_autocast_gpu_dtype()


def autocast_state() -> AutocastState:
    """The autocast regions open now (:data:`AutocastState`), ``()`` without a Python loop where none is.

    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     autocast_state()
    (('cpu', torch.bfloat16),)
    >>> autocast_state()
    ()
    """
    if not ANY_AUTOCAST():
        return ()
    state = []
    for device in DEVICE_TYPES:
        try:
            if _enabled(device):
                state.append((device, _dtype(device)))
        except (RuntimeError, ValueError, TypeError):  # a device type this build does not know
            continue
    return tuple(state)


def autocast_dtype(state: AutocastState, device_type: str | None = UNKNOWN_DEVICE) -> torch.dtype | None:
    """The dtype a component on ``device_type`` computes its autocast ops in under ``state`` (None: no autocast
    for it); an unknown device (:data:`UNKNOWN_DEVICE`): the first open region's, as if on its device.

    >>> state = (("cuda", torch.float16),)
    >>> autocast_dtype(state, "cpu"), autocast_dtype(state, "cuda"), autocast_dtype(state)
    (None, torch.float16, torch.float16)
    """
    for device, dtype in state:
        if device == device_type or device_type == UNKNOWN_DEVICE:
            return dtype
    return None


def autocast_on(dtype: str | None) -> bool:
    """Whether an autocast region that computes in ``dtype`` (a name: ``"float16"``) is open now, on any device
    type (read as a warning is made, during the pipeline's call: inside the user's ``with torch.autocast(...)``);
    bfloat16 autocast makes no float16 value.

    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     autocast_on("float16"), autocast_on("bfloat16")
    (False, True)
    """
    return any(str(computed).removeprefix("torch.") == dtype for _, computed in autocast_state())


def execution_device_type(module: nn.Module) -> str:
    """The device type ``module`` computes on: an accelerate offload hook's execution device (the weights wait on
    the CPU until the call), else its first parameter's; :data:`UNKNOWN_DEVICE` for meta weights, none, or
    diffusers' group offloading (it moves them at the call)."""
    hook = module.__dict__.get("_hf_hook")
    if hook is not None:
        device = getattr(hook, "execution_device", None)
        if device is None:
            return UNKNOWN_DEVICE
        return "cuda" if isinstance(device, int) else torch.device(device).type
    registry = module.__dict__.get("_diffusers_hook")
    if registry is not None and any("offload" in str(name) for name in getattr(registry, "hooks", {})):
        return UNKNOWN_DEVICE
    parameter = next(module.parameters(), None)
    if parameter is None or parameter.device.type == "meta":
        return UNKNOWN_DEVICE
    return parameter.device.type


@contextlib.contextmanager
def autocast_as(state: tuple[tuple[str, torch.dtype | None], ...], *, outside: bool = False) -> Iterator[None]:
    """Within the block, the autocast regions of ``state`` open again (a replay of a call made under them), a
    device type given dtype None closed (a replay outside the call's autocast); none entered for ``()``: the
    replay runs as the caller's code does, but for ``outside`` (a replay after the run, of a call made outside
    autocast: ``why()``, a bundle's), which closes every region the caller has open. The regions neither read nor
    write the caller's cache of cast weights (keyed by the weight alone: a cast of the user's dtype raised in a
    replay of another, and the replay's cast raised in the user's next call), and leave it as it was where its
    autocast is on (with no region of its own too: one nesting count more, else their exit at count 0 cleared it).

    >>> with autocast_as((("cpu", torch.float16),)):
    ...     torch.nn.Linear(2, 2)(torch.ones(2)).dtype
    torch.float16
    """
    caller = ANY_AUTOCAST()
    if outside and not state:
        state = tuple((device, None) for device, _ in autocast_state())
    with contextlib.ExitStack() as stack:
        if caller and state:
            # one count more: the regions left at count 0 (an autocast turned on with no region, by
            # ``set_autocast_enabled``) cleared its cache, and the caller's next call cast each weight again
            torch.autocast_increment_nesting()
            stack.callback(torch.autocast_decrement_nesting)
        for device, dtype in state:
            if dtype is None:
                stack.enter_context(torch.autocast(device, enabled=False))
            else:
                stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=False))
        yield


AUTOCAST_DTYPES = ("float16", "bfloat16", "float32")
"""The dtypes a saved autocast state may name (a bundle's ``meta.json``; a crafted file is data)."""


def state_fields(state: AutocastState) -> list[list[str]]:
    """``state`` as JSON fields, ``[["cuda", "float16"]]`` (a repro bundle's ``meta.json``)."""
    return [[device, str(dtype).removeprefix("torch.")] for device, dtype in state]


def state_from_fields(fields: object) -> AutocastState | None:
    """The state :func:`state_fields` wrote; None where ``fields`` is not one (a device type or dtype not read
    here, another layout). Absent (a bundle saved before it was kept): ``()``.

    >>> state_from_fields([["cuda", "float16"]]), state_from_fields(None), state_from_fields([["cuda", "int8"]])
    ((('cuda', torch.float16),), (), None)
    """
    if fields is None:
        return ()
    if not isinstance(fields, list):
        return None
    state = []
    for entry in fields:
        if not isinstance(entry, list) or len(entry) != 2:
            return None
        device, dtype = entry
        if device not in DEVICE_TYPES or dtype not in AUTOCAST_DTYPES:
            return None
        state.append((device, getattr(torch, dtype)))
    return tuple(state)
