"""Whether the ranks' replicas still agree: every ``rank_check_every`` steps each rank's row
carries the sum of its parameter checksums (``measure.step_row``); a rank whose sum differs from the
first rank that measured the step is a ``rank_desync``, named by its first differing parameter
(from every rank's per-parameter checksums, gathered only on such a step: ``exchange``).
Pure, like ``checks``: rows in, anomalies out.
"""

from __future__ import annotations

import math
from typing import Any

from ...record import Anomaly, make_anomaly
from ..measure.gradients import TrainableParameters
from ..measure.step_row import StepRow


def reference_rank(rows: list[StepRow]) -> int:
    """The first rank that measured the step."""
    return next((r for r, row in enumerate(rows) if row.measured), 0)


def differing_checksums(rows: list[StepRow]) -> list[int]:
    """Ranks whose parameter checksum differs from the first rank that measured the step."""
    reference = rows[reference_rank(rows)].checksum
    return [r for r, row in enumerate(rows) if row.measured and not _same(row.checksum, reference)]


def judge_checksums(
    rows: list[StepRow], differing: list[int], per_param: list[list[float]], step: Any, params: TrainableParameters
) -> list[Anomaly]:
    """``rank_desync`` for each differing rank, naming its first parameter that differs."""
    reference = reference_rank(rows)
    out = []
    for r in differing:
        index = next((i for i, (a, b) in enumerate(zip(per_param[reference], per_param[r])) if not _same(a, b)), None)
        details = {
            "checksum": rows[r].checksum,
            "checksum_rank0": rows[reference].checksum,
            "reference_rank": reference,
            "parameter_checksum": per_param[r][index] if index is not None else None,
            "parameter_checksum_rank0": per_param[reference][index] if index is not None else None,
        }
        out.append(
            make_anomaly(
                kind="rank_desync",
                severity="error",
                component="model",
                step=step,
                rank=r,
                module=params.module_of_parameter(index) if index is not None else "",
                parameter=params.names[index] if index is not None else None,
                details=details,
            )
        )
    return out


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))
