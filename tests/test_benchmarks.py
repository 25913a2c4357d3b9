"""The benchmarks run (smoke mode: seconds, tiny models) and write well-formed results.
Their timings are never asserted: speed is measured by `make bench`, not by tests."""

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import harness, run  # noqa: E402


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
        "Fixed cost of a watched call",
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
    for call in ("output_type='latent'", "output_type='pil'"):
        assert re.search(rf"\| 1-step tiny SD call, {call} \| \d+\.\d \| -?\d+\.\d \| \d+\.\d{{3}}x \|", text), call
    assert "reused debugger adds <= 5 ms to a 1-step tiny SD call: " in text
    assert "budgets are checked against the paired ratio" in text
    assert f"- machine: {harness.cpu_model()}, " in text
    assert "- machine: " in text and "- command: `python -m benchmarks.run --smoke`" in text


def test_the_paired_ratio_is_the_median_of_per_round_ratios():
    # a slow phase (rounds 2 and 3 twice as slow for both cases) moves the ratio of medians, not the paired one
    result = harness.Comparison("t", {"plain": [1.0, 2.0, 2.0, 1.0, 1.0], "watched": [1.1, 2.2, 2.2, 2.2, 1.1]})
    assert abs(result.ratio("watched") - 1.1) < 1e-12
    assert abs(result.ratio_of_medians("watched") - 2.2) < 1e-12
    assert abs(result.added_ms("watched") - 200.0) < 1e-9


def test_the_spread_is_the_middle_half_of_the_per_round_ratios():
    result = harness.Comparison("t", {"plain": [1.0] * 5, "watched": [1.0, 1.1, 1.2, 1.3, 1.4]})
    first, third = result.ratio_spread("watched")
    assert (round(first, 12), round(third, 12)) == (1.05, 1.35)  # statistics.quantiles, exclusive method
    assert result.markdown().splitlines()[-1] == "| watched | 1.2000 | 1.200x | 1.200x | 1.050-1.350x |"
    assert harness.Comparison("t", {"plain": [2.0], "watched": [3.0]}).ratio_spread("watched") == (1.5, 1.5)


def test_the_machine_line_names_the_cpu_model_from_proc_cpuinfo():
    info = Path("/proc/cpuinfo")
    if not info.exists():
        assert harness.cpu_model()  # the platform's answer
        return
    names = [line.split(":", 1)[1].strip() for line in info.read_text().splitlines() if line.startswith("model name")]
    if names:
        assert harness.cpu_model().startswith(names[0])


def test_the_gpu_runs_checks_run_on_the_cpu_in_smoke_mode(tmp_path):
    # benchmarks.gpu --smoke: the tiny pipeline on the CPU, so the device run's code is exercised
    # here; a section that raises is reported as its traceback, and none does
    from benchmarks import gpu

    written = []
    results = gpu.run(str(tmp_path), smoke=True, sections=("checks", "syncs"), write=lambda n, r: written.append(n))
    checks = results["checks"]
    assert written == ["checks", "syncs"] and "error" not in checks
    assert checks["image_bitwise_equal_sentinel"] is True and checks["image_bitwise_equal_full"] is True
    assert checks["oom_anomaly"]["component"] == "unet" and checks["oom_anomaly"]["module"] == "up_blocks.1"
    assert checks["memory_snapshot_files"] == ["memory/gpu-check.json"]  # no CUDA: no allocator pickle
    assert results["syncs"]["note"] == "CUDA only"
    text = gpu.markdown(results)
    assert text.startswith("### checks\n") and '"image_bitwise_equal_full": true' in text
