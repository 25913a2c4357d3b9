"""Saved runs a hostile or broken writer left: a message of megabytes, a start time no clock can
show, values at the float's limits. ``report`` reads each in time linear in its size, says
"unknown" for what it cannot show, and prints nothing but its own output (issue 24)."""

from __future__ import annotations

import json
import re
import warnings

from diffusion_debug.cli import main
from diffusion_debug.record import Anomaly, dumps
from diffusion_debug.report.terminal import CELL_CHARS, anomaly_table, table
from diffusion_debug.report.text import HTML_MESSAGE_CHARS, TERMINAL_MESSAGE_CHARS, cut, local_time

MESSAGE_CHARS = 3_000_000  # a few MB: unbounded textwrap took seconds on 1 MB and minutes on 50 MB


def _write_run(path, summary):
    path.mkdir(parents=True, exist_ok=True)
    (path / "summary.json").write_text(dumps(summary), encoding="utf-8")
    return path


def _long_anomaly(text: str) -> dict:
    return Anomaly("nonfinite", "error", text, component="unet", module="mid_block", step=3).to_dict()


def test_cut_keeps_the_head_and_says_how_much_is_left():
    assert cut("abc", 3) == "abc"
    assert cut("abcdef", 3) == "abc… 3 more characters"
    assert cut("", 0) == ""


def test_the_terminal_wraps_at_most_the_bounded_head_of_a_long_message():
    text = anomaly_table([Anomaly("nonfinite", "error", "x" * MESSAGE_CHARS, "unet", "mid_block", step=3)], width=100)
    lines = text.splitlines()
    assert lines[2].startswith("error     nonfinite  unet mid_block, step 3  x")
    column = lines[0].index("message")  # 100 columns: the message is wrapped at 100 - 22 - 32 = 46
    full, rest = divmod(TERMINAL_MESSAGE_CHARS, 46)
    assert [line[column:] for line in lines[2:]] == ["x" * 46] * full + [
        "x" * rest + f"… {MESSAGE_CHARS - TERMINAL_MESSAGE_CHARS} more",
        "characters",
    ]


def test_an_unwrapped_cell_is_cut_too():
    assert table(["kind"], [["k" * 10_000]]).splitlines() == [
        "kind",
        "-" * (CELL_CHARS + len("… 9800 more characters")),
        "k" * CELL_CHARS + "… 9800 more characters",
    ]


def test_report_on_a_run_with_a_message_of_megabytes(tmp_path, capsys):
    run_dir = _write_run(tmp_path / "long", {"kind": "diffusion", "anomalies": [_long_anomaly("Ж" * MESSAGE_CHARS)]})
    assert main(["report", str(run_dir)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.count("Ж") == TERMINAL_MESSAGE_CHARS
    assert f"… {MESSAGE_CHARS - TERMINAL_MESSAGE_CHARS} more characters" in " ".join(out.split())
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    box = (
        "<div class='message'>"
        + "Ж" * HTML_MESSAGE_CHARS
        + f"… {MESSAGE_CHARS - HTML_MESSAGE_CHARS} more characters</div>"
    )
    assert page.count(box) == 1 and page.count("Ж" * HTML_MESSAGE_CHARS) == 1
    assert re.search(r"\.message\{max-height:[^}]*overflow:auto", page)  # the box scrolls
    # the saved message is untouched
    assert json.loads((run_dir / "summary.json").read_text())["anomalies"][0]["message"] == "Ж" * MESSAGE_CHARS


def test_a_killed_runs_long_message_is_cut_the_same_way(tmp_path, capsys):
    run_dir = tmp_path / "killed"
    run_dir.mkdir()
    rows = [
        {"type": "start", "kind": "training", "time": 1.0},
        {"type": "anomaly", **_long_anomaly("Ф" * MESSAGE_CHARS)},
    ]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["report", str(run_dir), "--no-html"]) == 0
    out = capsys.readouterr().out
    assert out.count("Ф") == TERMINAL_MESSAGE_CHARS and "incomplete" in out.lower()


def test_a_short_message_is_shown_whole_in_its_box(tmp_path):
    anomaly = Anomaly("nonfinite", "error", "Inf <produced>.", component="unet", module="mid_block", step=3)
    run_dir = _write_run(tmp_path / "run", {"kind": "diffusion", "anomalies": [anomaly.to_dict()]})
    assert main(["report", str(run_dir)]) == 0
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    assert "<div class='message'>Inf &lt;produced&gt;.</div>" in page


def test_a_time_no_clock_can_show_reads_unknown():
    assert local_time(0.0).startswith("1970-01-0")  # 1969-12-31 west of Greenwich
    for value in (1e300, -1e300, float("inf"), float("nan"), "soon", None, True):
        assert local_time(value) == "unknown"


def test_report_on_a_start_time_of_1e300_says_unknown(tmp_path, capsys):
    saved = _write_run(tmp_path / "saved", {"kind": "diffusion", "started": 1e300, "anomalies": []})
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / "events.jsonl").write_text('{"type": "start", "kind": "training", "time": 1e400}\n')  # reads as inf
    for run_dir in (saved, killed):
        assert main(["report", str(run_dir)]) == 0
        assert capsys.readouterr().err == ""
        assert "started <b>unknown</b>" in (run_dir / "report.html").read_text(encoding="utf-8")


def test_values_at_the_floats_limits_draw_without_a_warning(tmp_path, capsys):
    """Axis margins of 1e308-wide data overflow inside matplotlib; that is not the user's to read."""
    steps = [
        {"step": 0, "loss": 1e308, "grad_norm": 1e308, "learning_rates": [1e-300]},
        {"step": 1, "loss": -1e308, "grad_norm": 1e-308, "learning_rates": [1e300]},
    ]
    training = _write_run(tmp_path / "training", {"kind": "training", "steps": steps, "anomalies": []})
    latents = [
        {"step": 0, "timestep": 1e308, "latents": {"std": 1e308, "mean": -1e308, "abs_max": 1e308}},
        {"step": 1, "timestep": -1e308, "latents": {"std": 0, "abs_max": 0}},
    ]
    inference = _write_run(tmp_path / "inference", {"kind": "diffusion", "steps": latents, "anomalies": []})
    for run_dir in (training, inference):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert main(["report", str(run_dir)]) == 0
        assert [str(w.message) for w in caught] == []
        assert capsys.readouterr().err == ""
    assert "<img" in (training / "report.html").read_text(encoding="utf-8")  # the plots are still drawn


def test_report_and_export_refuse_a_summary_or_events_file_that_links_out_of_the_run(tmp_path, capsys):
    """A run directory is self-contained: summary.json and events.jsonl are refused alike."""
    outside = _write_run(tmp_path / "elsewhere", {"kind": "training", "anomalies": []})
    (outside / "events.jsonl").write_text('{"type": "start", "kind": "training", "time": 1.0}\n')
    for name in ("summary.json", "events.jsonl"):
        run_dir = tmp_path / f"linked-{name}"
        run_dir.mkdir()
        (run_dir / name).symlink_to(outside / name)
        line = (
            f"error: {str(run_dir / name)!r} is a symbolic link out of the run directory; "
            "a run directory holds its own files.\n"
        )
        assert main(["report", str(run_dir)]) == 2
        assert capsys.readouterr().err == f"diffusion-debug report: {line}"
        assert main(["export", str(run_dir), "--out", str(tmp_path / "tables")]) == 2
        assert capsys.readouterr().err == f"diffusion-debug export: {line}"
        assert sorted(p.name for p in run_dir.iterdir()) == [name]  # no report.html, no tables
    assert not (tmp_path / "tables").exists()
    inside = tmp_path / "inside"  # a link that stays inside the run directory is its own file
    _write_run(inside, {"kind": "training", "anomalies": []})
    (inside / "summary.json").rename(inside / "kept.json")
    (inside / "summary.json").symlink_to(inside / "kept.json")
    assert main(["report", str(inside), "--no-html"]) == 0


def test_a_hostile_end_is_cut_or_left_out(tmp_path, capsys):
    """``end`` (how a launched script ended) is shown bounded, and a value of the wrong shape says nothing."""
    long = _write_run(
        tmp_path / "long",
        {
            "kind": "training",
            "anomalies": [],
            "end": {"status": "raised", "exception": "E" * 1000, "message": "m" * 10**6},
        },
    )
    odd = _write_run(tmp_path / "odd", {"kind": "training", "anomalies": [], "end": {"status": 5}})
    assert main(["report", str(long), "--no-html"]) == 0
    (line,) = [text for text in capsys.readouterr().out.splitlines() if text.startswith("The script raised")]
    assert (
        line
        == f"The script raised {'E' * 200}… 800 more characters: {'m' * 300}… {10**6 - 300} more characters; "
        + ("the figures stop there.")
    )
    assert main(["report", str(odd)]) == 0
    assert "ended" not in (odd / "report.html").read_text(encoding="utf-8")
    not_an_object = _write_run(tmp_path / "text", {"kind": "training", "end": "raised"})
    assert main(["report", str(not_an_object)]) == 2
    assert capsys.readouterr().err.endswith("field 'end' must be an object, not str.\n")
