"""Abs-maxes taken together: a probe holds the tensors it is to reduce (a sentinel's block outputs,
a full probe's module inputs and outputs) and reduces them all with
one ``torch._foreach_norm(..., inf)`` (on a CPU: ``_foreach_max`` of ``_foreach_abs``), instead of
one ``linalg_vector_norm`` per tensor.

On a GPU at real size a watched step is launch-bound: what a sentinel costs is the ops it adds, one
per block output (37 a step at SD1.5 topology in fp16), not the bytes they read. The fused norm is
one op for a call's block outputs of one dtype on one device (CUDA's multi-tensor kernel); on a
CPU it loops inside the op.

>>> import math, torch
>>> values = [None, None]
>>> held = HeldAbsmax()
>>> held.add(torch.tensor([1.0, -3.0], dtype=torch.float16), 0, values)
>>> held.add(torch.tensor([float("inf")], dtype=torch.float16), 1, values)
>>> held.flush(values)
>>> [v.item() for v in values]
[3.0, inf]

Limits: the outputs are held until :meth:`HeldAbsmax.flush` (the probe's ``take``, or once they
pass :data:`HELD_BYTES`), so the peak memory of the watched call grows by at most that much. An
output changed in place after its module returned (its version counter moved) is not read (its
value reads 0: no evidence either way, rather than the later value charged to the module); an
inference tensor has no version counter, and is read as it is at the flush. Tensors of several
dtypes or devices go through one call, which CUDA then splits into one kernel each.
"""

from __future__ import annotations

import math

import torch

HELD_BYTES = 128 * 2**20
"""The held outputs are reduced once they reach this many bytes (SD1.5's UNet at 512x512 with
CFG: about 55 MB a call in fp16, one flush; its VAE decoder's up blocks: three). A full probe holds
every module's output and input until then: a flush per 25 or so of the UNet's 5 MB activations,
per one or two of the VAE decoder's 64 MB ones, so the peak memory of a watched call grows by at
most this much whatever the model's size."""

FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The dtypes ``_foreach_norm`` reduces as they are (fp8 has no reduction kernels)."""


_FOREACH_MAX = hasattr(torch, "_foreach_max")  # torch >= 2.6


def _absmaxes(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's abs-max (0-d, its dtype, NaN before Inf as the norm gives it). On a GPU one
    ``_foreach_norm(inf)`` kernel; on a CPU ``_foreach_max(_foreach_abs(...))``, the same values
    (NaN and Inf included) in a ninth of the time (0.09 against 0.86 ms for tiny SD's 30 fp16
    block outputs: the CPU norm loops per element in float), for one op more a flush. An empty
    tensor has neither (both raise)."""
    if _FOREACH_MAX:
        cpu = True
        for tensor in tensors:  # a loop, not a generator: no Python frame per tensor
            if tensor.device.type != "cpu":
                cpu = False
                break
        if cpu:
            return torch._foreach_max(torch._foreach_abs(tensors))
    return torch._foreach_norm(tensors, math.inf)


class HeldAbsmax:
    """The outputs a probe is to read, held until one fused reduction writes each one's abs-max
    (a 0-d tensor in its dtype, NaN-propagating, as :func:`stats.absmax`) into its slot.

    A held tensor is alive, so its ``id`` names it until the flush: :meth:`slot_of` finds a tensor
    measured again (the next module's input) by that id and its version counter, with no weak
    reference nor key tuple per tensor. What a probe keeps per tensor until its ``take`` are new
    objects the garbage collector tracks: at thousands a call (full probes) they made it run a
    hundred young collections a call, and now and then a full one (300 ms on the SD1.5-shaped
    proxy, whose process holds 420,000 objects)."""

    def __init__(self, limit_bytes: int = HELD_BYTES):
        self.limit = limit_bytes
        self.tensors: list[torch.Tensor] = []
        self.slots: list[int] = []
        self.versions: list[int | None] = []
        self.positions: dict[int, int] = {}
        """The id of each tensor held as it was passed (not an inference tensor) -> its position in
        the lists above (:meth:`slot_of`, which a probe's hot path spells out: no Python call a tensor)."""
        self._bytes = 0

    def __len__(self) -> int:
        return len(self.tensors)

    def add(self, tensor: torch.Tensor, slot: int, values: list) -> None:
        """Hold ``tensor``, whose abs-max goes into ``values[slot]`` at the flush."""
        x = tensor.detach() if tensor.requires_grad else tensor  # no graph for the reduction
        version = None if x.is_inference() else x._version
        if x is tensor and version is not None:  # (a detached alias is another object: not found again)
            self.positions[id(x)] = len(self.tensors)
        self.tensors.append(x)
        self.slots.append(slot)
        self.versions.append(version)
        self._bytes += x.numel() * x.element_size()
        if self._bytes >= self.limit:
            self.flush(values)

    def slot_of(self, tensor: torch.Tensor) -> int | None:
        """The slot of ``tensor`` when it is held unchanged (same version counter), else None (also
        for an inference tensor: no version counter, read each time)."""
        position = self.positions.get(id(tensor))
        if position is None or self.tensors[position] is not tensor or self.versions[position] != tensor._version:
            return None
        return self.slots[position]

    def flush(self, values: list) -> None:
        """Reduce everything held, in one op, into ``values``; hold nothing after."""
        if not self.tensors:
            return
        tensors, slots, versions = self.tensors, self.slots, self.versions
        self.clear()
        norms = list(_absmaxes(tensors))
        # what changed in place since its module returned, found by comparing lists (the loop below
        # runs only then; an inference tensor has no version counter: None, as held)
        if [None if v is None else t._version for t, v in zip(tensors, versions)] != versions:
            for i, (tensor, version) in enumerate(zip(tensors, versions)):
                if version is not None and tensor._version != version:  # another's value: no reading
                    norms[i] = torch.zeros((), dtype=tensor.dtype, device=tensor.device)
        for slot, norm in zip(slots, norms):
            values[slot] = norm

    def clear(self) -> None:
        """Drop what is held, unread."""
        self.tensors, self.slots, self.versions, self.positions, self._bytes = [], [], [], {}, 0
