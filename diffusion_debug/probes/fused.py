"""Abs-maxes taken together: a probe holds the tensors it is to reduce (a sentinel's block outputs,
a full probe's module inputs and outputs) and reduces them all with
one ``torch._foreach_norm(..., inf)`` (on a CPU: ``_foreach_max`` of ``_foreach_abs``), instead of
one ``linalg_vector_norm`` per tensor.

On a GPU at real size a watched step is launch-bound: what a sentinel costs is the ops it adds, one
per block output (37 a step at SD1.5 topology in fp16), not the bytes they read. The fused norm is
one op for a call's block outputs of one dtype on one device (CUDA's multi-tensor kernel); on a
CPU it loops inside the op.

>>> import math, torch
>>> held = HeldAbsmax()
>>> held.add(torch.tensor([1.0, -3.0], dtype=torch.float16))
0
>>> held.add(torch.tensor([float("inf")], dtype=torch.float16))
1
>>> held.take()
[tensor([3., inf], dtype=torch.float16)]

A flush stacks its abs-maxes into one 1-d tensor (the ``stack`` a host copy of them made before):
the probe keeps one object a flush, not one a tensor. Abs-maxes of several dtypes (a float32 stream
read with float16 projections under float16 autocast) are stacked outside autocast, which would
cast each one of the narrower dtype first (an op each): the stack promotes them itself, exactly. So
are those of one half dtype under the other's autocast (float16 under bfloat16), where autocast's
stack raises.

>>> with torch.autocast("cpu", dtype=torch.float16):
...     held.add(torch.tensor([2.0], dtype=torch.float16)), held.add(torch.tensor([-5.0]))
...     held.take()
(0, 1)
[tensor([2., 5.])]

Limits: the outputs are held until :meth:`HeldAbsmax.flush` (the probe's ``take``, or once they
pass :data:`HELD_BYTES` or number :data:`HELD_TENSORS`), so the peak memory of the watched call grows
by at most that much. An
output changed in place after its module returned (its version counter moved) is not read (its
value reads 0: no evidence either way, rather than the later value charged to the module); an
inference tensor has no version counter, and is read as it is at the flush. Tensors of several
dtypes or devices go through one call, which CUDA then splits into one kernel each.
"""

from __future__ import annotations

import math
from operator import attrgetter

import torch

from ..stats import ANY_AUTOCAST, autocast_off

HELD_BYTES = 128 * 2**20
"""The held outputs are reduced once they reach this many bytes (SD1.5's UNet at 512x512 with
CFG: about 55 MB a call in fp16, under it: its flushes come from :data:`HELD_TENSORS`; its VAE
decoder's up blocks: three). A full probe holds
every module's output and input until then: a flush per 25 or so of the UNet's 5 MB activations,
per one or two of the VAE decoder's 64 MB ones, so the peak memory of a watched call grows by at
most this much whatever the model's size."""

HELD_TENSORS = 256
"""The held outputs are reduced once they are this many too (a full probe: about 3 flushes an SD1.5
UNet call), for the garbage collector: a flush makes two tensor objects a tensor held (the abs and
the abs-max; the two lists of a CPU's ``_foreach_abs`` and ``_foreach_max``), and a held output
outlives the model's use of it, so a hundred young collections ran a call and the middle-generation
ones moved the held outputs and abs-maxes they found on to the oldest generation, whose full
collection (300 ms at 420,000 objects on the SD1.5-shaped proxy) then came every five calls. At
256, a flush makes fewer objects (512) than a young collection waits for (CPython's 700), and a
collection finds at most 256 held; a flush more a call is one ``_foreach_norm`` and one ``stack``
more on a GPU (three ops on a CPU)."""

FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The dtypes ``_foreach_norm`` reduces as they are (fp8 has no reduction kernels)."""


_FOREACH_MAX = hasattr(torch, "_foreach_max")  # torch >= 2.6
_VERSION = attrgetter("_version")


def _absmaxes(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], bool]:
    """Each tensor's abs-max (0-d, its dtype, NaN before Inf as the norm gives it), and whether the
    tensors are all on one device. On a GPU one ``_foreach_norm(inf)`` kernel; on a CPU
    ``_foreach_max(_foreach_abs(...))``, the same values (NaN and Inf included) in a ninth of the
    time (0.09 against 0.86 ms for tiny SD's 30 fp16 block outputs: the CPU norm loops per element
    in float), for one op more a flush. An empty tensor has neither (both raise)."""
    device, one = tensors[0].device, True
    for tensor in tensors:  # a loop, not a generator: no Python frame per tensor
        if tensor.device != device:
            one = False
            break
    if _FOREACH_MAX and one and device.type == "cpu":
        return torch._foreach_max(torch._foreach_abs(tensors)), one
    return torch._foreach_norm(tensors, math.inf), one


class HeldAbsmax:
    """The outputs a probe is to read, held until one fused reduction takes each one's abs-max
    (in its dtype, NaN-propagating, as :func:`stats.absmax`). Each held tensor has a slot, numbered
    from 0 in the order held since :meth:`take`; each flush stacks its abs-maxes into one 1-d tensor
    (:attr:`flushed`), so that the flushed tensors, joined in order, hold slot ``i``'s value at
    position ``i``.

    A held tensor is alive, so its ``id`` names it until the flush: :meth:`slot_of` finds a tensor
    measured again (the next module's input) by that id and its version counter, with no weak
    reference nor key tuple per tensor. What a probe keeps per tensor until its ``take`` are new
    objects the garbage collector tracks: at thousands a call (full probes) they made it run a
    hundred young collections a call, and a full one every five calls or so (300 ms on the
    SD1.5-shaped proxy, whose process holds 420,000 objects: a full collection comes once the
    objects that outlived a middle-generation collection reach a quarter of those). So a flush
    keeps one tensor, not an abs-max tensor per slot; the hot paths of :class:`~.readings.Probe`
    spell :meth:`add` out (no Python call per tensor)."""

    def __init__(self, limit_bytes: int = HELD_BYTES, limit_tensors: int | None = None):
        self.limit = limit_bytes
        self.most = HELD_TENSORS if limit_tensors is None else limit_tensors
        self.tensors: list[torch.Tensor] = []
        self.versions: list[int | None] = []
        self.positions: dict[int, int] = {}
        """The id of each tensor held as it was passed (not an inference tensor) -> its position in
        the lists above (:meth:`slot_of`, which a probe's hot path spells out: no Python call a tensor)."""
        self.base = 0
        """The slot of ``tensors[0]``: the slots before it were flushed."""
        self.flushed: list[torch.Tensor] = []
        """One 1-d tensor a flush: the abs-maxes of its slots, in order."""
        self.size = 0
        """Bytes held."""
        self.inference = False
        """Whether an inference tensor (no version counter) is held: :meth:`flush` then compares
        versions one by one."""

    def __len__(self) -> int:
        return len(self.tensors)

    def add(self, tensor: torch.Tensor) -> int:
        """Hold ``tensor``; return its slot."""
        x = tensor.detach() if tensor.requires_grad else tensor  # no graph for the reduction
        version = None if x.is_inference() else x._version
        if version is None:
            self.inference = True
        position = len(self.tensors)
        if x is tensor and version is not None:  # (a detached alias is another object: not found again)
            self.positions[id(x)] = position
        self.tensors.append(x)
        self.versions.append(version)
        self.size += x.numel() * x.element_size()
        slot = self.base + position
        if self.size >= self.limit or position + 1 >= self.most:
            self.flush()
        return slot

    def slot_of(self, tensor: torch.Tensor) -> int | None:
        """The slot of ``tensor`` when it is held unchanged (same version counter), else None (also
        for an inference tensor: no version counter, read each time)."""
        position = self.positions.get(id(tensor))
        if position is None or self.tensors[position] is not tensor or self.versions[position] != tensor._version:
            return None
        return self.base + position

    def flush(self) -> None:
        """Reduce everything held, in one op (two on a CPU), and stack the abs-maxes into one 1-d
        tensor (a view for one; a stack of several dtypes promotes, exactly, outside autocast: under
        it, a cast of each one of the narrower dtype first; tensors of several devices stay 0-d, one
        value each); hold nothing after."""
        tensors, versions = self.tensors, self.versions
        if not tensors:
            return
        self.base += len(tensors)
        inference = self.inference
        self.tensors, self.versions, self.positions, self.size, self.inference = [], [], {}, 0, False
        norms, one_device = _absmaxes(tensors)
        # what changed in place since its module returned, found by comparing lists (the loop below
        # runs only then; an inference tensor has no version counter: None, as held), without a
        # Python call a tensor when none is an inference tensor (nearly always)
        if inference:
            now = [None if v is None else t._version for t, v in zip(tensors, versions)]
        else:
            now = list(map(_VERSION, tensors))
        if now != versions:
            norms = list(norms)
            for i, (tensor, version) in enumerate(zip(tensors, versions)):
                if version is not None and tensor._version != version:  # another's value: no reading
                    norms[i] = torch.zeros((), dtype=tensor.dtype, device=tensor.device)
        if not one_device:
            self.flushed.extend(norms)
        elif len(norms) == 1:
            self.flushed.append(norms[0].reshape(1))
        elif not ANY_AUTOCAST():
            self.flushed.append(torch.stack(norms))
        else:  # autocast's stack casts each tensor not of the widest dtype (4 a call of a float32 CLIP) and raises
            # on a half dtype not its own (float16 abs-maxes under bfloat16 autocast, one dtype or several): none here
            with autocast_off(norms[0].device.type):
                self.flushed.append(torch.stack(norms))

    def take(self) -> list[torch.Tensor]:
        """Flush, hand over the flushed tensors (slot ``i``'s value at position ``i`` of them
        joined) and start afresh at slot 0."""
        if self.tensors:
            self.flush()  # (which leaves nothing held)
        flushed, self.flushed, self.base = self.flushed, [], 0
        return flushed

    def clear(self) -> None:
        """Drop what is held or flushed, unread."""
        self.tensors, self.versions, self.positions, self.size, self.base, self.flushed = [], [], {}, 0, 0, []
        self.inference = False
