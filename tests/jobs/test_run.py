"""The run job (``diffusion-debug run``): the determinism check of ``--repeat``."""

from __future__ import annotations

import pytest
import torch

from diffusion_debug.cli import main
from diffusion_debug.jobs import pipeline_loading
from diffusion_debug.record import load_run
from diffusion_debug.testing import tiny_pipeline


def _only_run_dir(output_dir):
    (run_dir,) = [p for p in output_dir.iterdir() if (p / "summary.json").is_file()]
    return run_dir


def _load_with(monkeypatch, pipe):
    monkeypatch.setattr(pipeline_loading, "load_pipeline", lambda *args, **kwargs: pipe)


def _run(tmp_path, *flags):
    return main(["run", "--steps", "3", "--prompt", "a cat", "--output-dir", str(tmp_path), *flags])


def test_repeat_with_a_deterministic_pipeline_finds_nothing(monkeypatch, tmp_path, capsys):
    _load_with(monkeypatch, tiny_pipeline("sd"))
    assert _run(tmp_path, "--repeat", "2") == 0
    data = load_run(_only_run_dir(tmp_path))
    assert [row["run"] for row in data.steps] == [1, 1, 1, 2, 2, 2]
    assert not [a for a in data.anomalies if a.kind == "nondeterministic"]
    out = capsys.readouterr().out.splitlines()
    verdict = "determinism: the 2 calls with seed 0 agree: the same image (pixel for pixel), the same latent "
    assert [line for line in out if line.startswith("determinism:")] == [verdict + "statistics at each step."]
    header = next(line for line in out if line.startswith("step  "))
    assert header.split()[:3] == ["step", "run", "timestep"]  # which call each row is from
    rows = [line.split()[:2] for line in out[out.index(header) + 2 :][:6]]
    assert rows == [["0", "1"], ["1", "1"], ["2", "1"], ["0", "2"], ["1", "2"], ["2", "2"]]


def test_repeat_names_the_first_step_whose_latents_differ(monkeypatch, tmp_path, capsys):
    pipe = tiny_pipeline("sd")
    calls = {"n": 0}

    def noise_from_the_second_run_step_1(module, args, output):  # 3 UNet calls per run (batched CFG)
        calls["n"] += 1
        if calls["n"] >= 5:
            sample = output[0] if isinstance(output, tuple) else output.sample
            sample.add_(1e-2 * torch.randn_like(sample))

    handle = pipe.unet.register_forward_hook(noise_from_the_second_run_step_1)
    _load_with(monkeypatch, pipe)
    try:
        assert _run(tmp_path, "--repeat", "2") == 0
    finally:
        handle.remove()
    found = [a for a in load_run(_only_run_dir(tmp_path)).anomalies if a.kind == "nondeterministic"]
    (anomaly,) = [a for a in found if "runs" in a.details]
    # and the cause seen within the call: the planted noise drew from torch's global RNG, not the generator
    assert [a.details["run"] for a in found if a.details.get("reason") == "global_rng"] == [2]
    assert anomaly.step == 1 and anomaly.details["first_step"] == 1 and anomaly.details["runs"] == [1, 2]
    assert anomaly.details["max_pixel_difference"] > 0
    assert "the latents first differ at step 1" in anomaly.message
    out = capsys.readouterr().out
    assert "nondeterministic" in out  # the terminal table lists it
    verdicts = [line for line in out.splitlines() if line.startswith("determinism:")]
    assert verdicts == [f"determinism: NOT deterministic: call 2 differs from call 1: {anomaly.message}"]


def test_repeat_must_be_positive(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        _run(tmp_path, "--repeat", "0")
    assert exited.value.code == 2
    assert "argument --repeat: must be at least 1, not 0" in capsys.readouterr().err
