"""The run's record (layer 3): anomalies and their kinds, strict JSON, the run directory.

Rooms: ``anomaly`` (Anomaly, the one kind registry and its factory), ``kinds`` (the built-in
kinds), their message builders: ``inference_messages`` (the advice it ends with by dtype: ``advice``),
``training_messages`` and ``messages`` (what both share: the phrase naming a cause, the debugger's own kinds),
``jsonio`` (strict JSON files),
``run_record`` (the live, bounded record of a run), ``run_dir`` (naming, creating and loading a
run directory), ``run_claim`` (a live run's hold on its directory).
"""

from .anomaly import (
    KINDS,
    Anomaly,
    AnomalyKind,
    by_cause,
    cause_key,
    cause_reference,
    consequences,
    default_key,
    diagnosis_severity,
    distinct_details,
    folded,
    followed_key,
    follows_key,
    headline,
    is_cause,
    kind_info,
    make_anomaly,
    rebuilt,
    register_kind,
    severity_rank,
)
from .jsonio import dumps, load_json, loads, read_jsonl, to_jsonable, write_atomic
from .kinds import STABLE_KINDS
from .run_dir import RunData, load_run, new_run_name, prepare_run_dir
from .run_record import RunRecord, versions

__all__ = [
    "KINDS",
    "STABLE_KINDS",
    "Anomaly",
    "AnomalyKind",
    "by_cause",
    "cause_key",
    "cause_reference",
    "consequences",
    "RunData",
    "RunRecord",
    "dumps",
    "default_key",
    "diagnosis_severity",
    "distinct_details",
    "folded",
    "followed_key",
    "follows_key",
    "headline",
    "is_cause",
    "kind_info",
    "make_anomaly",
    "rebuilt",
    "load_json",
    "load_run",
    "loads",
    "new_run_name",
    "prepare_run_dir",
    "read_jsonl",
    "register_kind",
    "severity_rank",
    "to_jsonable",
    "versions",
    "write_atomic",
]
