"""``compare_pipelines`` on a compiled component compiles nothing for it: its recording and its replays
leave the user's dynamo caches as the user's own call left them, the module is named, and the user's next
call is the plain one's, to the bit, compiling nothing. A component compiled in place ran the recording's
hooks inside its compiled call (8 graphs added, graph breaks at each hook) and the replay's module hooks
nowhere (no module named); a regionally compiled one traced the replay's hooks into its blocks' compiled
calls (6 graphs added)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from diffusion_debug import compare_pipelines
from diffusion_debug.installed import HAS_SET_STANCE
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.testing.features import HAS_REPEATED_BLOCKS

pytestmark = pytest.mark.skipif(
    not (HAS_REPEATED_BLOCKS and HAS_SET_STANCE),
    reason="this diffusers has no regional compilation, or this torch no set_stance",
)

CALL = dict(prompt="a cat", num_inference_steps=2, output_type="pt", height=16, width=16)


def graphs() -> tuple[int, int]:
    """Dynamo's graphs made and frames it compiled so far (its ``counters``)."""
    return counters["stats"]["unique_graphs"], counters["frames"]["total"]


@pytest.mark.parametrize("how", ["torch.compile", "in place", "regional"])
def test_compare_pipelines_adds_no_graph_to_a_compiled_component(how):
    torch._dynamo.reset()
    counters.clear()
    pipe = tiny_pipeline("flux")
    if how == "torch.compile":
        pipe.transformer = torch.compile(pipe.transformer, backend="aot_eager")
    elif how == "in place":
        pipe.transformer.compile(backend="aot_eager")
    else:
        pipe.transformer.compile_repeated_blocks(backend="aot_eager")
    weight = getattr(pipe.transformer, "_orig_mod", pipe.transformer).proj_out.weight
    plain = pipe(generator=torch.Generator().manual_seed(0), **CALL).images
    compiled = graphs()  # the user's call's graphs: one per compiled region (two for the two kinds of block)
    assert compiled == ((2, 2) if how == "regional" else (1, 1))

    def b(pipe):  # a weight is a graph input: side B's own calls compile nothing either
        kept = weight.detach().clone()
        with torch.no_grad():
            weight.mul_(1.5)

        def undo():
            with torch.no_grad():
                weight.copy_(kept)

        return undo

    found = compare_pipelines(pipe, pipe, b=b, seed=0, **CALL).first_divergence
    assert graphs() == compiled, "compare_pipelines compiled the user's functions again"
    assert (found.component, found.module, found.step, found.made_here) == ("transformer", "proj_out", 0, True)
    later = pipe(generator=torch.Generator().manual_seed(0), **CALL).images
    assert graphs() == compiled, "the user's next call compiled again"
    torch.testing.assert_close(later, plain, rtol=0, atol=0)
