"""Per-module gradient health (issue 21, item 4): every module's gradient norm kept in bounded form
(the module x step map, each module's history, the step's smallest modules), a block whose
gradients fall x1e-12 named at the step it became clear, and the report's map showing it."""

import functools
import json
import math

import numpy as np
import pytest
import torch

from diffusion_debug import DebugConfig
from diffusion_debug.record import severity_rank
from diffusion_debug.report.plots import TRAINING_PLOTS
from diffusion_debug.report.plots_modules import block_rows, module_map_plot
from diffusion_debug.training.judges.module_health import DEAD_STEPS, StepHeat
from diffusion_debug.training.measure.gradients import TrainableParameters

DEAD_FROM = 4
STEPS = 10
# one worker under -n 2 --dist loadgroup: the module's `dead_block_run` (a 10-step run) is made once
pytestmark = pytest.mark.xdist_group("module_health")


@pytest.fixture(scope="module")
def dead_block_run(tmp_path_factory, unet_loop):
    """down_blocks.0's gradients x1e-12 from step 4 on, with every module's true norm per step."""
    truth: dict[int, dict[str, float]] = {}

    def plant(step, unet, optimizer):
        if step >= DEAD_FROM:
            for p in unet.down_blocks[0].parameters():
                p.grad.mul_(1e-12)
        params = TrainableParameters.of(unet)
        squares: dict[str, float] = {}
        for name, p in zip(params.names, params.params):
            module = name.rpartition(".")[0]
            squares[module] = squares.get(module, 0.0) + p.grad.double().square().sum().item()
        truth[step] = {m: math.sqrt(v) for m, v in squares.items()}

    config = DebugConfig(output_dir=str(tmp_path_factory.mktemp("dead")), log_level="error", memory_tracking=False)
    torch.set_flush_denormal(True)  # AdamW's moments of 1e-12 gradients are denormal: slow on CPU
    try:
        tdbg, _ = unet_loop(config, STEPS, plant=plant)
    finally:
        torch.set_flush_denormal(False)
    run_dir = tdbg.report().save(html=False)  # the map plot is drawn below from summary.json alone
    summary = json.loads((run_dir / "summary.json").read_text(), parse_constant=_refuse)
    return tdbg, truth, summary, run_dir


def summary_map(run):
    return run[2]["components"]["model"]["module_grad_map"]


def _refuse(name):
    raise ValueError(name)


def test_a_block_whose_gradients_fall_x1e_12_is_named_at_the_step_it_became_clear(dead_block_run):
    tdbg, truth, _, _ = dead_block_run
    (found,) = [a for a in tdbg.report().anomalies if severity_rank(a.severity) >= 1]
    became_clear = DEAD_FROM + DEAD_STEPS - 1
    assert (found.kind, found.module, found.step, found.component) == (
        "gradient_vanishing",
        "down_blocks.0",
        became_clear,
        "model",
    )
    block = sorted(m for m in truth[0] if m.startswith("down_blocks.0."))
    d = found.details
    assert (d["reason"], d["modules"], d["since_step"], d["steps"]) == ("module", len(block), DEAD_FROM, DEAD_STEPS)
    assert d["dead_modules"] == [m for m in truth[0] if m.startswith("down_blocks.0.")][:5]
    norms = truth[became_clear]
    assert d["log10_grad_norm"] == pytest.approx(np.median([math.log10(norms[m]) for m in block]), abs=1e-6)
    measured = [v for v in np.array(summary_map(dead_block_run)["log10"])[:, became_clear] if v > -30]
    assert d["peers_log10"] == pytest.approx(np.median(measured), abs=0.011)  # the positive measured norms
    assert 11.5 < d["orders_below_history"] < 12.5 and d["orders_below_peers"] > 10
    assert found.message.startswith(
        f"The gradients of down_blocks.0 ({len(block)} modules) fell to 1e{d['log10_grad_norm']:.0f} at step "
        f"{became_clear}, {d['orders_below_peers']:.0f} orders of magnitude below the other modules"
    )
    assert tdbg.get_summary()["gradient_vanishing"] == 0  # the global norm stayed normal


def test_every_module_is_kept_in_the_map_and_each_step_records_its_smallest(dead_block_run):
    tdbg, truth, summary, _ = dead_block_run
    model = summary["components"]["model"]
    saved = model["module_grad_map"]
    assert saved["modules"] == list(truth[0]) and len(saved["modules"]) == 164
    assert saved["steps"] == [[s, s] for s in range(STEPS)]  # fewer steps than columns: one each
    for i, module in enumerate(saved["modules"]):
        for step in range(STEPS):
            value, norm = saved["log10"][i][step], truth[step][module]
            if norm > 1e-15:
                assert value == pytest.approx(math.log10(norm), abs=0.011), (module, step)
            else:  # float32 norms: squares below ~1e-38 underflow, and a zero norm is kept as -30
                assert value < -14, (module, step)
    assert set(model["dead_modules"]) == {m for m in truth[0] if m.startswith("down_blocks.0.")}
    for row in tdbg.report().steps[DEAD_FROM:]:
        bottom = row["bottom_module_grad_norms"]
        smallest = sorted(truth[row["step"]].items(), key=lambda kv: kv[1])[:5]
        assert list(bottom) == [m for m, _ in smallest]
        assert list(bottom.values()) == pytest.approx([v for _, v in smallest], rel=1e-4)


def test_the_report_map_shows_the_dead_block_as_one_dark_row(dead_block_run):
    _, _, summary, _ = dead_block_run
    saved = summary["components"]["model"]["module_grad_map"]
    names, rows = block_rows(saved["modules"], np.array(saved["log10"], dtype=float))
    assert len(names) <= 40 and "down_blocks.0" in names and "up_blocks.1" in names
    dead = names.index("down_blocks.0")
    others = np.delete(rows, dead, axis=0)
    assert (rows[dead, :DEAD_FROM] > others[:, :DEAD_FROM].min(axis=0) - 2).all()  # among its peers before
    assert (rows[dead, DEAD_FROM:] < others[:, DEAD_FROM:].min(axis=0) - 9).all()  # far below all after
    plot = module_map_plot(summary)
    assert (plot.id, plot.png[:8]) == ("plot-module-map", b"\x89PNG\r\n\x1a\n")
    assert module_map_plot in TRAINING_PLOTS


def test_the_clean_loop_of_the_same_shape_has_no_dead_module(tmp_path, unet_loop):
    config = DebugConfig(output_dir=str(tmp_path), log_level="error", memory_tracking=False, stream_events=False)
    tdbg, _ = unet_loop(config, STEPS)
    assert [a for a in tdbg.report().anomalies if severity_rank(a.severity) >= 1] == []
    assert tdbg.report().components["model"]["dead_modules"] == []


def test_the_map_stays_bounded_and_its_merged_columns_are_the_plain_means():
    rng = np.random.default_rng(0)
    logs = rng.normal(-2, 1, size=(2, 100))
    logs[1, 37] = np.nan  # a NaN gradient norm
    heat = StepHeat(2, columns=8)
    for step in range(100):
        heat.add(step, logs[:, step])
    saved = heat.summary(["a", "b"])
    # 100 steps: the width doubled 1 -> 2 -> ... -> 16; 6 full columns of 16 and one of 4
    assert saved["steps"] == [[16 * c, min(16 * c + 15, 99)] for c in range(7)]
    for i in range(2):
        expected = [np.nanmean(logs[i, a : b + 1]) for a, b in saved["steps"]]
        assert saved["log10"][i] == pytest.approx(np.round(expected, 2), abs=0.0051)
    assert saved["nonfinite"] == [[1, 2]]  # step 37 lies in the third column
    assert heat.sums.shape == (2, 8)


def test_a_block_dead_from_the_first_step_is_named_though_it_never_had_a_history(tmp_path, unet_loop):
    """down_blocks.0's gradients x1e-12 from step 0 (a branch detached from the loss from the start):
    no healthy history to fall from, so it is named by how far it sits below its peers."""

    def plant(step, unet, optimizer):
        for p in unet.down_blocks[0].parameters():
            p.grad.mul_(1e-12)

    config = DebugConfig(output_dir=str(tmp_path), log_level="error", memory_tracking=False, stream_events=False)
    torch.set_flush_denormal(True)  # AdamW's moments of 1e-12 gradients are denormal: slow on CPU
    try:
        tdbg, _ = unet_loop(config, STEPS, plant=plant)
    finally:
        torch.set_flush_denormal(False)
    warned = [a for a in tdbg.report().anomalies if severity_rank(a.severity) >= 1]
    (found,) = warned
    assert (found.kind, found.module, found.step) == ("gradient_vanishing", "down_blocks.0", DEAD_STEPS - 1)
    d = found.details
    assert (d["since_step"], d["history_log10"], d["orders_below_history"]) == (0, None, None)
    assert d["orders_below_peers"] > 10
    assert found.message == (
        f"The gradients of down_blocks.0 ({d['modules']} modules) have been 1e{d['log10_grad_norm']:.0f} "
        "since step 0, "
        f"{d['orders_below_peers']:.0f} orders of magnitude below the other modules (1e{d['peers_log10']:.0f}), for "
        f"{DEAD_STEPS} steps from its first: it has never received the loss (a branch detached from the loss or "
        "bypassed from the start, a gradient hook or mask that scales it)."
    )
    assert tdbg.report().components["model"]["dead_modules"][0].startswith("down_blocks.0.")


def test_a_module_the_step_did_not_read_is_neither_low_nor_healthy_nor_nonfinite():
    """Several optimizers (a GAN with 5 discriminator steps per generator step): a step reads the
    modules its optimizer steps, and the others' figures (0.0 here: a masked norm) are no reading.
    The generator is not dead after 5 steps unread, its map shows no NaN/Inf, and its last reading
    is the one of its own step; read as zero (``read`` not given) it is called dead at steps 14 and 20."""
    from diffusion_debug.training.judges.module_health import ModuleHealth

    names = ["generator.0", "generator.2", "discriminator.0", "discriminator.2"]
    generator_step = np.array([True, True, False, False])

    def run(with_read):
        health, dead = ModuleHealth(names), []
        for step in range(24):
            ours = step % 6 == 5
            norms = [0.1, 0.2, 0.0, 0.0] if ours else [0.0, 0.0, 0.3, 0.4]
            read = generator_step if ours else ~generator_step
            dead += [(step, g.name) for g in health.update(step, norms, read if with_read else None)]
        return health, dead

    health, dead = run(with_read=True)
    assert dead == []
    summary = health.summary()
    assert summary["module_grad_map"]["nonfinite"] == []
    assert summary["module_grad_log10_last"] == {
        "generator.0": -1.0,
        "generator.2": round(math.log10(0.2), 2),
        "discriminator.0": round(math.log10(0.3), 2),
        "discriminator.2": round(math.log10(0.4), 2),
    }
    assert run(with_read=False)[1] == [(14, "generator"), (20, "generator")]


@pytest.mark.parametrize("set_to_none", [True, False], ids=["grads-none", "grads-zeroed"])
def test_a_block_the_script_freezes_mid_run_is_not_called_dead(tmp_path, unet_loop, set_to_none):
    """``unet.down_blocks.requires_grad_(False)`` after step 3 (a script that stops training a part):
    its gradients are None from then on (``zero_grad()``) or zeros (``zero_grad(set_to_none=False)``).
    The script froze it: no module of it is read at a step (neither low nor healthy), so no
    ``gradient_vanishing`` (it was called dead at step 6: its None or zero norms read as 1e-30), and
    its map and last reading keep what it had while it trained."""

    def freeze(step, unet, optimizer):
        if step == 3:
            unet.down_blocks.requires_grad_(False)

    def optimizer(unet):
        adamw = torch.optim.AdamW(unet.parameters(), lr=1e-4)
        adamw.zero_grad = functools.partial(adamw.zero_grad, set_to_none=set_to_none)
        return adamw

    config = DebugConfig(output_dir=str(tmp_path), log_level="error", memory_tracking=False, stream_events=False)
    tdbg, _ = unet_loop(config, STEPS, after_step=freeze, optimizer=optimizer)
    assert [(a.kind, a.step, a.module) for a in tdbg.report().anomalies if severity_rank(a.severity) >= 1] == []
    model = tdbg.report().components["model"]
    assert model["dead_modules"] == []
    frozen = [name for name in model["module_grad_log10_last"] if name.startswith("down_blocks.")]
    assert len(frozen) == 44 and all(model["module_grad_log10_last"][name] > -10 for name in frozen)
