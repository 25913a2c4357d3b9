"""The fixed cost of a watched call, counted (issue 36; DESIGN's budget: a reused debugger adds
<= 5 ms to a 1-step tiny SD call, timed in benchmarks/). Python function calls are deterministic
for one environment: on tiny SD a reused ``with dbg:`` 1-step call added 35458 of them before the
module trees were walked once per attach (29163 in attach + detach alone), 10259 after (3964);
10566 (3987) as the bookkeeping began and 9753 (3884) after it, 4318 -> 3505 with probes off (no
asdict per row, one /proc read per memory sample, class guards, the encode_prompt signature kept).
On 2026-11-27: 3457 -> 1436 (attach + detach 433; 1413 with probes off) once the components
whose dtype cannot overflow (here all: fp32) went unprobed, the tree key went breadth first and
the dtype, prompt, argument and busy checks stopped calling per item."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from diffusion_helpers import run

from diffusion_debug import DebugConfig, DiffusionModelDebugger, installed

ROOT = Path(__file__).resolve().parents[2]


def python_calls(function) -> int:
    calls = [0]

    def profile(frame, event, arg):
        if event == "call":
            calls[0] += 1

    sys.setprofile(profile)
    try:
        function()
    finally:
        sys.setprofile(None)
    return calls[0]


def test_a_reused_debugger_adds_a_bounded_number_of_python_calls_to_a_one_step_call(pipes, tmp_path):
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path)))

    def watched():
        with dbg:
            run(pipe, steps=1)

    for _ in range(2):  # warm: lazy imports, first-call caches, the tree memo
        run(pipe, steps=1)
        watched()
    plain = python_calls(lambda: run(pipe, steps=1))
    added = python_calls(watched) - plain
    cycle = python_calls(lambda: (dbg.attach(), dbg.detach()))
    assert cycle < 600, cycle  # was 29163: ~15 walks of every module at each attach; 3884; 433
    assert added < 1800, added  # was 35458; 9753; 1436
    dbg.close()
    # the memo follows the tree: a module added while detached is probed at the next attach
    full = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), probes="full"))
    with full:
        assert "decoder.extra" not in full._steps.probes.probes["vae"].module_names
    pipe.vae.decoder.extra = torch.nn.Linear(2, 2)
    try:
        with full:
            names = full._steps.probes.probes["vae"].module_names
        assert "decoder.extra" in names
    finally:
        del pipe.vae.decoder.extra
    with full:
        assert "decoder.extra" not in full._steps.probes.probes["vae"].module_names
    full.close()


def test_the_bookkeeping_of_a_watched_call_without_probes_is_bounded(pipes, tmp_path):
    """What is left with probes off: call-site hooks, step row, events, memory samples."""
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), probes="off"))

    def watched():
        with dbg:
            run(pipe, steps=1)

    for _ in range(2):
        run(pipe, steps=1)
        watched()
    added = python_calls(watched) - python_calls(lambda: run(pipe, steps=1))
    assert added < 1700, added  # 4318 before the bookkeeping was cut, 3505 after, 1413 on 2026-11-27
    steps = dbg.report().steps
    assert sorted(steps[-1]["memory"]) == ["percent", "rss_mb", "vms_mb"]  # the row's sample, as before
    assert sorted(steps[-1]["latents"]) == ["absmax", "dtype", "l2", "mean", "nan", "neginf", "posinf", "shape", "std"]
    dbg.close()


def test_a_denoising_step_adds_a_bounded_number_of_python_calls(pipes, tmp_path):
    # at real size on a GPU the plain DDIM loop syncs inside scheduler.step, so every Python call the
    # debugger makes per step is wall time there (the H200 run of issue 36): counted per step as the
    # growth from a 2-step to a 6-step call, what happens once per call cancelling out: 655 before
    # a row's leaves skipped to_jsonable's call each and fp32 sentinel blocks stopped asking the
    # compiler, 547 after, 411 once an fp32 UNet's sentinel (it read nothing) was no longer hooked;
    # 123 on 2026-11-29, 90 once the policy read the sink's queue in the events themselves, a step
    # was read with its outputs, a DDIM scheduler's missing names from its dict, a row's statistics
    # made in one call and a clean step's checks, previews and finiteness read inline
    pipe = pipes["sd"]
    # the tiny UNet's random weights make latents diverge: a clean call is what is counted
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), latent_std_tolerance=1e9))

    def added(steps: int) -> int:
        def watched():
            with dbg:
                run(pipe, steps=steps, output_type="latent")

        watched()  # warm: first-call caches, the tree memo
        return python_calls(watched) - python_calls(lambda: run(pipe, steps=steps, output_type="latent"))

    per_step = (added(6) - added(2)) / 4
    assert 0 < per_step <= 100, per_step  # 90 here (a flush or a collection may land in one call)
    dbg.close()


def test_a_reused_debugger_adds_a_bounded_number_of_python_calls_to_a_one_step_fp16_call(tmp_path):
    """Issue 45: the fp16 path users take on GPUs. An fp16 text encoder and VAE had full probes on
    every call: 7133 added calls on tiny SD at 1 step (trailing spacing, pil), 17307 at SD1.5
    topology. After their first call they have their block sentinel, every sentinel one fused
    reduction a call, and clean readings are checked in one pass: 2330 and 2889 (this test's call,
    leading spacing and np: 2510, its first call 17844)."""
    from diffusion_debug.testing import tiny_pipeline

    pipe = tiny_pipeline("sd", dtype=torch.float16)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), latent_std_tolerance=1e9))

    def watched():
        with dbg:
            run(pipe, steps=1)

    first = python_calls(watched) - python_calls(lambda: run(pipe, steps=1))  # full probes, read once
    added = python_calls(watched) - python_calls(lambda: run(pipe, steps=1))
    assert added < 2800 < first, (added, first)  # 2510 and 17844 on 2026-11-28
    assert dbg._steps.probes.levels == {"unet": "sentinel", "text_encoder": "sentinel", "vae": "sentinel"}
    dbg.close()


# what a reused debugger's fp16 1-step call at a run no sentinel reads adds, counted in a process of its own
# (op_counts.added_python_calls): Python frames and the calls Python makes into C functions
FP16_NOT_READ = """
import json, tempfile, warnings
import torch
warnings.simplefilter("ignore")
from diffusion_debug import DebugConfig
from diffusion_debug.testing import tiny_pipeline
from benchmarks import op_counts
config = DebugConfig(output_dir=tempfile.mkdtemp(), log_level="error")
print(json.dumps(op_counts.added_python_calls(tiny_pipeline("sd", dtype=torch.float16), config)))
"""


@pytest.mark.xdist_group("pipeline_forks")
@pytest.mark.skipif(
    not installed.GLOBAL_HOOKS_TAKE_KWARGS, reason="before torch 2.6 a probe hooks each module: other counts"
)
def test_a_reused_fp16_one_step_call_not_read_adds_pinned_python_and_c_calls(pipeline_forks, tmp_path):
    """DESIGN: a reused debugger's 1-step tiny SD call adds <= 3 ms in fp16 on the CPU. Its cost there is
    host work, so it is pinned as counts, which a timing on a shared machine cannot resolve: the Python
    frames (222 since cost18: test_op_count pins them against fp32's) and, apart, the calls Python code
    makes into C functions (``isinstance``, ``getattr``, ``dict.get``, a tensor method: no frame, so a
    chain of them added per call or per hook moved no pin). Counted at main 67649687 (cost30) and at
    2d2720d (cost23's merge), fewest of three, log level error: 222 and 222 frames, 2764 and 2759 C calls
    (the run's autocast read, ``ANY_AUTOCAST``, and ReplayMemory.new_run's five new clears); bytecodes
    47,887 and 47,585 (``sys.settrace``). Of the C calls, the tree walk (``structure.tree_key``: ~1,740) and
    the detach's ``park`` (~190) are most. A count over its pin names what grew with
    ``op_counts.added_python_calls(..., sites=True)``. 2762 C calls once a decoded image's count and extremes
    were read through one ``cat`` (cost31: no ``.float()`` of each extreme, no ``unbind``; frames the same).
    1006 once an unchanged tree is told by its dicts' version tags, one C loop a component
    (``components/tree_tags.py``, cost32), not walked: the walk's ~1,756 C calls gone, frames the same (each
    ``tree_key`` frame became an ``unchanged`` frame); with the reader switched off the same call counts 2774
    C calls and 225 frames from 3e2e1b92 to acfad11e (``tree_tags`` called after each walk, returning at once;
    3e2e1b92's message says 222 either way: 225 measured at 3e2e1b92), 222 since the review's fixes (no
    ``tree_tags`` call where there is no reader). The fixes (back-off, a write between walk and read,
    ``_diffusers_hook = None``) are all on the walk's path: 222 and 1006 with the reader on, unmoved.
    811 once a detach finds the places the last one parked as :func:`~.detached.revive` left them (the
    same objects, no dict written since: version tags) and parks them again as they are, not looked for
    one by one (``park``: ~205 C calls to 10; cost33); frames the same (the test inline in ``park``).
    814 once the dicts empty when tagged are told unchanged by staying empty (cost37: one ``any`` a component,
    three; ~83 k instructions fewer a call, callgrind), frames the same.
    808 once a step row's statistics and memory sample come to the record as JSON copies made where they are
    made (cost39: ``to_jsonable``'s six ``dict.items`` of its inner dicts gone; 1,208 bytecodes fewer a call),
    frames the same."""
    if sys.version_info[:2] not in PINS:
        pytest.skip(f"counted on Python {', '.join('.'.join(map(str, v)) for v in PINS)} only")
    frames, c_calls = PINS[sys.version_info[:2]]
    done = pipeline_forks.run(ROOT, dict(os.environ), [], code=FP16_NOT_READ, outputs=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    added = json.loads(done.stdout.splitlines()[-1])
    assert added["added"] <= frames, added
    assert added["added_builtins"] <= c_calls, added


PINS = {(3, 10): (222, 832), (3, 11): (222, 808), (3, 12): (215, 824)}
"""(frames, C calls) by Python version, counted on 3.11.7 (above), 3.12.1 and 3.10.13 (diffusers 0.41 there: 0.42
asks 3.11; the same 222 frames, 18 C calls more than 3.11's, three runs alike: not broken down). 3.12 runs a
comprehension in its function's frame (PEP 709): 7 frames fewer, the same code; its C calls: the lengths' six
``sum`` calls (torch's tag reader there misses a clone: ``tree_tags.LENGTHS_TOO``) and 4 ``isinstance`` calls
that 3.11's profiler does not report (cost37's three ``any`` calls added to all three by reading, counted on 3.11
alone). Not counted on another version (3.13.0 reads no tags, ``tree_tags``: every
attach walks)."""
