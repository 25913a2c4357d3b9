"""The README, docs/reference.md and CONTRIBUTING.md stay true: the generated tables, the code that
runs as written, the links."""

import dataclasses
import os
import re
import subprocess
from pathlib import Path

import pytest
from fork_server import Forks

from diffusion_debug import DebugConfig
from diffusion_debug.config import PRESETS
from diffusion_debug.report.guide import guide_markdown

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
REFERENCE = (ROOT / "docs" / "reference.md").read_text()
CONTRIBUTING = (ROOT / "CONTRIBUTING.md").read_text()
# one worker under pytest -n 2 --dist loadgroup: the module's `python` server starts once for the three blocks
pytestmark = pytest.mark.xdist_group("readme")


def between(text: str, start: str, end: str) -> str:
    return text.split(start, 1)[1].split("-->", 1)[1].split(end, 1)[0].strip()


def test_anomaly_table_is_the_report_guide():
    assert between(REFERENCE, "<!-- anomaly-guide:start", "<!-- anomaly-guide:end") == guide_markdown().strip()


def test_every_config_option_is_documented_with_its_default():
    table = between(REFERENCE, "<!-- config-options:start", "<!-- config-options:end")
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", table, flags=re.M))
    fields = {f.name: f.default for f in dataclasses.fields(DebugConfig)}
    assert list(rows) == list(fields)
    for name, default in fields.items():
        expected = "from level" if name in PRESETS["basic"] else f"`{default}`"
        assert rows[name].strip() == expected, name


def test_the_run_directory_name_is_the_one_runs_get():
    from diffusion_debug.record.run_dir import new_run_name

    (line,) = [line for line in REFERENCE.splitlines() if line.startswith("debug_output/<prefix>")]
    shown = line.split("/ ")[0].removeprefix("debug_output/")
    parts = {"<prefix>": "run", "<date>": r"\d{8}", "<time>": r"\d{6}", "<pid>": r"\d+", "<6 hex>": "[0-9a-f]{6}"}
    pattern = re.sub("|".join(map(re.escape, parts)), lambda found: parts[found.group()], shown)
    assert re.fullmatch(pattern, new_run_name("run")), (shown, new_run_name("run"))


def test_the_two_commands_are_the_makefile_targets():
    assert "make demo" in README and "make test" in README
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.strip().splitlines()[-1] == "make test"


def python_blocks(text: str, start: str, end: str) -> list[str]:
    """The ```python blocks of a Markdown text between two headings."""
    part = text.split(start, 1)[1].split(end, 1)[0]
    return re.findall(r"^```python\n(.*?)^```", part, flags=re.M | re.S)


@pytest.fixture(scope="module")
def saved_tiny_pipeline(tmp_path_factory):
    from diffusion_debug.testing import tiny_pipeline

    path = tmp_path_factory.mktemp("readme") / "tiny-sd"
    tiny_pipeline("sd").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def python(tmp_path_factory):
    """``python(code, cwd)``: what ``python -c code`` run in ``cwd`` returns, asserted to exit 0: a
    child of tests/fork_server.py's process, which imported torch once for the three blocks (each
    imports it first). Only torch: the training and extending blocks import no pipeline."""
    server = Forks(tmp_path_factory.mktemp("readme-forks"), dict(os.environ), ("torch",))

    def run_block(code: str, cwd: Path) -> subprocess.CompletedProcess:
        done = server.run(cwd, dict(os.environ), [], code=code)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    yield run_block
    server.close()


def test_wrap_a_pipeline_runs_as_written(saved_tiny_pipeline, tmp_path, python):
    (code,) = python_blocks(README, "## Wrap a pipeline", "## Add it to a training script")
    # the only change: the tiny pipeline where the README says "path/to/pipeline"
    done = python(code.replace("path/to/pipeline", str(saved_tiny_pipeline)), tmp_path)
    (run_dir,) = (tmp_path / "debug_output").iterdir()
    assert (tmp_path / done.stdout.strip().splitlines()[-1]) == run_dir / "report.html"
    assert (run_dir / "summary.json").is_file() and (run_dir / "report.html").is_file()


def test_plain_training_loop_runs_as_written(tmp_path, python):
    (code,) = python_blocks(README, "## Add it to a training script", "## `accelerate launch`")
    done = python(code, tmp_path)
    (run_dir,) = (tmp_path / "debug_output").iterdir()
    count, path = done.stdout.strip().split(" steps; ")
    assert count == "20" and tmp_path / path == run_dir / "report.html"


def test_the_training_script_diff_is_the_tested_example():
    """The README's diff against diffusers' train_text_to_image.py adds lines that the runnable example
    (tests/test_examples.py runs it) holds verbatim, so what a reader pastes is what the tests run."""
    diff = re.search(r"^```diff\n(.*?)^```", README, flags=re.M | re.S).group(1)
    added = [line[1:].strip() for line in diff.splitlines() if line.startswith("+")]
    assert len(added) == 8  # six statements, the monitor call on three lines
    example = {line.strip() for line in (ROOT / "examples" / "finetune_with_accelerate.py").read_text().splitlines()}
    assert [line for line in added if line not in example] == []


def test_the_extending_snippet_runs_as_written(tmp_path, python):
    (code,) = python_blocks(CONTRIBUTING, "## Extending", "## Performance")
    done = python(code, tmp_path)
    assert done.stdout == "The EMA weights drifted by 0.5 at step 3.\n"


def test_every_link_to_a_file_of_the_repository_resolves():
    for name, text in {"README.md": README, "CONTRIBUTING.md": CONTRIBUTING, "docs/reference.md": REFERENCE}.items():
        base = (ROOT / name).parent
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (base / target).exists(), f"{name} links to {target}, which does not exist"
