"""What a probe brings to the host for one call of one watched module: :class:`ModuleReading`, a
named tuple (a full probe makes hundreds a UNet call, at a third of a frozen dataclass's cost), and
what its values say (finite, abs-max, share of the dtype's largest value)."""

from __future__ import annotations

from typing import Iterable, NamedTuple

import torch

from ..stats import dtype_max, is_low_precision


class ModuleReading(NamedTuple):
    """One call of one watched module, as :meth:`~.readings.Probe.collect` brings it to the host."""

    module: str
    """Qualified name inside the probed model (``""`` for the model itself)."""
    call: int
    """Calls of this module before this one since the last ``collect`` (0 for the first)."""
    dtype: str | None
    """dtype of the first output tensor (of the autocast region it was read in, for a float32 one a
    probe read against it: :attr:`~.readings.ProbeConfig.autocast`)."""
    input_value: float | None
    """:func:`stats.finite_signal` over the floating tensors passed in (a SiLU's output: its input's,
    see :meth:`~.readings.Probe._pass_on`): non-finite exactly when one of them was (``None``: none measured)."""
    output_value: float | None
    input_dtype: str | None = None
    """dtype of the first floating input tensor."""
    signal: str = "finite"
    """What the values are (:data:`~.readings.SIGNALS`): with ``"absmax"`` they are abs-maxes in every dtype."""

    @property
    def input_finite(self) -> bool:
        return _finite(self.input_value)

    @property
    def output_finite(self) -> bool:
        return _finite(self.output_value)

    @property
    def output_absmax(self) -> float | None:
        """The output's abs-max, known for fp16/bf16/fp8 outputs and for every dtype with
        ``signal="absmax"`` (``None`` otherwise)."""
        return self.output_value if self._absmax(self.dtype) else None

    @property
    def input_absmax(self) -> float | None:
        """The inputs' abs-max, known when they are fp16/bf16/fp8, or with ``signal="absmax"``
        (``None`` otherwise)."""
        return self.input_value if self._absmax(self.input_dtype) else None

    @property
    def dtype_max_fraction(self) -> float | None:
        """Output abs-max as a share of the output dtype's largest finite value."""
        value = self.output_absmax
        if value is None or not self.output_finite:
            return None
        return value / dtype_max(getattr(torch, self.dtype))

    @property
    def input_dtype_max_fraction(self) -> float | None:
        """Input abs-max as a share of the output dtype's largest finite value (``None`` when the
        input abs-max is not known; non-finite when the inputs were)."""
        value = self.input_absmax
        return None if value is None or self.dtype is None else value / dtype_max(getattr(torch, self.dtype))

    def _absmax(self, dtype: str | None) -> bool:
        return dtype is not None and (self.signal == "absmax" or is_low_precision(getattr(torch, dtype)))


def find_producer(readings: Iterable[ModuleReading]) -> ModuleReading | None:
    """The first reading whose output is non-finite while its inputs were finite: the module that made
    a NaN/Inf (in execution order, as a probe collects its readings)."""
    for reading in readings:
        if not reading.output_finite and reading.input_finite:
            return reading
    return None


def _finite(value: float | None) -> bool:
    return value is None or (value == value and abs(value) != float("inf"))
