"""Every example runs, in a fast mode, and does what its docstring says."""

import importlib.util
from pathlib import Path

import pytest

from diffusion_debug.record import load_json

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wrap_pipeline(tmp_path, capsys):
    report = load("wrap_pipeline").main(["--steps", "3", "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert [row["step"] for row in report.steps] == [0, 1, 2]
    assert "3 steps; last latent std" in out
    run_dir = Path(out.strip().splitlines()[-1].removeprefix("report: ")).parent
    assert len(load_json(run_dir / "summary.json")["steps"]) == 3


def test_custom_denoising_loop(tmp_path, capsys):
    report = load("custom_denoising_loop").main(["--steps", "4", "--output-dir", str(tmp_path)])
    assert [row["step"] for row in report.steps] == [0, 1, 2, 3]
    timesteps = [row["timestep"] for row in report.steps]
    assert timesteps == sorted(timesteps, reverse=True) and len(set(timesteps)) == 4
    assert "4 steps monitored" in capsys.readouterr().out


@pytest.mark.parametrize("accumulation", [1, 2])
def test_finetune_with_accelerate(tmp_path, capsys, accumulation):
    summary = load("finetune_with_accelerate").main(
        [
            "--max-train-steps",
            "4",
            "--gradient-accumulation-steps",
            str(accumulation),
            "--output-dir",
            str(tmp_path),
            "--cpu",
        ]
    )
    assert summary["total_steps"] == 4
    assert summary["gradient_explosions"] == 0 and summary["skipped_steps"] == 0
    assert "report: " in capsys.readouterr().out
