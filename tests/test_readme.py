"""The README's generated parts stay true: the anomaly table, the config options, the commands."""

import dataclasses
import re
from pathlib import Path

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
