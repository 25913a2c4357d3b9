"""The README's generated parts stay true: the anomaly table, the config options, the commands."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from diffusion_debug import DebugConfig
from diffusion_debug.config import PRESETS
from diffusion_debug.report.guide import guide_markdown

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def between(start: str, end: str) -> str:
    return README.split(start, 1)[1].split("-->", 1)[1].split(end, 1)[0].strip()


def test_anomaly_table_is_the_report_guide():
    assert between("<!-- anomaly-guide:start", "<!-- anomaly-guide:end") == guide_markdown().strip()


def test_every_config_option_is_documented_with_its_default():
    table = between("<!-- config-options:start", "<!-- config-options:end")
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", table, flags=re.M))
    fields = {f.name: f.default for f in dataclasses.fields(DebugConfig)}
    assert list(rows) == list(fields)
    for name, default in fields.items():
        expected = "from level" if name in PRESETS["basic"] else f"`{default}`"
        assert rows[name].strip() == expected, name


def test_the_two_commands_are_the_makefile_targets():
    assert "make demo" in README and "make test" in README
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert ci.strip().splitlines()[-1] == "make test"


def python_blocks(start: str, end: str) -> list[str]:
    """The ```python blocks of the README between two headings."""
    part = README.split(start, 1)[1].split(end, 1)[0]
    return re.findall(r"^```python\n(.*?)^```", part, flags=re.M | re.S)


@pytest.fixture(scope="module")
def saved_tiny_pipeline(tmp_path_factory):
    from diffusion_debug.testing import tiny_pipeline

    path = tmp_path_factory.mktemp("readme") / "tiny-sd"
    tiny_pipeline("sd").save_pretrained(path)
    return path


@pytest.mark.parametrize("index", [0, 1], ids=["1-wrap-a-pipeline", "2-monitor-a-fine-tuning-script"])
def test_section_1_and_2_snippets_run_as_written(index, saved_tiny_pipeline, tmp_path):
    blocks = python_blocks("## 1. Wrap a pipeline", "## 3. ")
    assert len(blocks) == 2
    # the only change: the tiny pipeline where the README says "path/to/pipeline"
    code = blocks[index].replace("path/to/pipeline", str(saved_tiny_pipeline))
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (tmp_path / "debug_output").iterdir()
    assert (run_dir / "summary.json").is_file() and (run_dir / "report.html").is_file()
    if index == 0:
        assert (run_dir / "image.png").is_file()
    else:
        assert "'total_steps': 2" in done.stdout  # 16 samples, batches of 4, 2 accumulation steps


def test_the_extending_snippet_runs_as_written(tmp_path):
    (code,) = python_blocks("## Extending", "## How it works")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "The EMA weights drifted by 0.5 at step 3.\n"
