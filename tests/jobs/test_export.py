"""``diffusion-debug export`` and ``DebugReport.to_pandas()``: a run's steps, anomalies and
per-rank rows as tables whose cells are the values of the saved JSON record."""

from __future__ import annotations

import csv
import json
import math
import sys

import pytest
import torch
from torch import nn

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.cli import main
from diffusion_debug.core import DebugReport
from diffusion_debug.record import load_run
from diffusion_debug.record.tables import rank_rows

# one worker under pytest -n 2 --dist loadgroup: the module's `inference_run` and `training_run` are made once
pytestmark = pytest.mark.xdist_group("export")


def _naive_flat(row, prefix=""):
    """The reference: nested dicts as dotted names, lists and per-module dicts as JSON text."""
    out = {}
    for key, value in row.items():
        per_module = ("top_module_grad_norms", "bottom_module_grad_norms", "module_grad_norms", "details")
        if isinstance(value, dict) and key not in per_module:
            out.update(_naive_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = json.dumps(value) if isinstance(value, (dict, list)) else value
    return out


def _cell(value):
    return "" if value is None else str(value)


def _read_csv(path):
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


@pytest.fixture(scope="module")
def inference_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("inference")
    assert main(["run", "--steps", "2", "--output-dir", str(out), "--quiet"]) == 0
    (run_dir,) = out.iterdir()
    return run_dir


@pytest.fixture(scope="module")
def training_run(tmp_path_factory):
    """Three monitored steps of a small MLP, a NaN gradient planted at step 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = DebugConfig(output_dir=str(tmp_path_factory.mktemp("training")))
    tdbg = TrainingDebugger(model, config=config)
    for step in range(3):
        loss = model(torch.randn(2, 4)).pow(2).mean()
        loss.backward()
        if step == 1:
            model[0].weight.grad[0, 0] = float("nan")
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        optimizer.zero_grad()
    run_dir = tdbg.report().save(html=False)  # the tables are read from summary.json and the events
    tdbg.close()
    return run_dir


def test_csv_steps_hold_the_json_record_cell_for_cell(capsys, inference_run, tmp_path):
    assert main(["export", str(inference_run), "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / f"{t}.csv") for t in ("steps", "anomalies", "ranks")]
    steps = load_run(inference_run).steps
    rows = _read_csv(tmp_path / "steps.csv")
    assert len(rows) == len(steps) == 2
    for row, saved in zip(rows, steps):
        expected = _naive_flat(saved)
        assert list(row) == list(expected)
        assert row == {column: _cell(value) for column, value in expected.items()}
        assert float(row["latents.std"]) == saved["latents"]["std"]  # floats read back to the same value
        assert float(row["model_output.l2"]) == saved["model_output"]["l2"]


def test_csv_anomalies_and_training_ranks(capsys, training_run):
    assert main(["export", str(training_run)]) == 0  # into the run directory
    run = load_run(training_run)
    assert capsys.readouterr().out.split() == [str(training_run / f"{t}.csv") for t in ("steps", "anomalies", "ranks")]
    anomalies = _read_csv(training_run / "anomalies.csv")
    assert [(a["kind"], a["step"], a["rank"], a["parameter"]) for a in anomalies] == [
        (a.kind, _cell(a.step), _cell(a.rank), _cell(a.parameter)) for a in run.anomalies
    ]
    assert json.loads(anomalies[0]["details"]) == run.anomalies[0].details
    ranks = _read_csv(training_run / "ranks.csv")
    assert [(r["step"], r["rank"], r["loss"], r["grad_norm"]) for r in ranks] == [
        (str(s["step"]), "0", _cell(s["loss"]), _cell(s["grad_norm"])) for s in run.steps
    ]
    assert ranks[1]["grad_norm"] == "nan"  # the planted NaN gradient, as the JSON record writes it


def test_csv_training_steps_keep_each_per_module_dict_in_one_cell(capsys, training_run, tmp_path):
    assert main(["export", str(training_run), "--out", str(tmp_path)]) == 0
    steps = load_run(training_run).steps
    assert all(step["top_module_grad_norms"] and step["bottom_module_grad_norms"] for step in steps)
    rows = _read_csv(tmp_path / "steps.csv")
    assert not [column for column in rows[0] if "module_grad_norms." in column]  # no column per module
    for row, saved in zip(rows, steps):
        expected = _naive_flat(saved)
        assert set(expected) <= set(row)  # a column another step has is empty here
        assert row == {column: _cell(expected.get(column)) for column in row}
        assert json.loads(row["bottom_module_grad_norms"]) == saved["bottom_module_grad_norms"]


@pytest.mark.parametrize(
    "out, message",
    [
        ("afile", "--out '{tmp}/afile' is not a folder: a file of that name exists."),
        ("afile/tables", "--out '{tmp}/afile/tables' cannot be made: '{tmp}/afile' is a file."),
    ],
)
def test_an_out_that_cannot_hold_the_tables_is_one_line_and_exit_2(capsys, monkeypatch, tmp_path, out, message):
    (tmp_path / "afile").write_text("mine\n")
    import diffusion_debug.record as record  # export imports it when it runs (the command line stays light)

    monkeypatch.setattr(record, "load_run", lambda run_dir: pytest.fail("the run was read before --out was checked"))
    assert main(["export", str(tmp_path / "no-run"), "--out", str(tmp_path / out)]) == 2
    assert capsys.readouterr().err == f"diffusion-debug export: error: {message.format(tmp=tmp_path)}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"] and (tmp_path / "afile").read_text() == "mine\n"


def test_an_empty_table_is_written_as_its_header_over_another_runs_table(capsys, training_run, tmp_path):
    assert main(["export", str(training_run), "--out", str(tmp_path)]) == 0
    assert len(_read_csv(tmp_path / "ranks.csv")) == 3 and _read_csv(tmp_path / "anomalies.csv")
    clean = tmp_path / "clean"
    clean.mkdir()
    (clean / "summary.json").write_text(json.dumps({"kind": "diffusion", "anomalies": [], "steps": [{"step": 0}]}))
    assert main(["export", str(clean), "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.split()[-2:] == [str(tmp_path / "anomalies.csv"), str(tmp_path / "ranks.csv")]
    assert (tmp_path / "ranks.csv").read_text() == "step,rank,loss,grad_norm\n"
    assert (tmp_path / "anomalies.csv").read_text() == (
        "kind,severity,component,module,parameter,step,timestep,rank,message,details\n"
    )
    pandas = pytest.importorskip("pandas", reason="pandas is not installed (an optional dependency)")
    assert list(pandas.read_csv(tmp_path / "ranks.csv").columns) == ["step", "rank", "loss", "grad_norm"]
    pytest.importorskip("pyarrow", reason="pyarrow is not installed (an optional dependency)")
    assert main(["export", str(clean), "--format", "parquet", "--out", str(tmp_path)]) == 0
    ranks = pandas.read_parquet(tmp_path / "ranks.parquet")
    assert list(ranks.columns) == ["step", "rank", "loss", "grad_norm"] and len(ranks) == 0
    # to_pandas of an empty table has the same columns as the header-only export
    empty = load_run(clean)
    report = DebugReport(run_dir=clean, summary={}, anomalies=empty.anomalies, steps=empty.steps)
    assert list(report.to_pandas("ranks").columns) == ["step", "rank", "loss", "grad_norm"]
    assert len(report.to_pandas("anomalies")) == 0 and "details" in report.to_pandas("anomalies").columns


def test_rank_rows_take_each_ranks_values_from_the_step_lists():
    steps = [
        {
            "step": 0,
            "rank": 0,
            "loss": 1.0,
            "grad_norm": 2.0,
            "losses_by_rank": [1.0, "nan"],
            "grad_norms_by_rank": [2.0, 3.0],
        },
        {"step": 1, "rank": 0, "loss": 0.5, "grad_norm": 1.0},
    ]
    assert [tuple(r.values()) for r in rank_rows(steps)] == [(0, 0, 1.0, 2.0), (0, 1, "nan", 3.0), (1, 0, 0.5, 1.0)]
    assert rank_rows([{"step": 0, "latents": {"std": 1.0}}]) == []  # an inference run has no ranks


def test_parquet_without_pyarrow_is_one_line_and_exit_2(capsys, monkeypatch, inference_run, tmp_path):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed: its import fails
    assert main(["export", str(inference_run), "--format", "parquet", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err == (
        "diffusion-debug export: error: --format parquet needs pyarrow, which is not installed here: "
        "pip install pyarrow (or use --format csv).\n"
    )
    assert not (tmp_path / "x").exists()


def test_parquet_steps_equal_the_json_record(capsys, training_run, tmp_path):
    parquet = pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed (an optional dependency)")
    assert main(["export", str(training_run), "--format", "parquet", "--out", str(tmp_path)]) == 0
    table = parquet.read_table(tmp_path / "steps.parquet").to_pylist()
    steps = load_run(training_run).steps
    assert [row["step"] for row in table] == [s["step"] for s in steps]
    assert table[0]["loss"] == steps[0]["loss"] and table[0]["memory.rss_mb"] == steps[0]["memory"]["rss_mb"]
    assert math.isnan(table[1]["grad_norm"]) and steps[1]["grad_norm"] == "nan"  # a float again


def test_to_pandas_without_pandas_names_the_package(monkeypatch, training_run):
    from diffusion_debug.core import DebugReport

    run = load_run(training_run)
    report = DebugReport(run.run_dir, run.summary, run.anomalies, run.steps)
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match=r"^to_pandas\(\) needs pandas, which is not installed here: pip install"):
        report.to_pandas()
    with pytest.raises(ValueError, match="table 'rows' is not one of steps, anomalies, ranks"):
        report.to_pandas("rows")


def test_to_pandas_steps_and_anomalies(training_run):
    pytest.importorskip("pandas", reason="pandas is not installed (an optional dependency)")
    from diffusion_debug.core import DebugReport

    run = load_run(training_run)
    report = DebugReport(run.run_dir, run.summary, run.anomalies, run.steps)
    steps = report.to_pandas()
    assert list(steps["step"]) == [0, 1, 2] and steps["loss"].tolist() == [s["loss"] for s in run.steps]
    assert math.isnan(steps["grad_norm"][1]) and steps["memory.rss_mb"][0] == run.steps[0]["memory"]["rss_mb"]
    anomalies = report.to_pandas("anomalies")
    assert list(anomalies["kind"]) == [a.kind for a in run.anomalies]


def test_csv_cells_that_start_like_a_formula_get_a_quote_and_numbers_stay_numbers(capsys, tmp_path):
    """A user's module named like a formula, and a crafted summary.json's message and component:
    no cell of the CSV starts with = + - @ unless it is a number (DESIGN: exports are safe to open)."""
    model = nn.Sequential()
    model.add_module("=HYPERLINK(1)", nn.Linear(4, 1))
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path / "runs")))
    loss = model(torch.randn(2, 4)).pow(2).mean()
    loss.backward()
    model[0].weight.grad[0, 0] = float("nan")
    tdbg.monitor_training_step(loss, step=0)
    run_dir = tdbg.report().save(html=False)
    tdbg.close()
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["anomalies"][0].update(message="+cmd|' /C calc'!A0", component="@SUM(A1)", timestep=-1.5)
    (run_dir / "summary.json").write_text(json.dumps(summary))

    assert main(["export", str(run_dir), "--out", str(tmp_path / "out")]) == 0
    (row,) = _read_csv(tmp_path / "out" / "anomalies.csv")
    assert (row["module"], row["parameter"], row["message"], row["component"], row["timestep"]) == (
        "'=HYPERLINK(1)",
        "'=HYPERLINK(1).weight",
        "'+cmd|' /C calc'!A0",
        "'@SUM(A1)",
        "-1.5",
    )
    steps = _read_csv(tmp_path / "out" / "steps.csv")
    assert steps[0]["grad_norm"] == "nan"
    for table in ("steps", "anomalies", "ranks"):
        with open(tmp_path / "out" / f"{table}.csv", newline="", encoding="utf-8") as handle:
            cells = [cell for line in csv.reader(handle) for cell in line]
        risky = [c for c in cells if c[:1] in ("=", "+", "-", "@") and c not in ("-inf",)]
        assert [c for c in risky if not _is_number_text(c)] == []


def _is_number_text(cell):
    try:
        float(cell)
    except ValueError:
        return False
    return True


def _events(path, rank, rows):
    """An event file as a rank streams it: its start event, then its step rows."""
    lines = [{"time": 0.0, "rank": rank, "type": "start", "kind": "training"}]
    lines += [{"time": 1.0, "type": "step", **row} for row in rows]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_every_rank_and_step_is_exported_from_the_event_files_whatever_summary_json_keeps(tmp_path):
    # summary.json keeps rank 0's steps and the one step of rank 1 it exchanged details on; rank 1's
    # own file holds all its steps; rank 2 wrote no file: the main's copies of its rows stand for it
    def row(step, rank):
        return {"step": step, "rank": rank, "loss": 10 * rank + step, "grad_norm": 1.0, "learning_rates": [0.1]}

    kept = [row(s, 0) for s in range(4)] + [row(2, 1), row(2, 2)]
    summary = {"kind": "training", "anomalies": [], "steps": kept, "world_size": 3}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    _events(tmp_path / "events.jsonl", 0, kept)
    _events(tmp_path / "events-rank1.jsonl", 1, [row(s, 1) for s in range(4)])
    assert main(["export", str(tmp_path)]) == 0
    ranks = [(int(r["step"]), int(r["rank"]), float(r["loss"])) for r in _read_csv(tmp_path / "ranks.csv")]
    expected = [(s, 0, float(s)) for s in range(4)] + [(s, 1, 10.0 + s) for s in range(4)] + [(2, 2, 22.0)]
    assert ranks == sorted(expected)
    assert len(_read_csv(tmp_path / "steps.csv")) == 9  # the steps table: the same rows, all their columns
    assert load_run(tmp_path).steps == [row(s, 0) for s in range(4)]  # the main process's own, one a step
    assert load_run(tmp_path).rank_steps == sorted(
        [row(s, 0) for s in range(4)] + [row(s, 1) for s in range(4)] + [row(2, 2)],
        key=lambda r: (r["step"], r["rank"]),
    )
