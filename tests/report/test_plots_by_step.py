"""The training plots of a multi-rank run: x is the step on every line (one line per rank where the
ranks differ, one where they agree), never a row's position in the table."""

import numpy as np
import pytest

from diffusion_debug.report import plots, plots_training
from diffusion_debug.report.plots import grad_norm_plot, learning_rate_plot, loss_plot, memory_plot


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plots drew (``png`` kept from turning them into bytes)."""
    figures = []

    def keep(fig):
        figures.append(fig)
        return b""

    monkeypatch.setattr(plots_training, "png", keep)
    monkeypatch.setattr(plots, "png", keep)
    return figures


def _lines(figure):
    """Each labelled line: label -> (x, y)."""
    (ax,) = figure.axes[:1]
    return {
        line.get_label(): (line.get_xdata().tolist(), line.get_ydata().tolist())
        for line in ax.get_lines()
        if not line.get_label().startswith("_")
    }


def _summary():
    # rank 1 recorded steps 0-5, rank 0 steps 0-5 (rows interleaved as the record reads them):
    # the lr warms up the same on both ranks, loss and memory differ
    rows = []
    for step in range(6):
        for rank in (0, 1):
            lr = 0.5 * (step + 1)
            memory = {"rss_mb": 100.0 + 10 * rank + step}
            rows.append(
                {"step": step, "rank": rank, "loss": step + rank / 10, "grad_norm": 1.0 + step, "learning_rates": [lr]}
                | {"memory": memory}
            )
    return {"kind": "training", "steps": rows, "anomalies": [], "world_size": 2}


def test_learning_rate_is_one_line_by_step_where_every_rank_has_the_same(drawn):
    learning_rate_plot(_summary())
    assert _lines(drawn[0]) == {"param group 0": ([0, 1, 2, 3, 4, 5], [0.5, 1.0, 1.5, 2.0, 2.5, 3.0])}
    assert drawn[0].axes[0].get_xlim()[1] < 6  # the axis spans the steps, not the 12 rows


def test_learning_rate_differing_by_rank_is_one_line_per_rank(drawn):
    summary = _summary()
    for row in summary["steps"]:
        row["learning_rates"] = [row["learning_rates"][0] * (1 + row["rank"])]
    learning_rate_plot(summary)
    lines = _lines(drawn[0])
    assert lines["param group 0, rank 0"] == ([0, 1, 2, 3, 4, 5], [0.5, 1.0, 1.5, 2.0, 2.5, 3.0])
    assert lines["param group 0, rank 1"] == ([0, 1, 2, 3, 4, 5], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])


def test_loss_grad_norm_and_memory_are_one_line_per_rank_by_step(drawn):
    summary = _summary()
    loss_plot(summary), grad_norm_plot(summary), memory_plot(summary)
    loss, norm, memory = (_lines(f) for f in drawn)
    steps = [0, 1, 2, 3, 4, 5]
    assert loss["loss, rank 0"] == (steps, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    assert loss["loss, rank 1"][0] == steps and np.allclose(loss["loss, rank 1"][1], [s + 0.1 for s in steps])
    assert norm["rank 1"] == (steps, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert memory["process RSS, rank 1"] == (steps, [110.0, 111.0, 112.0, 113.0, 114.0, 115.0])
