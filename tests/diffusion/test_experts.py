"""Multi-expert denoisers: Wan 2.2 runs ``transformer`` for the high-noise steps and
``transformer_2`` for the rest; each expert is watched like the first (localisation, bundle,
``why``, policies) and each step row names the expert that ran it."""

from __future__ import annotations

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionDebugError, DiffusionModelDebugger
from diffusion_debug.testing import plant_nonfinite, tiny_pipeline
from diffusion_debug.testing.features import kind_missing
from diffusion_debug.testing.zoo_video_audio import WAN22_CALL

pytestmark = pytest.mark.skipif(bool(kind_missing("wan22")), reason=str(kind_missing("wan22")))

MODULE = "blocks.1.attn1.to_out.0"


@pytest.fixture(scope="module")
def wan22():
    """Tiny Wan 2.2 (boundary 0.875): with 2 steps, step 0 is ``transformer``'s, step 1 ``transformer_2``'s."""
    return tiny_pipeline("wan22")


def run(pipe, tmp_path, **config):
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=tmp_path, log_level="error", **config))
    with dbg:
        pipe(**WAN22_CALL(), num_inference_steps=2, generator=torch.Generator().manual_seed(0))
    dbg.close()
    return dbg.report()


def errors(report):
    return [(a.kind, a.component, a.module, a.step) for a in report.anomalies if a.severity == "error"]


def test_each_step_row_names_the_expert_that_ran_it(wan22, tmp_path):
    report = run(wan22, tmp_path)
    assert [(row["step"], row["denoiser"]) for row in report.steps] == [(0, "transformer"), (1, "transformer_2")]
    assert errors(report) == []


@pytest.mark.parametrize("expert, step", [("transformer", 0), ("transformer_2", 1)])
def test_an_inf_in_either_expert_is_named_at_its_module_with_a_bundle(wan22, tmp_path, expert, step):
    with plant_nonfinite(getattr(wan22, expert).get_submodule(MODULE)):
        report = run(wan22, tmp_path)
        why = report.why()  # replays the bundle on the live expert, fault still planted
    assert (why.component, why.module, why.step, why.baseline.finite) == (expert, MODULE, step, False)
    assert errors(report) == [("nonfinite", expert, MODULE, step)]
    headline = report.anomalies[0]
    assert headline.message.startswith(f"{expert}.{MODULE} produced NaN/Inf from finite inputs")
    assert [p.name for p in (report.run_dir / "bundles").iterdir()] == [f"{expert}-step{step}"]
    later = [a for a in report.anomalies[1:] if a.kind == "nonfinite"]  # what only passed it on
    assert later and all(f"fix the first NaN/Inf at {expert} {MODULE}, step {step}" in a.message for a in later)


def test_extreme_probes_blame_only_the_second_expert(wan22, tmp_path):
    with plant_nonfinite(wan22.transformer_2.get_submodule(MODULE)):
        report = run(wan22, tmp_path, level="extreme")
    assert errors(report) == [("nonfinite", "transformer_2", MODULE, 1)]
    assert "transformer" not in {a.component for a in report.anomalies}


def test_policy_raise_names_the_second_expert(wan22, tmp_path):
    with plant_nonfinite(wan22.transformer_2.get_submodule(MODULE)), pytest.raises(DiffusionDebugError) as info:
        run(wan22, tmp_path, policy="raise")
    assert (info.value.anomaly.component, info.value.anomaly.module) == ("transformer_2", MODULE)
