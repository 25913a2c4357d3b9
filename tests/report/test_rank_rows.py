"""A saved run of 8 ranks: what every rank found alike is one row naming the ranks, in the terminal
summary and report.html's cards; what one rank found (the NaN rank 5 made) keeps its row, and the
headline still names its rank (diffusion_debug/report/rank_groups.py)."""

from __future__ import annotations

import math

from diffusion_debug.record import dumps, load_run, make_anomaly
from diffusion_debug.report.html_anomalies import anomalies_context
from diffusion_debug.report.terminal import render_terminal

REDUCTION = {"origins": [5], "through": "the gradient all-reduce"}
NAN_GRADS = {"nonfinite_parameters": 1, "grad_norm": math.nan, "order": "registration"}


def _anomalies() -> list:
    """As an 8-rank DDP run saves them: an oversized update every rank applied alike at step 7, a NaN
    gradient rank 5 made at step 9 (the 7 others received it), a NaN loss on every rank at step 12."""
    out = []
    for rank in range(8):
        details = {"reason": "update_ratio", "update_to_weight_ratio": 2.5, "threshold": 1.0}
        out.append(make_anomaly("lr_spike", component="optimizer", module="up.0", step=7, rank=rank, details=details))
    for rank in range(8):
        details = {**NAN_GRADS, "reduction": {**REDUCTION, "made_here": rank == 5}}
        if rank != 5:
            details["follows"] = {"kind": "nonfinite", "rank": 5}
        out.append(make_anomaly("nonfinite", component="model", module="0", parameter="0.weight", step=9, rank=rank,
                                details=details))  # fmt: skip
    for rank in range(8):
        out.append(make_anomaly("nonfinite_loss", component="model", step=12, rank=rank, details={"loss": math.nan}))
    return out


def _run(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    summary = {"kind": "training", "world_size": 8, "anomalies": [a.to_dict() for a in _anomalies()]}
    (run_dir / "summary.json").write_text(dumps(summary), encoding="utf-8")
    return load_run(run_dir)


def test_the_terminal_shows_a_finding_every_rank_made_alike_once_naming_the_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # no message wrapped: one line a row
    lines = render_terminal(_run(tmp_path)).splitlines()
    assert lines[1] == "anomalies: 24"
    rows = [line.split("  ") for line in lines[4:7]]
    rows = [[cell.strip() for cell in row if cell.strip()] for row in rows]
    assert [row[:3] for row in rows] == [
        ["error", "nonfinite", "model 0.weight, step 9, rank 5"],  # made on rank 5: its own row, the others under it
        ["error", "nonfinite_loss", "model, step 12, ranks 0-7"],
        ["warning", "lr_spike", "optimizer up.0, step 7, ranks 0-7"],
    ]
    assert rows[0][3].endswith("7 anomalies follow from it (7 nonfinite).")
    assert rows[1][3].startswith("The loss is nan at step 12 on ranks 0-7; the input batch was not checked")
    assert rows[2][3].startswith("This step's update would move up.0 by 2.5 times its weights")
    assert len(lines) == 7  # nothing more: no row per rank


def test_report_html_gives_one_card_for_the_ranks_and_keeps_the_headline_s_rank(tmp_path):
    context = anomalies_context(_run(tmp_path))
    assert context["verdict"]["text"] == (
        "24 anomalies of 3 kind(s). Most important: nonfinite at model 0.weight, step 9, rank 5; "
        "7 of the others follow from it"
    )
    cards = {group["kind"]: group["cards"] for group in context["groups"]}
    assert [len(cards[kind]) for kind in ("nonfinite", "nonfinite_loss", "lr_spike")] == [1, 1, 1]
    assert cards["nonfinite"][0]["where"][-1] == ("rank", 5, "b")
    assert cards["lr_spike"][0]["where"][-1] == ("ranks", "0-7", "b")
    assert cards["nonfinite_loss"][0]["message"].startswith("The loss is nan at step 12 on ranks 0-7;")
    assert all(group["rows"] == [] for group in context["groups"])  # every card shows its one place


def test_findings_alike_but_for_their_details_keep_a_row_each():
    """Rank 0 saw the oversized update 3 times (the sink folded it: details.count), rank 1 once; the
    message is the same (built at the first one), the findings are not: no row "ranks 0-1" saying
    rank 0's "seen 3 times" for both."""
    from diffusion_debug.report.rank_groups import same_on_ranks

    details = {"reason": "update_ratio", "update_to_weight_ratio": 2.5, "threshold": 1.0}
    folded_3 = make_anomaly("lr_spike", component="optimizer", module="up.0", step=7, rank=0,
                            details={**details, "count": 3, "last_step": 20})  # fmt: skip
    once = make_anomaly("lr_spike", component="optimizer", module="up.0", step=7, rank=1, details=dict(details))
    assert folded_3.message == once.message
    shown = same_on_ranks([(folded_3, []), (once, [])])
    assert [(a.rank, a.message) for a, _ in shown] == [(0, folded_3.message), (1, once.message)]
    alike = make_anomaly("lr_spike", component="optimizer", module="up.0", step=7, rank=2, details=dict(details))
    assert [a.where(True) for a, _ in same_on_ranks([(once, []), (alike, [])])] == [
        "optimizer up.0, step 7, ranks 1-2"
    ]


def test_details_with_keys_of_several_types_are_grouped_without_raising():
    from diffusion_debug.record import Anomaly
    from diffusion_debug.report.rank_groups import same_on_ranks

    rows = [
        Anomaly("lr_spike", "warning", "x.", "optimizer", step=1, rank=r, details={1: "a", "b": 2}) for r in (0, 1)
    ]
    assert [a.where(True) for a, _ in same_on_ranks([(a, []) for a in rows])] == ["optimizer, step 1, ranks 0-1"]
