"""Reading a run directory back: killed runs, damaged files, and the one-line errors for both."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from diffusion_debug import DebugConfig, DiffusionDebugError
from diffusion_debug.cli import main
from diffusion_debug.core import AnomalySink, DebugReport
from diffusion_debug.record import Anomaly, RunRecord, load_run, make_anomaly, prepare_run_dir

REPO = Path(__file__).resolve().parents[2]

# one worker under `pytest -n 2 --dist loadgroup`: the module's `killed_run` is made once, not once on each worker
# that runs one of its tests, and the session's fork server (conftest.py's `pipeline_forks`) started once
pytestmark = pytest.mark.xdist_group("pipeline_forks")

ENV = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module")
def python(tmp_path_factory, pipeline_forks):
    """``python(code, *args)``: what ``python -c code args`` returns with :data:`ENV`, run as a child of
    tests/fork_server.py's process (conftest.py's ``pipeline_forks``, shared with test_op_count.py), which
    imported torch, transformers' CLIP and diffusers' SD pipeline once for the module's four killed jobs
    (each a Python of its own importing them before: ~5 s of CPU each); the debugger loads in each."""
    folder = tmp_path_factory.mktemp("run-dir-forks")
    return lambda code, *args: pipeline_forks.run(folder, ENV, [str(arg) for arg in args], code=code)


# A training run killed with SIGKILL after step 3 of 5 (a NaN loss at step 2): no summary.json.
KILLED_JOB = """
import os, signal, sys, torch
from diffusion_debug import DebugConfig, TrainingDebugger
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=sys.argv[1], run_name="killed", level="basic"))
for step in range(5):
    loss = model(torch.randn(8, 4)).pow(2).mean() * (float("nan") if step == 2 else 1.0)
    loss.backward()
    tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
    optimizer.step()
    optimizer.zero_grad()
    if step == 3:
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, python):
    out = tmp_path_factory.mktemp("killed")
    proc = python(KILLED_JOB, out)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    run_dir = out / "killed"
    assert not (run_dir / "summary.json").exists()
    # the writer was killed mid-line once: the cut tail must be tolerated and reported
    with open(run_dir / "events.jsonl", "a", encoding="utf-8") as events:
        events.write('{"type": "step", "step": 4, "lo')
    return run_dir


def test_a_killed_run_is_rebuilt_from_its_events_and_marked_incomplete(killed_run):
    run = load_run(killed_run)
    assert run.summary["incomplete"] is True and run.summary["kind"] == "training"
    assert [row["step"] for row in run.steps] == [0, 1, 2, 3]
    # step 2's NaN loss, and step 3's that its update's NaN weights made: a consequence, not a repeat
    nan_loss, later = [a for a in run.anomalies if a.kind == "nonfinite_loss"]
    assert (nan_loss.step, nan_loss.severity, later.step) == (2, "error", 3)
    assert later.details["cause"]["step"] == 2 and later.details["count"] == 1
    assert run.summary["anomaly_counts"]["nonfinite_loss"] == 2
    assert run.summary["unreadable_event_lines"] == {"events.jsonl": [len(run.events) + 1]}


def test_a_killed_run_of_several_ranks_is_rebuilt_as_one_and_names_its_ranks(
    killed_run, tmp_path, capsys, monkeypatch
):
    """Each rank writes its own event file: a killed 2-rank run's rebuilt summary has world_size 2, so its
    headline and table name rank 0 as the live run's did (they said no rank at all)."""
    import shutil

    run_dir = tmp_path / "two"
    shutil.copytree(killed_run, run_dir)
    (run_dir / "events-rank1.jsonl").write_text('{"type": "start", "rank": 1, "kind": "training"}\n')
    assert load_run(run_dir).summary["world_size"] == 2
    assert "world_size" not in load_run(killed_run).summary
    monkeypatch.setenv("COLUMNS", "200")  # the headline's place on one line (an xdist worker's terminal is 80 wide)
    assert main(["report", str(run_dir)]) == 0
    assert "model, step 2, rank 0" in capsys.readouterr().out


def test_report_on_a_killed_run_writes_a_readable_report(killed_run, capsys):
    assert main(["report", str(killed_run)]) == 0
    out = capsys.readouterr().out
    assert "Incomplete run: summary.json is missing" in out and "nonfinite_loss" in out
    html = (killed_run / "report.html").read_text(encoding="utf-8")
    assert "Incomplete run" in html and "nonfinite_loss" in html


def _run_dir_with_summary(tmp_path: Path, content: str | bytes) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = run_dir / "summary.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return run_dir


# A pipeline call killed with SIGKILL: inside its VAE decode (its first layer), in its
# post-processing (the VAE has returned), or right after its second call ended (its debugger
# neither detached for good nor closed). A kill between the loop's last scheduler.step and the
# VAE's call loses that step's row: it is read a step late, on a CPU as on a GPU (README).
KILLED_PIPELINE = """
import os, signal, sys, torch
from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import tiny_pipeline
pipe = tiny_pipeline("sd")
dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=sys.argv[1], run_name="killed", log_level="error"))
def call():
    with dbg:
        pipe("a cat", num_inference_steps=1, output_type="np", generator=torch.Generator().manual_seed(0))
call()
kill, where = lambda *_, **__: os.kill(os.getpid(), signal.SIGKILL), sys.argv[2]
if where == "in_vae":
    pipe.vae.decoder.conv_in.register_forward_pre_hook(kill)
elif where == "in_postprocess":
    pipe.image_processor.postprocess = kill
call()
kill()
"""


@pytest.mark.parametrize(
    "where, rows",
    [("in_vae", 4), ("in_postprocess", 5), ("after_call", 6)],
)
def test_a_pipeline_call_killed_leaves_every_row_it_finished_on_disk(tmp_path, where, rows, python):
    """A watched call's rows batch their flushes (its opening events go with its step row, issue
    45), never past what a killed run must keep: killed in its VAE decode, its step row is on disk
    (read as the VAE's call begins); killed in post-processing, its ``vae_decode`` row too; killed
    after the call, every row."""
    proc = python(KILLED_PIPELINE, tmp_path, where)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    lines = (tmp_path / "killed" / "events.jsonl").read_text(encoding="utf-8").splitlines()
    types = [json.loads(line)["type"] for line in lines]  # every line whole
    one_call = ["attach", "run_start", "set_timesteps", "step", "vae_decode", "detach"]
    anomalies = [t for t in types if t.startswith("anomaly")]  # the random tiny UNet's latents: its own rows
    calls = [t for t in types if not t.startswith("anomaly")]
    assert calls[0] == "start" and calls[1:7] == one_call
    assert calls[7:] == one_call[:rows], (types, anomalies)
    step = json.loads(lines[len(types) - 1 - types[::-1].index("step")])
    assert (step["step"], step["run"]) == (0, 2)


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "is not valid strict JSON"),
        ('{"kind": "diffusion", "anomalies": [', "is not valid strict JSON"),
        ("null", "must hold a JSON object, not NoneType"),
        ("[1, 2]", "must hold a JSON object, not list"),
        ('{"loss": NaN}', "is not valid strict JSON"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", "cannot be read: UnicodeDecodeError"),
        ("[" * 100000 + "]" * 100000, "nested too deeply"),
        ('{"anomalies": {"a": 1}}', "field 'anomalies' must be a list, not dict"),
        ('{"steps": [1]}', "steps[0] must be an object, not int"),
        ('{"anomalies": [{"kind": "nonfinite", "severity": "fatal", "message": "m"}]}', "anomalies[0] severity"),
        ('{"anomalies": [{"kind": "nonfinite", "severity": "error", "message": 3}]}', "field 'message' must be text"),
        ('{"anomalies": [{"kind": "x", "severity": "error", "message": "m", "step": "3"}]}', "'step' must be an"),
        ('{"components": []}', "field 'components' must be an object, not list"),
        ('{"kind": 3}', "field 'kind' must be text, not int"),
        (
            '{"anomalies": [{"kind": "x", "severity": "error", "message": "m", "rank": "0"}]}',
            "'rank' must be an integer,",
        ),
        (
            '{"anomalies": [{"kind": "x", "severity": "error", "message": "m", "details": []}]}',
            "must be an object, not",
        ),
    ],
)
def test_a_damaged_summary_is_one_clear_error(tmp_path, capsys, content, message):
    run_dir = _run_dir_with_summary(tmp_path, content)
    with pytest.raises(DiffusionDebugError, match="summary.json") as caught:
        load_run(run_dir)
    assert message in str(caught.value)
    assert main(["report", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err and "Traceback" not in err


def test_not_a_run_directory(tmp_path):
    with pytest.raises(DiffusionDebugError, match="no summary.json and no events.jsonl"):
        load_run(tmp_path)
    with pytest.raises(DiffusionDebugError, match="no such directory"):
        load_run(tmp_path / "missing")


def test_two_runs_started_in_the_same_second_never_share_a_directory(tmp_path):
    config = DebugConfig(output_dir=str(tmp_path))
    first, second = RunRecord(config, kind="training"), RunRecord(config, kind="training")
    assert first.run_dir != second.run_dir
    first.close()
    second.close()
    with pytest.raises(DiffusionDebugError, match="exists already; runs never share one"):
        prepare_run_dir(tmp_path, first.run_dir.name, exclusive=True)


def test_report_strips_terminal_control_characters(tmp_path, capsys):
    record = RunRecord(DebugConfig(output_dir=str(tmp_path), run_name="hostile"), kind="diffusion")
    sink = AnomalySink(record, record.config, __import__("logging").getLogger("test"))
    sink.emit(Anomaly(kind="nonfinite", severity="error", message="bad\x1b[2J\x07 value", component="unet"))
    DebugReport(record.run_dir, record.summary(), list(record.anomalies), [], record=record).save()
    record.close()
    assert main(["report", str(record.run_dir)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "bad?[2J? value" in out
    assert json.loads((record.run_dir / "summary.json").read_text())["anomalies"][0]["message"].startswith("bad\x1b")


def test_each_optimizers_stall_is_its_own_anomaly_in_memory_and_in_a_rebuilt_summary(tmp_path):
    """Two optimizers' own stalls (``not_learning`` at component ``optimizer``, module ``""``, one rank) share
    their place: the sink folded the second into the first (one anomaly, count 2), and a killed run's rebuilt
    summary counted one's repeat on the other. ``stalled_optimizer`` tells them apart in both."""
    record = RunRecord(DebugConfig(output_dir=str(tmp_path), run_name="stalls"), kind="training")
    sink = AnomalySink(record, record.config, __import__("logging").getLogger("test"))

    def stall(step, optimizer):
        details = {"reason": "lr_zero", "stalled_optimizer": optimizer}
        return make_anomaly("not_learning", message=optimizer, component="optimizer", step=step, details=details)

    generator, discriminator = "SGD holding generator.0.weight", "SGD holding discriminator.0.weight"
    assert sink.emit(stall(24, generator))
    sink.end_step()
    assert sink.emit(stall(25, discriminator))  # another optimizer's stall: not a repeat of the generator's
    assert not sink.emit(stall(25, generator))  # the generator's again: its own repeat
    sink.end_step()
    told = [(a.details["stalled_optimizer"], a.step, a.details["count"]) for a in record.anomalies]
    assert told == [(generator, 24, 2), (discriminator, 25, 1)]
    record.close()  # killed before save(): the summary is rebuilt from events.jsonl
    rebuilt = load_run(record.run_dir)
    assert rebuilt.summary["incomplete"] is True
    told = [(a.details["stalled_optimizer"], a.step, a.details["count"]) for a in rebuilt.anomalies]
    assert told == [(generator, 24, 2), (discriminator, 25, 1)]
    assert rebuilt.anomalies[0].details["last_step"] == 25 and "last_step" not in rebuilt.anomalies[1].details


def test_a_repeat_written_without_details_folds_on_the_anomaly_at_its_place(tmp_path):
    """An events.jsonl written before a repeat carried the details that tell two at one place apart (main's
    ``anomaly_repeated``: the place alone) still counts the repeat on the anomaly at that place."""
    record = RunRecord(DebugConfig(output_dir=str(tmp_path), run_name="old"), kind="training")
    sink = AnomalySink(record, record.config, __import__("logging").getLogger("test"))

    def stall(step):
        details = {"reason": "lr_zero", "stalled_optimizer": "SGD holding g.0.weight"}
        return make_anomaly("not_learning", message="m", component="optimizer", step=step, details=details)

    assert sink.emit(stall(24)) and not sink.emit(stall(30))
    sink.end_step()
    record.close()  # killed before save(): the summary is rebuilt from events.jsonl
    events = record.run_dir / "events.jsonl"
    rows = [json.loads(line) for line in events.read_text().splitlines()]
    assert [row["details"] for row in rows if row["type"] == "anomaly_repeated"] == [
        {"stalled_optimizer": "SGD holding g.0.weight"}
    ]
    for row in rows:
        if row["type"] == "anomaly_repeated":
            del row["details"]  # as main wrote it
    events.write_text("".join(json.dumps(row) + "\n" for row in rows))
    [anomaly] = load_run(record.run_dir).anomalies
    assert (anomaly.step, anomaly.details["count"], anomaly.details["last_step"]) == (24, 2, 30)


def test_a_loaded_runs_anomalies_are_the_same_objects_at_each_read_so_a_cause_keeps_its_consequences(tmp_path):
    """``consequences`` finds the cause by identity: a cause read once and the list read again (the terminal's
    and report.html's two reads) found none while ``RunData.anomalies`` built new objects at each access."""
    from diffusion_debug.record import cause_reference, consequences, dumps

    lr = {"reason": "lr_jump", "lr_before": 1e-4, "lr": 1.0, "factor": 1e4}
    jump = make_anomaly("lr_spike", component="optimizer", step=10, details=lr)
    loss = {"cause": cause_reference(jump), "loss": "nan"}
    nan = make_anomaly("nonfinite_loss", component="model", step=16, details=loss)
    (tmp_path / "summary.json").write_text(
        dumps({"kind": "training", "anomalies": [jump.to_dict(), nan.to_dict()]}), encoding="utf-8"
    )
    run = load_run(tmp_path)
    cause = run.anomalies[0]
    assert [a.kind for a in consequences(run.anomalies, cause)] == ["nonfinite_loss"]
    assert run.anomalies is run.anomalies
    run.summary["anomalies"][1] = {**run.summary["anomalies"][1], "message": "edited"}  # an entry replaced
    assert run.anomalies[1].message == "edited" and run.anomalies is run.anomalies
    run.summary["anomalies"] = run.summary["anomalies"][1:]  # another list: read anew
    assert [a.kind for a in run.anomalies] == ["nonfinite_loss"]
