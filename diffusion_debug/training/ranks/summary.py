"""The step's one fixed-size exchange between ranks: what each rank puts in it, and what every
rank reads back. Value types in, value types out; the collective itself is ``exchange``.

Every rank packs its own judged step into :data:`WIDTH` int64 values, whatever the world size;
one ``all_reduce(MAX)`` gives every rank the same :class:`RankSummary`:

* each flag of :data:`FLAGS` (1: some rank set it);
* per :data:`AGGREGATED` slot the largest and the smallest value, each with the rank that holds
  it. A float64 becomes an int64 in the same order (:func:`order_key`); its lowest bits are
  replaced by ``mask - rank``, so MAX picks the largest value and, among equal ones, the lowest
  rank. The smallest is the largest of the negated values. NaN counts as above every number: a
  NaN loss anywhere is the "max" and names its rank.

>>> layout = ReduceLayout(world_size=8)
>>> packs = [layout.pack({"loss": loss, "grad_norm": 1.0}, {"anomalies": rank == 5}, rank)
...          for rank, loss in enumerate([0.5, 0.25, 0.75, 0.5, 0.5, float("nan"), 0.5, 0.125])]
>>> reduced = [max(column) for column in zip(*packs)]  # what all_reduce(MAX) computes
>>> summary = layout.unpack(reduced)
>>> summary.flags["anomalies"], summary.aggregates["loss"]
(True, {'min': 0.125, 'min_rank': 7, 'max': 'nan', 'max_rank': 5})

Limits: only the extremes travel (no median: a median needs every rank's value, which only the
detail exchange carries); a value read back loses its lowest ``log2(world_size)`` mantissa bits
(relative error below ``2**-40`` up to 4,096 ranks), the rank that holds it is exact.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

AGGREGATED = ("loss", "grad_norm", "rss_mb", "cuda_allocated_mb", "local_nonfinite")
"""Row slots whose extremes (and the rank of each) every rank learns at every step; ``local_nonfinite``
(1.0: a rank's own gradients held NaN/Inf before the all-reduce): the largest names a rank that made a NaN."""
FLAGS = ("anomalies", "failed", "loss", "nonfinite_loss", "explosion", "vanishing", "nonfinite", "weights_moved")
"""``anomalies``: the rank judged anything in its own row (then every rank exchanges its details);
``failed``: it could not measure or judge; the rest are ``checks.StepFlags``, OR-ed over ranks
(``weights_moved``: some rank's weights moved in the update the step read: a stall is the whole
model's, not one rank's shards'). A rank whose one finding is its stall (``not_learning``) packs the flag
``stalled`` instead, in the ``anomalies`` slot as its lower level (:data:`_STALL_ALONE`: no slot more):
it needs the details only where the stall stands, no rank's weights having moved. Three more flags are lower
levels of a slot (:data:`LOWER`), as ``stalled`` is: ``unheld`` (``failed``'s): some rank held no verdict of a
GradScaler not passed (``step.found_scaler``), a failed one among them; ``nonfinite_held`` / ``explosion_held``:
some rank set the flag or held it (its verdict held, the flag kept out of the step's counts until released)."""
LOWER = {"anomalies": "stalled", "failed": "unheld", "nonfinite": "nonfinite_held", "explosion": "explosion_held"}
"""Per slot, the flag its lower level carries: MAX keeps the highest rank's, so the upper one (the slot's own
flag) implies the lower (``stalled`` apart: a stall alone, no rank having found anything else)."""
_STALL_ALONE, _FOUND = 1, 2
"""A slot's levels (:data:`LOWER`'s, its own flag); the ``anomalies`` slot: a stall alone, anything else."""
_ANOMALIES = 2 * len(AGGREGATED)
"""The ``anomalies`` slot (``FLAGS[0]``, after the extremes)."""
WIDTH = 2 * len(AGGREGATED) + len(FLAGS)

_SIGN_FREE = 0x7FFFFFFFFFFFFFFF
_NAN = float("nan")


def order_key(value: float) -> int:
    """An int64 in the order of the float64 ``value`` (NaN above +inf, -0.0 as 0.0).

    >>> [order_key(v) < order_key(w) for v, w in [(-2.0, -1.0), (-1e-300, 0.0), (1.0, math.inf), (math.inf, _NAN)]]
    [True, True, True, True]
    """
    if math.isnan(value):
        value = _NAN
    bits = struct.unpack("<q", struct.pack("<d", value + 0.0))[0]
    return bits ^ _SIGN_FREE if bits < 0 else bits


def from_order_key(key: int) -> float:
    """The float64 of :func:`order_key` (its inverse)."""
    bits = key ^ _SIGN_FREE if key < 0 else key
    return struct.unpack("<d", struct.pack("<q", bits))[0]


@dataclass
class RankSummary:
    """What every rank reads back from a step's exchange (the same on every rank)."""

    flags: dict[str, bool] = field(default_factory=dict)
    aggregates: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per :data:`AGGREGATED` slot: ``min``, ``min_rank``, ``max``, ``max_rank`` (non-finite
    values as the strings of strict JSON); slots no rank measured are left out."""

    @property
    def needs_detail(self) -> bool:
        """Some rank judged something or failed, or some rank's stall alone stands (no rank's weights
        moved: a stall withdrawn costs no exchange): every rank sends its details."""
        flags = self.flags
        stands = flags.get("stalled", False) and not flags.get("weights_moved", False)
        return flags.get("anomalies", False) or flags.get("failed", False) or stands


@dataclass(frozen=True)
class ReduceLayout:
    """Packing for ``world_size`` ranks: :data:`WIDTH` int64 values per rank."""

    world_size: int

    @property
    def rank_bits(self) -> int:
        return max(1, (self.world_size - 1).bit_length())

    def pack(self, values: Mapping[str, float], flags: Mapping[str, bool], rank: int) -> list[int]:
        """This rank's contribution: ``values`` by :data:`AGGREGATED` slot (missing or None: not
        measured, no extreme of this rank), ``flags`` by :data:`FLAGS` name (missing: False)."""
        mask = (1 << self.rank_bits) - 1
        tag = mask - rank
        out = []
        for name in AGGREGATED:
            value = values.get(name)  # missing: a rank that could not measure, or a step without a loss
            if value is None or (name in _NAN_IS_MISSING and math.isnan(value)):
                out += [_MISSING, _MISSING]
                continue
            value = float(value)
            out.append((order_key(value) & ~mask) | tag)  # a NaN loss or norm is the largest
            out.append(_MISSING if math.isnan(value) else (order_key(-value) & ~mask) | tag)
        for name in FLAGS:
            out.append(_FOUND if flags.get(name) else _STALL_ALONE * bool(flags.get(LOWER.get(name, ""))))
        return out

    def unpack(self, reduced: Sequence[int]) -> RankSummary:
        """Every rank's summary, from the reduced (element-wise MAX) values."""
        mask = (1 << self.rank_bits) - 1
        aggregates = {}
        for i, name in enumerate(AGGREGATED):
            high, low = reduced[2 * i], reduced[2 * i + 1]
            if high == _MISSING:
                continue
            every_nan = low == _MISSING  # no rank has a number here: the smallest is NaN too
            aggregates[name] = {
                "min": "nan" if every_nan else _json_float(-_value(low, mask)),
                "min_rank": mask - (high & mask) if every_nan else mask - (low & mask),
                "max": _json_float(_value(high, mask)),
                "max_rank": mask - (high & mask),
            }
        flags = {}
        for name, level in zip(FLAGS, reduced[_ANOMALIES:]):
            flags[name] = level >= _FOUND
            if name in LOWER:
                flags[LOWER[name]] = level == _STALL_ALONE if name == "anomalies" else level >= _STALL_ALONE
        return RankSummary(flags, aggregates)


_MISSING = -(1 << 63)
"""The smallest int64: below every key, so any rank's value wins the MAX."""
_NAN_IS_MISSING = ("rss_mb", "cuda_allocated_mb", "local_nonfinite")
"""Slots where NaN means "not sampled" (memory tracking off, no GPU, no pre-reduction check), not a value."""


def _value(key: int, mask: int) -> float:
    """The float of a packed key, its rank bits set back as zero mantissa bits."""
    return from_order_key(key | mask if key < 0 else key & ~mask)


def _json_float(value: float) -> float | str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value
