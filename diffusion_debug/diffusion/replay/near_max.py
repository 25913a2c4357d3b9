"""Whose near-max values a NaN/Inf was made from: the module that made the values another module overflowed
on (:func:`near_max_maker`), the cause a diagnosis names (:func:`near_max_source`), read from a call's or a
replay's readings."""

from __future__ import annotations

import math

from ...probes import ModuleReading

_SAME_VALUES = 2.0**-7
"""Abs-maxes this close (relative) are taken for the same values: bf16's rounding step, which a cast or a
small residual added to near-max values does not move past."""


def near_max_maker(readings: list[ModuleReading], producer: ModuleReading, fraction: float) -> ModuleReading | None:
    """The module that made the values ``producer`` overflowed on: where ``producer`` (a reading of
    ``readings`` whose output is non-finite from finite inputs) was given values at ``fraction`` of its
    dtype's max or beyond (a bf16 GroupNorm's variance overflows there, where fp16's upcasts), followed
    back by value: the latest module before it whose output was what it was given (their abs-max, to
    bf16's rounding), through modules given them too, into the innermost one that made them (near its
    own dtype's max) from inputs below ``fraction``. Readings hold no tensor identity, so the values,
    never the order, say which module fed it: an earlier near-max module whose values went elsewhere is
    not named. None where its inputs were below (it made the NaN/Inf itself: a NaN weight), not known,
    or no module before it is seen making them (the call's arguments brought them, or code between
    modules changed them). Read on a NaN/Inf only.

    >>> conv = ModuleReading("up.0.conv2", 0, "bfloat16", 2.0, 3.05e38, "bfloat16")
    >>> norm = ModuleReading("up.1.norm1", 0, "bfloat16", 3.05e38, float("nan"), "bfloat16")
    >>> near_max_maker([conv, norm], norm, 0.5).module
    'up.0.conv2'
    >>> near_max_maker([conv, norm._replace(input_value=3.0)], norm._replace(input_value=3.0), 0.5) is None
    True
    """
    share, wanted = producer.input_dtype_max_fraction, producer.input_absmax
    if share is None or wanted is None or not share >= fraction or math.isinf(share):  # (NaN: not >=)
        return None
    before = readings[: next((i for i, r in enumerate(readings) if r is producer), len(readings))]
    maker = None  # the innermost module seen making them; what ran inside it comes before it
    for reading in reversed(before):
        if maker is not None and reading.module == maker.module:
            break  # an earlier call of it: what came before that is not inside this one
        if maker is not None and maker.module and not reading.module.startswith(maker.module + "."):
            continue
        made = reading.output_absmax
        if made is None or not reading.output_finite or not math.isclose(made, wanted, rel_tol=_SAME_VALUES):
            continue
        given = reading.input_dtype_max_fraction
        if given is not None and math.isfinite(given) and given >= fraction:
            wanted = reading.input_absmax  # passed on: who gave it them
        elif (reading.dtype_max_fraction or 0.0) >= fraction:
            maker = reading
        else:
            break  # near the max only once cast to a narrower dtype: not made near its own
    return maker


def near_max_source(
    readings: list[ModuleReading], producer: ModuleReading, fraction: float
) -> tuple[ModuleReading, ModuleReading] | None:
    """``(the module that made the near-max values producer overflowed on, producer)``, or None
    (:func:`near_max_maker`)."""
    maker = near_max_maker(readings, producer, fraction)
    return None if maker is None else (maker, producer)
