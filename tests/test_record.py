import json
import math
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionDebugError
from diffusion_debug.core import DebugReport, open_run
from diffusion_debug.probes import ModuleReading
from diffusion_debug.record import (
    Anomaly,
    RunRecord,
    dumps,
    load_json,
    read_jsonl,
    to_jsonable,
    write_atomic,
)


def strict_loads(text):
    def refuse(name):
        raise AssertionError(f"non-standard constant {name} in JSON")

    return json.loads(text, parse_constant=refuse)


def test_to_jsonable_leaves_of_a_row_match_the_long_way():
    # a step row's leaves take a fast path (no call each): every kind of leaf must come out as
    # the general walk writes it, the subclasses of float, int and str included
    import enum

    import numpy as np

    class Level(enum.IntEnum):
        HIGH = 2

    class Name(str):
        pass

    leaves = {
        "finite": 1.5,
        "nan": math.nan,
        "inf": math.inf,
        "ninf": -math.inf,
        "int": 3,
        "bool": True,
        "none": None,
        "str": "x",
        "np64": np.float64(math.inf),
        "np32": np.float32(0.25),
        "level": Level.HIGH,
        "shape": (2, 3),
        "nested": {"v": math.nan, 7: [math.inf]},
        "tensor": torch.tensor([1.0, math.nan]),
        Name("sub"): 1,
    }
    row = to_jsonable(leaves)
    assert row == {
        "finite": 1.5,
        "nan": "nan",
        "inf": "inf",
        "ninf": "-inf",
        "int": 3,
        "bool": True,
        "none": None,
        "str": "x",
        "np64": "inf",
        "np32": 0.25,
        "level": Level.HIGH,
        "shape": [2, 3],
        "nested": {"v": "nan", "7": ["inf"]},
        "tensor": [1.0, "nan"],
        "sub": 1,
    }
    assert all(type(key) is str for key in row) and json.loads(json.dumps(row)) == json.loads(dumps(leaves))


def test_a_named_tuple_is_written_by_its_field_names_as_the_dataclass_it_replaced_was():
    reading = ModuleReading("down.0", 0, "float32", 1.5, math.nan)
    assert to_jsonable({"found": reading}) == {
        "found": {
            "module": "down.0",
            "call": 0,
            "dtype": "float32",
            "input_value": 1.5,
            "output_value": "nan",
            "input_dtype": None,
            "signal": "finite",
        }
    }
    assert to_jsonable((1.0, math.inf)) == [1.0, "inf"]  # a plain tuple stays a list


def test_to_jsonable_writes_nonfinite_floats_as_strings():
    data = {"a": math.nan, "b": [math.inf, -math.inf, 1.5], "t": torch.tensor([1.0, math.nan]), 3: torch.float16}
    assert to_jsonable(data) == {"a": "nan", "b": ["inf", "-inf", 1.5], "t": [1.0, "nan"], "3": "torch.float16"}
    assert strict_loads(dumps(data))["b"] == ["inf", "-inf", 1.5]


def test_anomaly_round_trip_and_where():
    anomaly = Anomaly(
        kind="nonfinite",
        severity="error",
        message="Inf produced.",
        component="unet",
        module="up_blocks.1.resnets.0.conv2",
        step=3,
        timestep=761.0,
        rank=1,
        details={"value": math.inf},
    )
    data = strict_loads(dumps(anomaly))
    assert data["details"] == {"value": "inf"} and data["parameter"] is None
    assert Anomaly.from_dict(data).module == "up_blocks.1.resnets.0.conv2"
    assert anomaly.where() == "unet up_blocks.1.resnets.0.conv2, step 3 (t=761), rank 1"
    with pytest.raises(ValueError, match="severity must be one of"):
        Anomaly(kind="x", severity="fatal", message="m")


def test_record_streams_events_and_stays_bounded(tmp_path):
    cfg = DebugConfig(output_dir=str(tmp_path), run_name="run", history_size=5)
    record = RunRecord(cfg, kind="inference")
    for step in range(100):
        record.add_step({"step": step, "loss": math.nan if step == 50 else float(step)})
    for i in range(60):
        record.add_anomaly(Anomaly(kind="loss_spike", severity="warning", message="m", step=i))
    assert [row["step"] for row in record.steps] == [95, 96, 97, 98, 99]
    assert len(record.events) == 5
    assert len(record.anomalies) == 50 and record.dropped_anomalies == 10
    assert record.anomaly_counts == {"loss_spike": 60}
    rows = read_jsonl(record.events_path)  # everything is on disk while the record is still open
    assert [r["type"] for r in rows].count("step") == 100
    assert rows[0]["type"] == "start" and rows[51]["loss"] == "nan"
    record.close()


def test_unwritable_output_dir_is_a_clear_error_before_anything_is_written(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = DebugConfig(output_dir=str(blocker / "sub"))
    with pytest.raises(DiffusionDebugError, match=r"^Cannot write the run directory '.*sub/run-"):
        RunRecord(cfg, kind="training")
    if os.geteuid() != 0:  # root can write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(DiffusionDebugError, match="Cannot write the run directory"):
            RunRecord(DebugConfig(output_dir=str(locked)), kind="training")


def test_report_save_writes_strict_json_files(tmp_path):
    cfg = DebugConfig(output_dir=str(tmp_path), run_name="r")
    record = RunRecord(cfg, kind="training")
    record.add_step({"step": 0, "grad_norm": math.inf})
    anomaly = Anomaly(
        kind="gradient_explosion", severity="error", message="Gradient norm is inf.", component="model", step=0
    )
    record.add_anomaly(anomaly)
    report = DebugReport(
        record.run_dir,
        record.summary(),
        list(record.anomalies),
        list(record.steps),
        files={"plots/a.txt": b"hello"},
        record=record,
    )
    run_dir = report.save()
    for name in ("summary.json", "report.html", "events.jsonl", "plots/a.txt"):
        assert (run_dir / name).is_file(), name
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        strict_loads(line)
    summary = strict_loads((run_dir / "summary.json").read_text())
    assert summary["anomalies"][0]["kind"] == "gradient_explosion"
    assert summary["steps"][0]["grad_norm"] == "inf"
    assert summary["anomaly_counts"] == {"gradient_explosion": 1}
    assert set(summary["versions"]) >= {"torch", "diffusers", "transformers", "accelerate", "python"}
    html = (run_dir / "report.html").read_text()
    assert "gradient_explosion" in html and "Gradient norm is inf." in html
    assert not list(run_dir.glob(".*.tmp"))  # no temporary files left behind


def test_events_are_written_on_save_when_not_streamed(tmp_path):
    cfg = DebugConfig(output_dir=str(tmp_path), run_name="quiet", stream_events=False)
    record = RunRecord(cfg, kind="inference")
    assert not record.events_path.exists()
    record.add_step({"step": 0})
    DebugReport(record.run_dir, record.summary(), [], list(record.steps), record=record).save(html=False)
    assert [r["type"] for r in read_jsonl(record.events_path)] == ["start", "step"]


def test_write_atomic_replaces_whole_files(tmp_path):
    path = tmp_path / "x" / "f.json"
    write_atomic(path, "old")
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new" and load_json(_json(tmp_path)) == {"a": 1}


def test_write_atomic_syncs_to_the_disk_unless_told_not_to(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    write_atomic(tmp_path / "a.json", "durable")
    assert len(synced) == 1
    write_atomic(tmp_path / "b.json", "scratch", durable=False)
    assert len(synced) == 1
    assert [(tmp_path / name).read_text() for name in ("a.json", "b.json")] == ["durable", "scratch"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def _json(tmp_path):
    return write_atomic(tmp_path / "j.json", '{"a": 1}')


def test_a_killed_writer_leaves_readable_jsonl(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, signal, math
        from diffusion_debug import DebugConfig
        from diffusion_debug.record import RunRecord
        record = RunRecord(DebugConfig(output_dir={str(tmp_path)!r}, run_name="killed"), kind="training")
        for step in range(20):
            record.add_step({{"step": step, "loss": math.nan if step % 3 else 1.0}})
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    rows = read_jsonl(tmp_path / "killed" / "events.jsonl")
    assert [r["step"] for r in rows if r["type"] == "step"] == list(range(20))


def test_read_jsonl_skips_and_reports_lines_that_are_not_objects(tmp_path):
    path = tmp_path / "e.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": ')
    rows = read_jsonl(path)
    assert rows == [{"a": 1}, {"a": 2}] and rows.bad_lines == [3]
    path.write_text('{"a": 1}\nbroken\n[1]\n{"a": NaN}\n{"a": 2}\n')
    rows = read_jsonl(path)
    assert rows == [{"a": 1}, {"a": 2}] and rows.bad_lines == [2, 3, 4]


def test_a_name_whose_directory_holds_a_cut_earlier_run_is_left_alone(tmp_path):
    cfg = DebugConfig(output_dir=str(tmp_path), run_name="again")
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / "events.jsonl").write_text('{"type": "start"}\n{"type": "st')
    with pytest.warns(RuntimeWarning, match="run_name 'again' is taken"):
        record = open_run(cfg, kind="training")
    record.add_step({"step": 0})
    record.close()
    assert record.run_dir.name == "again-2"
    assert [r["type"] for r in read_jsonl(record.events_path)] == ["start", "step"]
    assert (tmp_path / "again" / "events.jsonl").read_text() == '{"type": "start"}\n{"type": "st'


def test_events_never_follow_a_symbolic_link(tmp_path):
    outside = tmp_path / "outside.jsonl"
    outside.write_text("")
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "events.jsonl").symlink_to(outside)
    config = DebugConfig(output_dir=str(tmp_path / "runs"), run_name="r")
    # a rank joining the directory its main process chose opens the events file in it as it is
    record = RunRecord(config, kind="training", run_dir=run_dir)
    record.add_step({"step": 0})
    record.close()
    assert outside.read_text() == ""  # nothing written through the link
    assert "symbolic links" in record.stream_error  # ELOOP: the link is refused, and the cause is kept
    claimed = RunRecord(config, kind="training")  # a run asking for the name: the directory is taken
    claimed.close()
    assert claimed.run_dir.name == "r-2" and outside.read_text() == ""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_loses_the_stream_with_its_first_cause_and_never_raises(tmp_path, monkeypatch):
    from diffusion_debug.record import run_record

    monkeypatch.setattr(run_record, "_open_stream", lambda path: open("/dev/full", "a", buffering=1))
    record = RunRecord(DebugConfig(output_dir=str(tmp_path)), kind="training")
    for step in range(3):
        record.add_step({"step": step})
    record.flush_to_disk()
    record.close()
    record.close()
    assert record.stream_error.startswith("OSError: [Errno 28]")  # no space left: the cause, not a closed file
    assert [row["step"] for row in record.steps] == [0, 1, 2]  # the ring buffer went on


def test_a_non_main_rank_report_never_writes_the_summary(tmp_path):
    record = RunRecord(
        DebugConfig(output_dir=str(tmp_path), run_name="r"), kind="training", rank=1, events_name="events-rank1.jsonl"
    )
    record.add_step({"step": 0})
    run_dir = DebugReport(
        record.run_dir, record.summary(), [], list(record.steps), record=record, is_main=False
    ).save()
    assert sorted(p.name for p in run_dir.iterdir()) == ["events-rank1.jsonl"]


def test_saving_twice_without_streaming_writes_the_newer_events(tmp_path):
    record = RunRecord(DebugConfig(output_dir=str(tmp_path), run_name="r", stream_events=False), kind="inference")
    record.add_step({"step": 0})
    DebugReport(record.run_dir, record.summary(), [], [], record=record).save(html=False)
    record.add_step({"step": 1})
    DebugReport(record.run_dir, record.summary(), [], [], record=record).save(html=False)
    assert [r.get("step") for r in read_jsonl(record.events_path)] == [None, 0, 1]


def test_a_failing_disk_stops_streaming_but_not_the_run(tmp_path):
    record = RunRecord(DebugConfig(output_dir=str(tmp_path), run_name="r"), kind="inference")

    class Full:
        def write(self, _):
            raise OSError(28, "No space left on device")

        def close(self):
            pass

    record._stream = Full()
    record.add_step({"step": 0})  # does not raise
    record.add_step({"step": 1})
    assert record.stream_error == "OSError: [Errno 28] No space left on device"
    assert [row["step"] for row in record.steps] == [0, 1]
    assert record.summary()["stream_error"] == record.stream_error


FRESH_IMPORTS = pytest.mark.xdist_group("record_fresh_imports")  # one worker: the module's `fresh_imports` runs once


@pytest.fixture(scope="module")
def fresh_imports() -> dict[str, dict[str, bool]]:
    """What a fresh Python has loaded (one process for the two tests below: torch imported once, not
    twice): ``imported``, after ``from diffusion_debug import TrainingDebugger, DiffusionModelDebugger``
    (what every rank imports), then ``versions``, after it read the versions a run records (its
    ``found``), each module's presence as it was then."""
    code = (
        "import sys, json; from diffusion_debug import TrainingDebugger, DiffusionModelDebugger\n"
        "imported = {m: m in sys.modules for m in ('matplotlib', 'jinja2', 'torch.distributed.tensor')}\n"
        "from diffusion_debug.record.run_record import versions; v = versions()\n"
        "print(json.dumps({'imported': imported, 'found': v, 'versions': {m: m in sys.modules for m in "
        "('diffusers', 'transformers')}}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


@FRESH_IMPORTS
def test_versions_are_read_without_importing_the_libraries(fresh_imports):
    """Every rank of a job records them: reading diffusers' version must not import diffusers."""
    assert fresh_imports["versions"] == {"diffusers": False, "transformers": False}
    import diffusers
    import transformers

    found = fresh_imports["found"]
    assert (found["diffusers"], found["transformers"]) == (diffusers.__version__, transformers.__version__)


@FRESH_IMPORTS
def test_a_rank_that_only_trains_loads_neither_the_reports_plots_nor_dtensor(fresh_imports):
    """Every rank imports the training debugger; only the main one writes a report or serves its
    page, and a DTensor exists only where FSDP2 imported it: matplotlib, jinja2 and
    torch.distributed.tensor (1.1 s a process together) load when used, not at import."""
    assert fresh_imports["imported"] == {"matplotlib": False, "jinja2": False, "torch.distributed.tensor": False}


def test_dumps_plain_writes_what_the_long_way_writes_finite_or_not():
    """``modules.jsonl``'s writer: the C encoder alone for finite readings, :func:`dumps` (NaN/Inf as
    strings) for a non-finite one or a value the encoder cannot write, the text the same either way."""
    from diffusion_debug.record.jsonio import dumps_plain

    def entry(*values):
        modules = [
            ModuleReading(f"up.{i}", i, "float16", v, -v if v is not None else None)[:5] for i, v in enumerate(values)
        ]
        return {"run": 0, "step": 3, "component": "unet", "site": "", "signal": "absmax", "modules": modules}

    cases = [
        entry(1.5, 0.1, 65504.0, 2.0**-24, None, 0.0),
        entry(1.5, math.nan, 2.0),
        entry(math.inf, -math.inf, 3.0),
        {"run": 1, "step": None, "component": "vae", "site": "décodeur", "modules": [["a", True, None, 1, 2.5]]},
        {"run": 0, "modules": [["t", 0, "float32", torch.tensor(1.5), 1.0]]},  # not plain: the long way
    ]
    for case in cases:
        assert dumps_plain(case) == json.dumps(to_jsonable(case), allow_nan=False)
    assert dumps_plain(cases[1]).count('"nan"') == 2 and '"-inf"' in dumps_plain(cases[2])


def test_module_readings_with_a_planted_nan_are_written_as_the_long_way_writes_them(tmp_path, monkeypatch):
    """A real full-probed call with a NaN planted in one conv: every ``modules.jsonl`` line is the
    text :func:`dumps` makes of the entry, the NaN lines (``"nan"``) as the finite ones."""
    from diffusion_debug import DiffusionModelDebugger
    from diffusion_debug.testing import tiny_pipeline

    entries = []
    add_readings = RunRecord.add_readings

    def spy(self, entry):
        entries.append(entry)
        add_readings(self, entry)

    monkeypatch.setattr(RunRecord, "add_readings", spy)
    pipe = tiny_pipeline("sd")
    with torch.no_grad():
        pipe.unet.get_submodule("up_blocks.1.resnets.0.conv2").weight[0, 0, 0, 0] = math.nan
    debugger = DiffusionModelDebugger(pipe, DebugConfig(level="extreme", output_dir=str(tmp_path)))
    with debugger:
        pipe(prompt="a cat", num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0))
    lines = (debugger.report().save() / "modules.jsonl").read_text().splitlines()
    assert lines == [dumps(e) for e in entries]
    assert [(e["component"], e["step"]) for e in entries] == [("text_encoder", None)] * 2 + [
        ("unet", 0),
        ("unet", 1),
        ("vae", None),
    ]
    # the encoder's two calls; the NaN made at step 0 reaches everything after it (an "inf" is no sign of it: a
    # transformers 4.x CLIP hands its attention a causal mask of -inf, read as an input's abs-max)
    finite = [line for line in lines if '"nan"' not in line]
    assert len(finite) == 2
    step0 = {m[0]: m for m in strict_loads(lines[2])["modules"]}
    conv = step0["up_blocks.1.resnets.0.conv2"]
    assert conv[3] != "nan" and conv[4] == "nan"  # made there: finite in, NaN out


def test_an_entry_that_holds_itself_stops_streaming_but_not_the_run(tmp_path):
    """Lines are encoded without json's cycle check (its C encoder, called directly): an entry that
    refers to itself ends in a RecursionError there, which stops the stream like a failing disk."""
    record = RunRecord(DebugConfig(output_dir=str(tmp_path), run_name="r"), kind="inference")
    entry: dict = {"type": "looped"}
    entry["self"] = entry
    record._write(entry)  # does not raise
    record.add_step({"step": 1})
    assert record.stream_error.startswith("RecursionError: maximum recursion depth exceeded")
    assert [row["step"] for row in record.steps] == [1]
