"""Which modules a probe watches: the blocks of a model (``"sentinel"``), or every module that
can make a NaN/Inf (``"full"``), and the dtypes a sentinel that looks for overflow measures.

>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.ModuleList([nn.Linear(2, 2)]))
>>> [name for name, _ in sentinel_modules(model)], [name for name, _ in all_modules(model)]
(['0', '1', '2.0'], ['', '0', '2', '2.0'])

Limits: the choice is by structure and type only; a custom activation that cannot make a NaN/Inf
is still watched by a full probe (only the torch ones in :data:`PASS_THROUGH` are skipped).
"""

from __future__ import annotations

import torch
from torch import nn

GRANULARITIES = ("sentinel", "full")
#: The dtypes whose largest finite value an activation can reach (fp16's is 65504; bf16's is as
#: large as float32's): what a sentinel watches by default.
OVERFLOW_DTYPES: tuple[torch.dtype, ...] = (torch.float16,) + tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)


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


#: The :data:`PASS_THROUGH` modules whose output is also non-finite whenever their input is (a
#: NaN stays NaN, and an Inf stays infinite or becomes NaN): a full probe reads their output as it
#: read their input.
KEEPS_NONFINITE: tuple[type[nn.Module], ...] = (
    nn.Identity,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.LeakyReLU,
    nn.SiLU,
    nn.GELU,
    nn.Mish,
    nn.Hardswish,
    nn.Flatten,
    nn.Unflatten,
)

# Modules that cannot turn finite inputs into NaN/Inf (elementwise activations that never
# exceed their input's magnitude by much, dropout, reshapes): a full probe could never name one
# as the producer, so it skips them.  They are a fifth of a UNet's module calls.  Those beyond
# KEEPS_NONFINITE turn an Inf into a finite value.
PASS_THROUGH: tuple[type[nn.Module], ...] = KEEPS_NONFINITE + (nn.ReLU, nn.ReLU6, nn.Tanh, nn.Sigmoid, nn.Hardsigmoid)


def all_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module of ``model``, the model itself included (as ``""``), except the
    :data:`PASS_THROUGH` ones."""
    return [
        (name, m)
        for name, m in model.named_modules(remove_duplicate=False)
        if name == "" or not isinstance(m, PASS_THROUGH)
    ]


def probed_modules(model: nn.Module, granularity: str) -> list[tuple[str, nn.Module]]:
    """The ``(name, module)`` pairs a probe of ``granularity`` watches in ``model``."""
    if granularity == "sentinel":  # a block that cannot make NaN/Inf (SiLU, ...) is not watched
        return [(n, m) for n, m in sentinel_modules(model) if not isinstance(m, PASS_THROUGH)]
    return all_modules(model)


def pass_through_children(watched: list[tuple[str, nn.Module]]) -> list[nn.Module]:
    """The :data:`KEEPS_NONFINITE` modules under the ``watched`` ones and not watched themselves
    (each is the child of a watched module: a full probe watches every other module, ``unread``
    ones aside, whose children stay out)."""
    found: dict[int, nn.Module] = {}
    ids = {id(module) for _, module in watched}
    for _, module in watched:
        for child in module._modules.values():
            if isinstance(child, KEEPS_NONFINITE) and id(child) not in ids:
                found[id(child)] = child
    return list(found.values())


def entry_modules(model: nn.Module) -> list[nn.Module]:
    """The model and the modules it calls directly: its children, those of a ``ModuleList`` or
    ``ModuleDict`` child (containers are never called themselves). The VAE's ``decode`` calls
    ``post_quant_conv`` and ``decoder``, never the VAE."""
    found, stack = [model], list(model.children())
    while stack:
        module = stack.pop(0)
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            stack[:0] = list(module.children())
        elif all(module is not m for m in found):
            found.append(module)
    return found
