"""Two runs never share a run directory (issue 24): a debugger asking for a ``run_name`` in use by
a live run, in this process or another, or whose directory holds an earlier run, gets ``NAME-2``
and a warning saying so; every rank of one run joins the directory its main process chose."""

from __future__ import annotations

import gc
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger, TrainingDebugger
from diffusion_debug.core import open_run
from diffusion_debug.errors import DiffusionDebugError
from diffusion_debug.record import RunRecord, read_jsonl, run_claim
from diffusion_debug.record.run_claim import RunLock, claim_run_dir
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.training.ranks.processes import open_shared_run


def _starts(run_dir) -> int:
    return [row["type"] for row in read_jsonl(run_dir / "events.jsonl")].count("start")


def test_a_second_live_record_of_the_same_name_gets_its_own_directory(tmp_path):
    config = DebugConfig(output_dir=str(tmp_path), run_name="same")
    first = RunRecord(config, kind="training")
    second = RunRecord(config, kind="training")
    third = RunRecord(config, kind="training")
    assert [r.run_dir.name for r in (first, second, third)] == ["same", "same-2", "same-3"]
    assert [_starts(r.run_dir) for r in (first, second, third)] == [1, 1, 1]
    for record in (first, second, third):
        record.close()
    again = RunRecord(config, kind="training")  # a finished run's directory holds that run: never shared
    assert again.run_dir.name == "same-4" and [_starts(r.run_dir) for r in (first, again)] == [1, 1]
    again.close()


def test_a_killed_run_in_a_reused_name_is_read_as_itself_not_as_the_earlier_run(tmp_path):
    # the earlier run finished (its summary.json); the next one of the same name is killed mid-run
    from diffusion_debug.record import load_run

    config = DebugConfig(output_dir=str(tmp_path), run_name="fixed")
    earlier = RunRecord(config, kind="training")
    earlier.add_step({"step": 0, "loss": 1.0})
    earlier.close()
    (earlier.run_dir / "summary.json").write_text('{"kind": "training", "steps": [{"step": 0}]}')
    killed = RunRecord(config, kind="training")
    for step in range(3):
        killed.add_step({"step": step, "loss": 2.0})
    killed.flush_to_disk()  # then SIGKILL: no close, no summary
    assert killed.run_dir.name == "fixed-2"
    assert [row["step"] for row in load_run(killed.run_dir).steps] == [0, 1, 2]
    assert (earlier.run_dir / "summary.json").read_text() == '{"kind": "training", "steps": [{"step": 0}]}'


def test_a_run_held_by_another_process_is_not_shared(tmp_path):
    (tmp_path / "same").mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); "
            "print('held', flush=True); sys.stdin.read()",
            str(tmp_path / "same"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        record = RunRecord(DebugConfig(output_dir=str(tmp_path), run_name="same"), kind="training")
        assert record.run_dir.name == "same-2"
        record.close()
    finally:
        holder.kill()  # as SIGKILL ends a run: the kernel lets go of its hold
        holder.wait(timeout=30)
    record = RunRecord(DebugConfig(output_dir=str(tmp_path), run_name="same"), kind="training")
    assert record.run_dir.name == "same"
    record.close()


@pytest.mark.usefixtures("only_the_tests_objects")  # its gc.collect() walks only what the test made
def test_a_lock_is_let_go_when_released_or_collected(tmp_path):
    lock = RunLock.hold(tmp_path)
    assert lock.held and RunLock.hold(tmp_path) is None
    lock.release()
    lock.release()  # idempotent
    assert not lock.held
    lock = RunLock.hold(tmp_path)
    del lock
    gc.collect()
    assert RunLock.hold(tmp_path) is not None


def test_too_many_live_runs_of_one_name_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setattr(run_claim, "MAX_SUFFIX", 3)
    held = [claim_run_dir(tmp_path, "busy") for _ in range(3)]
    assert [run_dir.name for run_dir, _ in held] == ["busy", "busy-2", "busy-3"]
    with pytest.raises(DiffusionDebugError) as info:
        claim_run_dir(tmp_path, "busy")
    assert str(info.value) == (
        "The run name 'busy' and busy-2 to busy-3 are all taken by live or earlier runs; set another run_name."
    )


def test_two_live_pipeline_debuggers_with_one_run_name(tmp_path):
    config = DebugConfig(output_dir=str(tmp_path), run_name="notebook-cell")
    first = DiffusionModelDebugger(tiny_pipeline("sd"), config)
    with pytest.warns(RuntimeWarning, match=r"run_name 'notebook-cell' is taken \(by a live run.*notebook-cell-2'\."):
        second = DiffusionModelDebugger(tiny_pipeline("sd"), config)
    try:
        assert (first.record.run_dir.name, second.record.run_dir.name) == ("notebook-cell", "notebook-cell-2")
        assert first.report().save(html=False) != second.report().save(html=False)
        assert _starts(first.record.run_dir) == _starts(second.record.run_dir) == 1
    finally:
        first.close()
        second.close()


def test_two_live_training_debuggers_with_one_run_name(tmp_path):
    config = DebugConfig(output_dir=str(tmp_path), run_name="job")
    first = TrainingDebugger(torch.nn.Linear(2, 1), config=config)
    with pytest.warns(RuntimeWarning, match="run_name 'job' is taken"):
        second = TrainingDebugger(torch.nn.Linear(2, 1), config=config)
    try:
        assert (first.record.run_dir.name, second.record.run_dir.name) == ("job", "job-2")
    finally:
        first.close()
        second.close()


def _ctx(is_main: bool, sent: list, answer=None):
    def broadcast_object(obj):
        sent.append(obj)
        return obj if is_main else answer

    def gather_objects(obj):  # every rank's failure to join (None: joined); the other rank joined
        return [obj, None] if is_main else [None, obj]

    return SimpleNamespace(
        distributed=True,
        is_main=is_main,
        rank=0 if is_main else 1,
        broadcast_object=broadcast_object,
        gather_objects=gather_objects,
    )


def test_every_rank_joins_the_directory_the_main_process_chose(tmp_path):
    config = DebugConfig(output_dir=str(tmp_path), run_name="shared")
    live = RunRecord(config, kind="training")  # another live run holds "shared"
    sent: list = []
    with pytest.warns(RuntimeWarning, match="run_name 'shared' is taken"):
        main = open_shared_run(_ctx(True, sent), lambda name: open_run(config, kind="training", name=name))
    assert main.run_dir.name == "shared-2" and main.lock.held and sent == [("shared-2", None)]
    other = open_shared_run(
        _ctx(False, [], answer=("shared-2", None)),
        lambda name: open_run(config, kind="training", name=name, rank=1, events_name="events-rank1.jsonl"),
    )
    assert other.run_dir == main.run_dir and other.lock is None  # joined, not held
    for record in (live, main, other):
        record.close()


def test_a_main_process_that_cannot_open_the_run_makes_every_rank_raise(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    config = DebugConfig(output_dir=str(blocker), run_name="r")
    sent: list = []
    with pytest.raises(DiffusionDebugError, match="Cannot write the run directory"):
        open_shared_run(_ctx(True, sent), lambda name: open_run(config, kind="training", name=name))
    assert sent[0][0] is None and sent[0][1].startswith("Cannot write the run directory")
    opened: list = []
    with pytest.raises(DiffusionDebugError, match="Cannot write the run directory"):
        open_shared_run(_ctx(False, [], answer=sent[0]), opened.append)
    assert opened == []  # the other ranks open nothing
