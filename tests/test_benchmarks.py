"""The benchmarks run (smoke mode: seconds, tiny models) and write well-formed results.
Their timings are never asserted: speed is measured by `make bench`, not by tests."""

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import run  # noqa: E402


def test_smoke_run_writes_every_section(tmp_path):
    out = tmp_path / "RESULTS.md"
    assert run.main(["--smoke", "--out", str(out)]) == 0
    text = out.read_text()
    for title in (
        "Probes alone",
        "Inference overhead",
        "Training overhead",
        "Device-to-host transfers",
        "Localisation cost",
        "Memory",
        "Aten ops added per step",
        "GPU (real size)",
    ):
        assert f"## {title}" in text
    for case in (
        "plain",
        "debugger default (sentinel)",
        "debugger, full probes",
        "transformers DebugUnderflowOverflow",
        "TrainingDebugger default",
        "torch.autograd.detect_anomaly",
    ):
        assert re.search(rf"\| {re.escape(case)} \| \d+\.\d{{4}} \| \d+\.\d{{3}}x \|", text), case
    assert '"correct": true' in text  # the localisation benchmark named the planted module
    assert "- machine: " in text and "- command: `python -m benchmarks.run --smoke`" in text
