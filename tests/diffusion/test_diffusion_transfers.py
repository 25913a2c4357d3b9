"""DESIGN invariant: in default mode the debugger adds one device-to-host read per denoising
step (diffusers' own reads are subtracted; once-per-run reads cancel between two step counts)."""

import collections

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.host_transfers import count_host_transfers


def added_reads(pipe, steps, debugger):
    def call():
        pipe(
            "a photo of a cat",
            num_inference_steps=steps,
            output_type="latent",
            generator=torch.Generator().manual_seed(0),
        )

    call()
    with count_host_transfers() as plain:
        call()
    with debugger:
        with count_host_transfers() as watched:
            call()
    return collections.Counter(watched.calls) - collections.Counter(plain.calls)


@pytest.mark.parametrize("kind", ["sd", "sd3"])
def test_one_host_read_per_denoising_step(pipes, tmp_path, kind):
    pipe = pipes[kind]
    debugger = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), run_name="t", log_level="error"))
    short, long = added_reads(pipe, 2, debugger), added_reads(pipe, 5, debugger)
    assert sum(long.values()) - sum(short.values()) == 3  # 3 more steps, 3 more reads
    assert set(long) <= {"tolist", "__float__"}
    assert [row["step"] for row in debugger.report().steps][-5:] == [0, 1, 2, 3, 4]
