"""The benchmarks run (smoke mode: seconds, tiny models) and write well-formed results.
Their timings are never asserted: speed is measured by `make bench`, not by tests."""

import copy
import importlib
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import pytest  # noqa: E402
import torch  # noqa: E402

from benchmarks import call_control, call_cost, call_parts, harness, per_component, run, user_path  # noqa: E402

SMOKE_RUN = pytest.mark.xdist_group("benchmarks_smoke")  # one worker under -n 2: `smoke_run` is made once


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """``benchmarks.run --smoke``'s text, and what it got from the user's-path section (to check
    against its text): made once, read by the tests of both."""
    measured = []
    real_run = user_path.run
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(user_path, "run", lambda *a, **k: measured.append(real_run(*a, **k)) or measured[-1])
        out = tmp_path_factory.mktemp("smoke") / "RESULTS.md"
        assert run.main(["--smoke", "--out", str(out)]) == 0
    (users,) = measured
    return users, out.read_text()


@SMOKE_RUN
def test_smoke_run_writes_every_section(smoke_run):
    users, text = smoke_run
    _check_user_path(users, text)
    for title in (
        "Probes alone",
        "Inference overhead",
        "Training overhead",
        "Device-to-host transfers",
        "Localisation cost",
        "Memory",
        "Aten ops added per step",
        "Fixed cost of a watched call",
        "GPU (real size)",
        "The user's path: fp16 and bf16 (CPU time)",
    ):
        assert f"## {title}" in text
    for case in (
        "plain",
        "debugger default (sentinel)",
        "debugger, full probes",
        "transformers DebugUnderflowOverflow",
        "TrainingDebugger default",
        "torch.autograd.detect_anomaly",
    ):
        assert re.search(rf"\| {re.escape(case)} \| \d+\.\d{{4}} \| \d+\.\d{{3}}x \|", text), case
    assert '"correct": true' in text  # the localisation benchmark named the planted module
    for case in ("plain", "debugger"):  # the peak RSS of each call (smoke: both in one child process)
        assert re.search(rf'"{case}": {{\n +"peak_rss_mb": \d+\.\d+,\n +"peak_before_call_mb": \d', text), case
    for call in ("output_type='latent'", "output_type='pil'"):
        assert re.search(rf"\| 1-step tiny SD call, {call} \| \d+\.\d \| -?\d+\.\d \| \d+\.\d{{3}}x \|", text), call
    for dtype in ("fp32", "fp16"):  # smoke: bf16 inference takes fp32's path (no sentinel)
        assert f"{dtype} reused debugger adds <= 3 ms to a 1-step tiny SD call: " in text
    assert "fp16 default <= 1.05x (GPU budget, SD1.5-shaped proxy): " in text
    assert "fp16 full probes <= 1.5x (GPU budget, SD1.5-shaped proxy): " in text
    assert "budgets are checked against the paired ratio" in text
    assert f"- machine: {harness.cpu_model()}, " in text
    assert "- machine: " in text and "- command: `python -m benchmarks.run --smoke`" in text


def test_the_paired_ratio_is_the_median_of_per_round_ratios():
    # a slow phase (rounds 2 and 3 twice as slow for both cases) moves the ratio of medians, not the paired one
    result = harness.Comparison("t", {"plain": [1.0, 2.0, 2.0, 1.0, 1.0], "watched": [1.1, 2.2, 2.2, 2.2, 1.1]})
    assert abs(result.ratio("watched") - 1.1) < 1e-12
    assert abs(result.ratio_of_medians("watched") - 2.2) < 1e-12
    assert abs(result.added_ms("watched") - 200.0) < 1e-9


def test_the_spread_is_the_middle_half_of_the_per_round_ratios():
    result = harness.Comparison("t", {"plain": [1.0] * 5, "watched": [1.0, 1.1, 1.2, 1.3, 1.4]})
    first, third = result.ratio_spread("watched")
    assert (round(first, 12), round(third, 12)) == (1.05, 1.35)  # statistics.quantiles, exclusive method
    # the bootstrap interval of the median of 5 ratios: a resample's median is the smallest ratio when
    # 3 of its 5 draws are, sum(C(5,k) 0.2^k 0.8^(5-k), k >= 3) = 5.8% of the time (> 2.5%): the
    # 95% interval spans all five rounds, which is all 5 rounds can say
    assert result.ratio_interval("watched") == (1.0, 1.4)
    assert result.markdown().splitlines()[-1] == "| watched | 1.2000 | 1.200x | 1.200x | 1.050-1.350x | 1.000-1.400x |"
    wider = harness.Comparison("t", {"plain": [1.0] * 41, "watched": [1.0 + i / 100 for i in range(41)]})
    low, high = wider.ratio_interval("watched")  # 41 rounds: about the median +- 1.96 sqrt(41)/2 ranks
    assert 1.13 <= low < 1.2 < high <= 1.27
    assert harness.Comparison("t", {"plain": [2.0], "watched": [3.0]}).ratio_spread("watched") == (1.5, 1.5)


def test_the_interval_of_the_added_ms_is_the_order_statistics_a_sign_count_puts_around_the_median():
    """The 95% interval of the median per-round difference: ranks k and n+1-k of the sorted
    differences, k the largest for which (naively, over every pattern of n differences falling below
    or above the median) at least k below and k above happens in >= 95% of the patterns."""
    import itertools
    import random

    for n in (1, 3, 5, 6, 9, 12, 30):
        if n <= 12:
            patterns = list(itertools.product((0, 1), repeat=n))
            k = max(
                [k for k in range(1, n + 1) if sum(k <= sum(p) <= n - k for p in patterns) >= 0.95 * len(patterns)],
                default=0,
            )
        else:
            k = 10  # the sign test's table: ranks 10 and 21 of 30 at 95%
        differences = list(range(n))  # ms added per round: 0, 1, ..., n - 1
        random.Random(n).shuffle(differences)
        result = harness.Comparison("t", {"plain": [1.0] * n, "watched": [1.0 + d / 1e3 for d in differences]})
        low, high = result.added_ms_interval("watched")
        expected = (k - 1, n - k) if k else (0, n - 1)  # under 6 rounds: the whole range
        assert (round(low, 9), round(high, 9)) == expected, n
    assert n == 30 and expected == (9, 20)


def test_the_3_ms_budget_is_undecided_where_the_interval_straddles_it():
    assert [user_path.within(i, 3.0) for i in ((1.0, 3.0), (2.0, 3.5), (3.01, 4.0))] == [True, None, False]
    assert [user_path.verdict(v) for v in (True, None, False)] == ["met", "undecided", "MISSED"]
    plain = [0.170] * 30
    straddles = [t + (1.5 + i / 10) / 1e3 for i, t in enumerate(plain)]  # 1.5 to 4.4 ms added, median 2.95
    comparison = harness.Comparison("t", {"plain": plain, call_cost.REUSED: straddles})
    assert comparison.added_ms(call_cost.REUSED) <= 3.0  # the median alone would say met
    budgets = user_path.UserPath({}, one_step={"fp16": comparison}).budgets()
    assert budgets == {"fp16 reused debugger adds <= 3 ms to a 1-step tiny SD call": None}


def test_the_kernels_scatter_common_to_a_rounds_two_calls_leaves_the_controlled_figure():
    """call_control: a round's figure is its difference of the whole calls minus its difference of
    the compute inside them. Rounds whose kernels scatter by +-8 ms (the compute of each call drawn
    apart) around a debugger that adds 2.0 ms outside them, 2.5 ms on the rounds its sentinels read
    (1 in 4): the figure is exactly 2.0 on the rounds not read, 2.5 on those read, and its interval
    over all rounds under 3 ms (met), where the same calls as timed straddle it (undecided)."""
    import random

    draw, n = random.Random(0), 40
    read = [i % 4 == 0 for i in range(n)]
    compute = {case: [0.170 + draw.uniform(-0.008, 0.008) for _ in range(n)] for case in ("plain", call_cost.REUSED)}
    outside = {"plain": [0.005] * n, call_cost.REUSED: [0.005 + (2.5 if r else 2.0) / 1e3 for r in read]}
    whole = {case: [c + o for c, o in zip(compute[case], outside[case])] for case in compute}
    found = call_control.Controlled("t", whole, compute, read)
    adjusted = [found.comparison("adjusted", rounds).added_ms_interval(call_cost.REUSED) for rounds in (False, True)]
    assert [(round(low, 6), round(high, 6)) for low, high in adjusted] == [(2.0, 2.0), (2.5, 2.5)]
    assert found.comparison("adjusted").added_ms_interval(call_cost.REUSED)[1] <= 3.0
    assert user_path.within(found.comparison("whole").added_ms_interval(call_cost.REUSED), 3.0) is None
    as_timed = harness.Comparison("t", whole, "cpu")
    budgets = user_path.UserPath({}, one_step={"fp16": as_timed}, controlled={"fp16": found}).budgets()
    assert budgets == {
        "fp16 reused debugger adds <= 3 ms to a 1-step tiny SD call": None,
        "fp16 reused debugger adds <= 3 ms to a 1-step tiny SD call (compute taken out)": True,
    }
    rows = found.markdown().splitlines()[2:]
    assert [row.split(" | ")[:2] for row in rows] == [["| all rounds", "40"], ["| not read", "30"], ["| read", "10"]]
    # told by whose sentinels ran (each group on runs of its own): a row a group, its rounds' figure exactly
    found.groups = {call_cost.REUSED: [["unet", "", "vae", "text_encoder"][i % 4] for i in range(n)]}
    rows = found.markdown().splitlines()[2:]
    assert [row.split(" | ")[:2] for row in rows] == [
        ["| all rounds", "40"],
        ["| not read", "10"],
        ["| read: unet", "10"],
        ["| read: vae", "10"],
        ["| read: text_encoder", "10"],
        ["| read, any", "30"],
    ]
    assert found.comparison("adjusted", "unet").added_ms(call_cost.REUSED) == pytest.approx(2.5)
    assert found.comparison("adjusted", "vae").added_ms(call_cost.REUSED) == pytest.approx(2.0)


def test_the_attached_once_case_runs_a_twin_and_the_plain_calls_run_unwatched(tmp_path, monkeypatch):
    """call_cost's serving-loop case: a debugger attached once around every round, on a deep copy
    of the pipeline; the plain case's pipeline has no hook but ours when it runs, the reused and
    per-call cases' have the debugger's, and the twin has them in every round."""
    from diffusion_debug.testing import tiny_pipeline

    pipe = call_cost.one_step(tiny_pipeline("sd"))
    pipe.set_progress_bar_config(disable=True)
    running, seen = [None], []

    def spy(module, args):  # deep-copied with the UNet: it sees the twin's calls too
        hooks = len(module._forward_pre_hooks) + len(module._forward_hooks) - 1
        seen.append((running[0], module is pipe.unet, hooks))

    pipe.unet.register_forward_pre_hook(spy)

    def rounds(title, cases, **kwargs):
        for _ in range(2):
            for name, case in cases.items():
                running[0] = name
                case()
        return harness.Comparison(title, {name: [0.0] for name in cases})

    monkeypatch.setattr(call_cost, "interleaved", rounds)
    call_cost.run(pipe, repeats=2, output_dir=str(tmp_path))
    by_case = {}
    for name, original, hooks in seen:
        by_case.setdefault(name, set()).add((original, hooks > 0))
    assert by_case == {
        "plain": {(True, False)},
        call_cost.REUSED: {(True, True)},
        call_cost.ATTACHED: {(False, True)},
        call_cost.PER_CALL: {(True, True)},
    }


def test_mirrored_rounds_cancel_a_linear_drift_that_biases_rounds_run_in_one_order(monkeypatch):
    """Two identical cases on a machine that slows down by 1% a call: in one order the second case
    always runs later and reads slower (1.01x at the start); mirrored rounds (A B, then B A) centre
    both cases' runs of a pair on the same moment, and the A/A reads exactly 1. The collector is
    frozen only while the rounds run."""
    import gc

    clock, calls, order = [0.0], [0], []

    def case(name):
        def run():
            order.append(name)
            clock[0] += 1.0 + 0.01 * calls[0]  # each call 1% slower than the one before
            calls[0] += 1

        return run

    monkeypatch.setitem(harness.CLOCKS, "fake", lambda: clock[0])
    cases = {"A": case("A"), "B": case("B")}
    one_order = harness.interleaved("t", cases, repeats=6, clock="fake", mirrored=False)
    assert all(r > 1.0 for r in one_order.ratios("B")) and one_order.ratio("B") > 1.005
    warmed = len(order)
    mirrored = harness.interleaved("t", cases, repeats=6, clock="fake")
    timed = order[-12:]
    assert timed == ["A", "B", "B", "A"] * 3 and len(order) - warmed - 12 == 2 * 2  # the warm-up: 2 rounds
    assert len(mirrored.ratios("B")) == 3 and all(abs(r - 1.0) < 1e-12 for r in mirrored.ratios("B"))
    header = mirrored.markdown().splitlines()[0]
    assert header.endswith("| middle half of pairs of rounds | 95% interval of the paired ratio |")
    assert gc.get_freeze_count() == 0


def test_the_machine_line_names_the_cpu_model_from_proc_cpuinfo():
    info = Path("/proc/cpuinfo")
    if not info.exists():
        assert harness.cpu_model()  # the platform's answer
        return
    names = [line.split(":", 1)[1].strip() for line in info.read_text().splitlines() if line.startswith("model name")]
    if names:
        assert harness.cpu_model().startswith(names[0])


def test_the_gpu_runs_checks_run_on_the_cpu_in_smoke_mode(tmp_path):
    # benchmarks.gpu --smoke: the tiny pipeline on the CPU, so the device run's code is exercised
    # here; a section that raises is reported as its traceback, and none does
    from benchmarks import gpu

    written = []
    results = gpu.run(str(tmp_path), smoke=True, sections=("checks", "syncs"), write=lambda n, r: written.append(n))
    checks = results["checks"]
    assert written == ["checks", "syncs"] and "error" not in checks
    assert checks["image_bitwise_equal_sentinel"] is True and checks["image_bitwise_equal_full"] is True
    assert checks["oom_anomaly"]["component"] == "unet" and checks["oom_anomaly"]["module"] == "up_blocks.1"
    assert checks["memory_snapshot_files"] == ["memory/gpu-check.json"]  # no CUDA: no allocator pickle
    assert results["syncs"]["note"] == "CUDA only"
    text = gpu.markdown(results)
    assert text.startswith("### checks\n") and '"image_bitwise_equal_full": true' in text


def _check_user_path(users, text):
    """The user's path (fp16/bf16 rows): every table with its cases, its rounds in CPU time, and the
    deterministic counts as printed. The counts are checked where a naive reference exists: fp32
    components get no probe at the default, so a reused debugger's 1-step call with CFG runs the
    call sites' 2 hooks (which also see an OOM) on each of its 4 component calls (text encoder
    twice, UNet, VAE decode), 2 a step. The smoke run counts the tiny pipeline only: the
    SD1.5-shaped proxy's counts (DESIGN's 25 added ops a step in fp16 and bf16: at most 11, and its
    hooks) are test_op_count's sd15_shaped cases, on the same functions and config."""
    assert list(users.one_step) == ["fp32", "fp16"]  # smoke: no bf16, fp32's path (no sentinel), below too
    for dtype, table in users.one_step.items():
        cases = ["plain", call_cost.REUSED, call_cost.ATTACHED, call_cost.PER_CALL]
        assert table.clock == "cpu" and list(table.times) == cases
        assert re.search(rf"\| 1-step tiny SD {dtype} call, output_type='pil' \| \d+\.\d \| -?\d+\.\d \|", text)
    features = ["plain", "probes off", "level basic", "default (advanced)", "full probes"]
    assert list(users.features) == ["fp16"]
    for dtype, table in users.features.items():
        assert list(table.times) == features and table.clock == "cpu"
        assert all(len(times) == users.settings["rounds"] for times in table.times.values())
        assert f"| SD1.5-shaped {dtype}, 64x64, {users.settings['steps']} steps (CFG) | median CPU s |" in text
        for case in features:
            assert re.search(rf"\| {re.escape(case)} \| \d+\.\d{{4}} \| \d+\.\d{{3}}x \|", text), case
    assert list(users.aa) == ["fp16"]  # the A/A comparison: the plain call against itself
    for dtype, table in users.aa.items():
        assert list(table.times) == ["plain", "plain again"] and table.mirrored and table.clock == "cpu"
        assert len(table.times["plain again"]) == users.settings["aa_rounds"]
        assert f"| SD1.5-shaped {dtype}, 64x64, {users.settings['steps']} steps (CFG), A/A | median CPU s |" in text
    for dtype, split in users.splits.items():
        assert split.parts() == ["text_encoder", "unet", "vae.decode", per_component.OUTSIDE, per_component.WHOLE]
        for rounds in split.rounds.values():
            for r in rounds:  # the parts add up to the whole call
                parts = sum(v for k, v in r.items() if k != per_component.WHOLE)
                assert abs(parts - r[per_component.WHOLE]) < 1e-9
        assert f"| SD1.5-shaped {dtype}, 1 step | plain CPU ms | {call_cost.REUSED}: CPU ms added |" in text
    assert list(users.counts) == ["tiny SD fp32"]  # smoke: fp16's are test_op_count's tiny cases
    for name, found in users.counts.items():
        row = " | ".join(user_path._number(found[key]) for key, _ in user_path.COUNT_COLUMNS)
        assert f"| {name} | {row} |" in text
        assert found["hooks_per_call"] >= 8 and found["hooks_per_step"] >= 2  # the call sites' at least
    assert list(users.controlled) == ["fp16"]  # the 1-step call with the kernels' time taken out (smoke: fp16)
    for dtype, found in users.controlled.items():
        rounds = users.settings["controlled_rounds"]
        for case in ("plain", call_cost.REUSED, call_control.TOGETHER):
            assert len(found.whole[case]) == len(found.compute[case]) == rounds
            assert all(0 < c < w for c, w in zip(found.compute[case], found.whole[case]))
        # the sentinels read every group at the debugger's 2nd run (the first timed after one warm-up round), the
        # text encoder's alone at its 3rd; the A/B case's, every group on the same runs, none at its 3rd
        assert found.read == [True, True]
        assert found.groups == {
            call_cost.REUSED: ["text_encoder+unet+vae", "text_encoder"],
            call_control.TOGETHER: ["text_encoder+unet+vae", ""],
        }
        assert "reused debugger adds <= 3 ms to a 1-step tiny SD call (compute taken out): " in text
    assert "### 1-step tiny SD call, reused debugger, the components' compute taken out (2 rounds)" in text
    fp32 = users.counts["tiny SD fp32"]
    assert (fp32["hooks_per_call"], fp32["hooks_per_step"], fp32["measures_per_call"]) == (8, 2, 0)
    assert "### Counts, default config, reused debugger (deterministic)" in text
    assert list(users.training) == ["fp16", "bf16"]  # the proxy's UNet in an Accelerate training step
    for dtype, table in users.training.items():
        assert list(table.times) == ["plain", user_path.WATCHED_STEP] and table.clock == "cpu"
        assert all(len(times) == users.settings["training_rounds"] for times in table.times.values())
        title = f"SD1.5-shaped UNet training step, batch 2, 8x8, Accelerate {dtype}, clip_grad_norm_ 1.0"
        assert f"| {title} | median CPU s |" in text  # the user's step clips, as diffusers' scripts do
        ops = users.training_ops[dtype]
        assert 0 < ops["added_ops_per_step"] < ops["plain_ops_per_step"]
        assert f"{dtype} {ops['added_ops_per_step']} (of {ops['plain_ops_per_step']})" in text
        assert f"{dtype} training step <= 1.03x (GPU budget, SD1.5-shaped proxy): " in text


def test_the_component_clock_times_inside_the_call_and_changes_nothing(tmp_path):
    """Timing components swaps their classes for same-named subclasses and wraps vae.decode, for the
    measurement only: the watched image is bitwise the plain one, the debugger's findings the
    same, and the pipeline is given back as it was."""
    import torch

    from diffusion_debug import DebugConfig, DiffusionModelDebugger
    from diffusion_debug.testing import tiny_pipeline

    pipe = tiny_pipeline("sd")
    unet_class, text_class = type(pipe.unet), type(pipe.text_encoder)

    def call():
        g = torch.Generator().manual_seed(0)
        return pipe("a cat", num_inference_steps=2, generator=g, output_type="np").images

    def watched():
        debugger = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), stream_events=False))
        with debugger:
            image = call()
        kinds = sorted(a.kind for a in debugger.report().anomalies)
        debugger.close()
        return image, kinds

    plain, (image, kinds) = call(), watched()
    ticks, times = iter(range(1000)), {}
    forwards, spent = iter(range(1000)), [0.0, 0.0]  # call_control's clock of the forwards, inside the first
    decoder_class = type(pipe.vae.decoder)
    with per_component.component_clock(pipe, times, lambda: float(next(ticks))):
        assert type(pipe.unet).__name__ == unet_class.__name__ and isinstance(pipe.unet, unet_class)
        with call_control.compute_clock(pipe, spent, lambda: float(next(forwards))):
            timed_plain, (timed_image, timed_kinds) = call(), watched()
    assert (timed_plain == plain).all() and (timed_image == image).all() and timed_kinds == kinds
    # per call: 2 steps (one batched CFG call each), 2 prompts encoded, 1 decode; a plain and a watched call
    assert times == {"unet": 2 * 2, "text_encoder": 2 * 2, "vae.decode": 2}
    assert spent == [2 * (2 + 2 + 1), 0.0]  # the forwards, 1 tick each; no sentinel hook in fp32
    assert type(pipe.unet) is unet_class and type(pipe.text_encoder) is text_class and "decode" not in vars(pipe.vae)
    assert type(pipe.vae.decoder) is decoder_class


def test_the_gpu_runs_feature_table_and_component_split_run_on_the_cpu_in_smoke_mode(tmp_path):
    # issue 45: benchmarks.gpu prints probes off / basic / default / full, and the 1-step call by component
    from benchmarks import gpu

    results = gpu.run(str(tmp_path), smoke=True, sections=("inference", "inference_bf16", "one_step"))
    assert not [name for name, result in results.items() if "error" in result]
    for name, dtype in (("inference", "fp32"), ("inference_bf16", "bf16")):  # smoke: the fp32 tiny pipeline
        table = results[name]["comparison"]
        assert list(table.times) == [
            "plain",
            "probes off",
            "level basic",
            "default (advanced)",
            "full probes",
            "plain + one sync per step",
        ]
        assert table.title == f"SD1.5 size, {dtype}, 512x512, 2 steps (CFG)"  # the smoke run's tiny pipeline
    split = results["one_step"]["by_component"]
    assert list(split.rounds) == ["plain", call_cost.REUSED]
    assert list(results["one_step"]["comparison"].times) == [
        "plain",
        call_cost.REUSED,
        call_cost.ATTACHED,
        call_cost.PER_CALL,
    ]
    assert split.parts() == ["text_encoder", "unet", "vae.decode", per_component.OUTSIDE, per_component.WHOLE]
    text = gpu.markdown(results)
    assert "| 1 step by component (synced) | plain ms | reused debugger (with dbg:): ms added |" in text
    assert re.search(r"\| vae\.decode \| \d+\.\d \| [+-]\d+\.\d \|", text)


@SMOKE_RUN
def test_the_user_path_reruns_alone_as_one_command_with_a_selection(tmp_path, capsys, monkeypatch, smoke_run):
    def counted(pipe, output_dir):  # the smoke run's (the same function, pipeline and config): not counted again
        assert pipe.unet.dtype == torch.float32
        return smoke_run[0].counts["tiny SD fp32"]

    monkeypatch.setattr(user_path, "counts", counted)
    out = tmp_path / "user_path.md"
    assert user_path.main(["--parts", "counts", "--dtypes", "fp32", "--out", str(out)]) == 0
    text = out.read_text()
    assert text in capsys.readouterr().out  # printed, and written
    assert "`python -m benchmarks.user_path --parts counts --dtypes fp32` reruns it." in text
    assert re.search(r"\| tiny SD fp32 \| 8 \| 2 \| 8 \| 0 \| 0 \| \d+ \| \d+ \| \d+ \|", text)
    assert "### 1-step" not in text and "SD1.5-shaped" not in text  # only what was asked


def test_the_pre_reduction_check_adds_a_pass_per_ddp_bucket_and_one_flag_per_step(tmp_path):
    """benchmarks.pre_reduction's count in one process (a gloo group of world size 1; the benchmark
    runs 2 ranks): the check's own ops per bucket, the step's flag, and DDP's hook path in place of
    its built-in copy (``copy_`` instead of ``mul.out`` per gradient, one ``div_`` per bucket)."""
    import socket

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from benchmarks import pre_reduction
    from diffusion_debug import DebugConfig, TrainingDebugger
    from diffusion_debug.testing import tiny_pipeline

    started, hook = not dist.is_initialized(), sys.excepthook  # init_process_group sets its own and leaves it
    if started:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    try:
        unet = tiny_pipeline("sd").unet
        data = pre_reduction.batch(unet, 0, 8)
        steps, debuggers = {}, []
        for name in pre_reduction.CASES:
            model = type(unet).from_config(unet.config)
            model.load_state_dict(unet.state_dict())
            ddp = DistributedDataParallel(model)
            optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-6)
            tdbg = TrainingDebugger(ddp, config=DebugConfig(output_dir=str(tmp_path / name.split()[-1])))
            if name == "check on":  # one rank: the debugger attaches it only where there are several
                tdbg._steps.measurer.pre_reduction = pre_reduction.PreReductionCheck.attach([ddp])
            debuggers.append(tdbg)
            steps[name] = pre_reduction.stepper(ddp, optimizer, tdbg, data, lambda loss: loss.backward())
            for _ in range(2):  # DDP rebuilds its buckets after the first step
                steps[name]()
        ops = pre_reduction.ops_per_step(steps)
        gradients = sum(1 for p in unet.parameters())
    finally:
        for tdbg in debuggers:
            tdbg.close()
        if started:
            dist.destroy_process_group()
            sys.excepthook = hook
    buckets = ops["added_by_op"]["aten.aminmax.default"]
    assert buckets == 2  # DDP's first bucket (1 MB) and the rest of the 4.2 MB of gradients
    assert ops["fewer_by_op"] == {"aten.mul.out": gradients}  # DDP's built-in copy scales each gradient
    assert ops["added_by_op"] == {
        "aten.copy_.default": gradients,  # the hook's path copies each gradient into its bucket
        "aten.aminmax.default": buckets,  # the check: one pass per bucket
        "aten.sub.Tensor": buckets,
        "aten.add.Tensor": buckets,  # (the unchecked step's flag is a made-once constant: no op)
        "aten.div_.Tensor": buckets,  # the hook divides the bucket by the world size
        "aten.zeros.default": 1,  # the step's sum
        "aten.abs.default": 1,  # the step's flag: ~isfinite(sum), as float64
        "aten.ne.Scalar": 1,
        "aten.eq.Tensor": 1,
        "aten.mul.Tensor": 1,
        "aten.bitwise_not.default": 1,
        "aten._to_copy.default": 1,
    }
    assert ops["added_ops_per_step"] == 15  # 14 while the unchecked step made its flag with an add


def test_the_sd15_shaped_proxy_runs_quiet_at_the_default_and_its_epsilon_twin_diverges_at_step_6(tmp_path):
    """The GPU-shaped proxy's clean runs are quiet, so its timings are not a warning's cost: a
    default-mode watched 20-step fp16 call with CFG and its 1-step call record no anomaly, and the
    latents keep the std a trained model's have (0.9-1.0 at every step; v-prediction, whose random
    output of about 0.3 leaves the latents as unit-variance data would). The reference: the same
    weights under SD1.5's epsilon prediction, where that output reads as "no noise left" and DDIM
    blows the latents up, is named at its step (step 6 of 20, std about 4.2 against 1)."""
    import torch

    from benchmarks.models import sd15_shaped_pipeline
    from diffusion_debug import DebugConfig, DiffusionModelDebugger

    pipe = sd15_shaped_pipeline(torch.float16)
    assert pipe.scheduler.config.prediction_type == "v_prediction"
    epsilon = copy.copy(pipe)
    epsilon.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, prediction_type="epsilon")

    def watched(p, steps, **call):
        stds = []

        def std(_, i, t, values):
            stds.append(values["latents"].float().std().item())
            return values

        config = DebugConfig(output_dir=str(tmp_path / f"{steps}-{len(call)}"), log_level="error")
        with DiffusionModelDebugger(p, config) as dbg:
            p("a photo of a cat", num_inference_steps=steps, generator=torch.Generator().manual_seed(0),
              callback_on_step_end=std, **call)  # fmt: skip
        return dbg.report().anomalies, stds

    found, stds = watched(pipe, 20)
    assert found == [] and len(stds) == 20
    assert all(0.85 < s < 1.05 for s in stds), stds
    found, _ = watched(call_cost.one_step(pipe), 1, guidance_scale=0.0)  # the component split's call
    assert found == []
    found, stds = watched(epsilon, 20)
    assert [(a.kind, a.severity, a.step) for a in found] == [("latent_divergence", "warning", 6)]
    assert 4.0 < found[0].details["std"] < 4.4 and found[0].details["expected_std"] == 1.0
    assert stds[-1] > 10  # the latents' std at the end, where the check warned once


def test_the_user_paths_compiled_part_counts_no_graph_break_and_no_recompile(tmp_path, monkeypatch):
    """The proxy's compiled row (``--parts compiled``), on the tiny fp16 pipeline so that dynamo
    traces in seconds: the plain compiled call against the watched one, and dynamo's counters
    added while watched: no graph break and no graph compiled after the plain call's (DESIGN)."""
    from diffusion_debug.testing import tiny_pipeline

    monkeypatch.setattr(user_path, "sd15_shaped_pipeline", lambda dtype: tiny_pipeline("sd", dtype=dtype))
    with harness.smoke_warm_ups():  # counts, not figures: one warm-up round, none more to settle
        users = user_path.run(str(tmp_path), steps=2, compiled_rounds=2, parts=("compiled",), dtypes=("fp16",))
    assert list(users.compiled) == ["fp16"] and not users.features and not users.counts
    table = users.compiled["fp16"]
    assert list(table.times) == ["plain compiled", "watched"] and table.clock == "cpu"
    assert all(len(times) == 2 for times in table.times.values())
    assert users.dynamo == {"fp16": {"added_graph_breaks": 0, "added_graphs": 0}}
    text = users.markdown()
    assert "| SD1.5-shaped fp16, 64x64, UNet compiled (aot_eager), 2 steps | median CPU s |" in text
    assert "Dynamo's counters, added by the watched calls: fp16: graph breaks 0, graphs (recompiles) 0." in text
    assert "fp16 compiled: no graph break, no recompile: met" in text


def _hooks(model) -> int:
    """Forward hooks and pre-hooks on every module of ``model``, and its parameters' grad hooks."""
    modules = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    return modules + sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def test_the_gpu_runs_training_case_times_its_plain_steps_with_no_debugger_attached(tmp_path, monkeypatch):
    # benchmarks.gpu's training case (one UNet: the debugger detached for the plain cases) and
    # user_path's (twins) share benchmarks.training's step; a plain step runs with none of the
    # debugger's hooks on the model, a watched one with the OOM watch's, and the round after
    # attaching is untimed (the backward-order hooks' one backward)
    from benchmarks import gpu, training

    seen: list[tuple[str, int, bool]] = []
    call = training.AccelerateStep.__call__

    def recording(self, debugger=None):
        seen.append(("watched" if debugger is not None else "plain", _hooks(self.model), torch.is_anomaly_enabled()))
        return call(self, debugger)

    monkeypatch.setattr(training.AccelerateStep, "__call__", recording)
    setup = gpu.make_setup(smoke=True, out=str(tmp_path))
    table = gpu.training(setup, "no", repeats=2)
    assert list(table.times) == ["plain", training.WATCHED, training.ANOMALY_MODE]
    assert all(len(times) == 2 for times in table.times.values())
    # warm-up round then two timed ones; each watched case: one untimed step after attaching, then the timed one
    kinds = [(kind, anomaly) for kind, _, anomaly in seen]
    assert kinds == [("plain", False), ("watched", False), ("watched", False), ("plain", True)] * 3
    assert {hooks for kind, hooks, _ in seen if kind == "plain"} == {0}
    watched = [hooks for kind, hooks, _ in seen if kind == "watched"]
    assert all(hooks > 0 for hooks in watched)
    # the first monitored step after attaching carries the backward-order hooks; they are off for the timed one
    assert watched[0::2] == [watched[0]] * 3 and watched[1::2] == [watched[1]] * 3 and watched[0] > watched[1]


def test_the_call_parts_timer_sees_each_part_as_often_as_a_1_step_call_runs_it_and_takes_itself_off():
    """``benchmarks.call_parts`` times a reused debugger's 1-step call by part: each part is seen
    as often as the call runs it (one attach, one scheduler.step, four component calls: the text
    encoder, the UNet, the VAE's two halves; three of them checked on their own), and its timing
    wrappers are gone after."""

    def timed_functions():  # every part's function as its owner holds it
        found = []
        for _, spec in call_parts.PARTS:
            module, qualname = spec.split(":")
            *path, name = qualname.split(".")
            owner = importlib.import_module(module)
            for part in path:
                owner = getattr(owner, part)
            found.append(owner.__dict__[name])
        return found

    before = timed_functions()
    found = call_parts.measure(rounds=2)
    calls = {label.strip(): calls for label, (_, calls) in found["parts"].items()}
    assert calls["attach"] == calls["detach"] == calls["tree walk (TreeMemo.refresh)"] == 1
    assert calls["scheduler.step"] == calls["step read, checked, written"] == 1
    assert (calls["component call starts"], calls["text encoder / VAE output checks"]) == (4, 3)
    # fp32 components get no sentinel: no block hook, no fused flush
    assert calls["sentinel block hooks (all)"] == calls["fused abs-max flushes (all)"] == 0
    # step_values.measure_call is two parts' (as call_events' rows.measure_call too): its wrappers
    # came off in the order they went on, which left the first on it, one more Python call in every
    # later watched call of the process (the pinned count read 212 after this test and the next)
    assert [a is b for a, b in zip(timed_functions(), before)] == [True] * len(before)


def test_the_call_parts_timer_counts_the_fp16_sentinel_by_block_and_by_flush():
    """In fp16 the sentinel reads block outputs (18 hooks a 1-step call of the tiny pipeline: the UNet 7, the
    text encoder twice 2 (its layer stack read at its last layer, and its final_layer_norm since vae36), the VAE
    decode 7 (its blocks and, since vae36, its conv_norm_out and conv_out); 14 before vae36; 24 while each mid
    block's resnets and attentions were blocks of their own and the UNet's conv_in and conv_norm_out and the text
    encoder's embeddings were watched) and reduces them in
    one fused flush per component call, the text encoder's two calls (the prompt and the negative
    prompt) in one (3: the text encoder, the UNet, the VAE decoder; 4 while each encoder call was read
    on its own), each probe's values taken once a call (3 takes: the text encoder's as its calls are
    read together, the VAE's at its output check, the UNet's at the step; 5 while a step took every
    probe, also those holding nothing, and 6 before that), and the two encoder calls read together
    once, in one host read. Counted on a call that reads every group of sentinels (the UNet's step 0,
    the VAE's and the text encoder's calls: a debugger's 2nd, ``call_parts`` sets its pace back to it);
    from the 3rd each group reads runs of its own (``components.sentinel_pace``: 7, 7 or 4 of the 18,
    or none)."""
    found = call_parts.measure(torch.float16, rounds=1)
    calls = {label.strip(): calls for label, (_, calls) in found["parts"].items()}
    assert calls["sentinel block hooks (all)"] == 18
    assert calls["fused abs-max flushes (all)"] == calls["reductions (_absmaxes)"] == 3
    assert calls["probe takes (all)"] == calls["held takes"] == 3
    assert calls["encoder calls read together"] == calls["host reads (encoder calls' read_now)"] == 1


def test_call_instructions_reads_each_dump_by_its_dtype_and_kind(tmp_path):
    """``benchmarks.call_instructions`` (run under valgrind, not here) labels each counted call's dump
    ``dtype:kind-i`` and reads its ``totals:`` line: the added figure is the fewest watched minus the
    fewest plain, per dtype; the program's own end-of-run dump (no client request) is left out."""
    from benchmarks import call_instructions

    dumps = {
        "1": ("fp16:plain-0", 961_400_000),
        "2": ("fp16:unread-1", 967_200_000),
        "3": ("fp16:plain-2", 961_380_000),
        "4": ("fp32:unread-1", 133_500_000),
    }
    for suffix, (label, total) in dumps.items():
        text = f"desc: Timerange: Basic block 0 - 9\ndesc: Trigger: Client Request: {label}\nsummary: 1\n"
        (tmp_path / f"callgrind.out.7.{suffix}").write_text(text + f"fn=(1) f\n0 5\ntotals: {total}\n")
    (tmp_path / "callgrind.out.7").write_text("desc: Trigger: Program termination\ntotals: 10\n")
    found = call_instructions._read_dumps(tmp_path)
    assert found == {
        "fp16": {"plain": [961_400_000, 961_380_000], "unread": [967_200_000]},
        "fp32": {"unread": [133_500_000]},
    }


def test_the_training_ab_help_says_what_it_compares_in_a_whole_sentence(capsys):
    from benchmarks import training_ab

    with pytest.raises(SystemExit):
        training_ab.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "An A/B of the SD1.5-shaped Accelerate training step (``benchmarks.user_path``'s training rows) between "
        "this checkout's debugger and another checkout's, in one process:" in text
    )
