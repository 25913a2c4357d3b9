"""The per-step cost as a count of aten ops (deterministic, unlike a timing): at real size on a GPU
the pipeline is launch-bound, so the ops the debugger adds are what it costs (DESIGN.md: at most 25
added ops per denoising step in default mode on the tiny pipeline)."""

import sys
import tempfile
from pathlib import Path

import pytest
import torch

from diffusion_debug import DebugConfig
from diffusion_debug.op_count import added_ops, count_aten_ops
from diffusion_debug.testing import tiny_pipeline

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import op_counts  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


def test_the_counter_counts_kernels_not_views():
    x = torch.ones(4, 4)
    with count_aten_ops() as ops:
        y = x.view(16)[:8]
        z = (y * 2).sum()
    assert z.item() == 16 and ops.counts == {"aten.mul.Tensor": 1, "aten.sum.default": 1}
    assert added_ops(ops.counts, {"aten.mul.Tensor": 1}) == {"aten.sum.default": 1}


@pytest.mark.parametrize(
    "dtype, level",
    [(torch.float32, "advanced"), (torch.float32, "basic"), (torch.float16, "advanced")],
)
def test_default_mode_adds_at_most_25_ops_per_denoising_step(dtype, level):
    pipe = tiny_pipeline("sd", dtype=dtype)
    config = DebugConfig(level=level, output_dir=tempfile.mkdtemp(), stream_events=False, log_level="error")
    counts = op_counts.inference_ops(pipe, config)
    assert counts["added_ops_per_step"] <= 25, counts
    if dtype == torch.float32:  # the sentinel watches fp16 block outputs only: a float32 step is a few ops
        assert counts["added_ops_per_step"] <= 12, counts


def test_the_training_debugger_adds_the_same_ops_whatever_the_model_size():
    small = op_counts.training_ops(tiny_pipeline("sd").unet)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        from benchmarks.models import mid_unet

        large = op_counts.training_ops(mid_unet())
    assert small["parameters"] < large["parameters"]
    assert small["added_ops_per_step"] == large["added_ops_per_step"] <= 60, (small, large)
