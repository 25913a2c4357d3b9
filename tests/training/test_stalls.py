"""Naming a stall from every rank's position (``training.stalls``), the watcher that judges them
on a real store (``training.stall_watch`` over torch's in-process ``HashStore``), and this rank's
marks (``training.liveness``, ``probes.phase_marks``). The 8-process launches are in
test_stalls_multiprocess.py.

Long because the patterns, the watcher and the marks share their helpers (positions at a step, two ranks'
liveness over one store) and are read together when a stall is misnamed."""

import json
import math
import threading

import pytest
import torch
import torch.distributed as dist

from diffusion_debug import DebugConfig, DiffusionDebugError, TrainingDebugger
from diffusion_debug.errors import ConfigError
from diffusion_debug.probes import apply_phase_marks
from diffusion_debug.training.hangs import liveness as liveness_module
from diffusion_debug.training.hangs.liveness import RankLiveness, stall_anomaly
from diffusion_debug.training.hangs.patterns import Position, Stall, name_stall, rank_list
from diffusion_debug.training.hangs.side_channel import SideChannel
from diffusion_debug.training.hangs.unwinding import Unwinding
from diffusion_debug.training.hangs.watcher import StallWatcher


def _at(phase, step, ranks, **fields):
    return [Position(rank=r, phase=phase, step=step, **fields) for r in ranks]


def test_validation_on_rank0_names_it_and_the_waiting_ranks():
    positions = _at("validation", 120, [0], exchanges=121, forwards=121)
    positions += _at("monitor", 121, range(1, 8), exchanges=122, forwards=122)
    stall = name_stall(positions)
    assert stall.text == "rank 0 is in validation at step 120; ranks 1–7 wait in the monitor's exchange at step 121"
    assert (stall.pattern, stall.ranks, stall.step, stall.waiting, stall.definite) == (
        "rank_elsewhere",
        [0],
        120,
        list(range(1, 8)),
        False,
    )


def test_a_rank_held_after_its_monitor_is_named_before_the_next_steps_forward():
    # rank 1 sleeps at the top of step 6's loop: its last mark is step 5's monitor (then the optimizer)
    positions = _at("backward", 6, [0], exchanges=6, forwards=7) + _at("optimizer", 5, [1], exchanges=6, forwards=6)
    stall = name_stall(positions)
    assert stall.text == (
        "rank 1 is between step 5's monitor and step 6's forward (its optimizer step, zero_grad or the next batch); "
        "rank 0 waits in backward (the gradient all-reduce) at step 6"
    )
    assert (stall.pattern, stall.ranks, stall.step) == ("rank_elsewhere", [1], 6)


def test_skipped_step_is_named_apart_from_gaps_every_rank_shares():
    # every rank's steps jump over 10 (a resumed count); rank 5's also over 88
    positions = _at("backward", 121, [0, 1, 2, 3, 4, 6, 7], skipped=[10], skipped_total=1)
    positions.insert(5, Position(rank=5, phase="optimizer", step=121, skipped=[10, 88], skipped_total=2))
    stall = name_stall(positions)
    assert stall.text == (
        "rank 5 skipped step 88 (no monitor_training_step call for it, so its later collectives pair with the other "
        "ranks' earlier ones); ranks 0–4, 6–7 wait in backward (the gradient all-reduce) at step 121"
    )
    assert (stall.pattern, stall.ranks, stall.step, stall.definite) == ("skipped_step", [5], 88, True)


def test_monitor_on_rank0_only_is_named_once_the_others_ran_past():
    inside = _at("monitor", 0, [0], exchanges=1, forwards=1)
    late = name_stall(inside + _at("forward", None, range(1, 8), forwards=1))  # not past this step yet: late
    assert late.pattern == "rank_elsewhere"
    assert late.text == "rank 0 is in the monitor's exchange at step 0; ranks 1–7 wait in forward"
    stall = name_stall(inside + _at("backward", None, range(1, 8), forwards=2))
    assert stall.text == (
        "monitor_training_step is called on rank 0 only: ranks 1–7 went on to backward (the gradient all-reduce) "
        "without it"
    )
    assert (stall.pattern, stall.ranks, stall.waiting, stall.definite) == (
        "monitor_subset",
        [0],
        list(range(1, 8)),
        True,
    )


def test_monitor_skipped_later_on_some_ranks_names_the_step():
    positions = _at("monitor", 40, [0, 2], exchanges=41, forwards=41)
    positions += _at("forward", 41, [1, 3], exchanges=40, forwards=42)
    stall = name_stall(sorted(positions, key=lambda p: p.rank))
    assert stall.text == (
        "monitor_training_step is called on ranks 0, 2 at step 40 but not on the others: ranks 1, 3 went on to "
        "forward without it"
    )


def test_rank_that_left_the_loop_is_named():
    positions = _at("closed", 119, [0], exchanges=120) + _at("monitor", 120, range(1, 4), exchanges=121)
    stall = name_stall(positions)
    assert stall.text == (
        "rank 0 left the training loop (closed its debugger) after step 119; ranks 1–3 wait in the monitor's "
        "exchange at step 120"
    )
    assert (stall.pattern, stall.definite) == ("left_early", True)


def test_no_stall_when_the_ranks_agree_or_nobody_waits_in_a_collective():
    assert name_stall(_at("backward", 7, range(8), exchanges=7)) is None
    # after the loop: some ranks closed, the others after their optimizer step (the clean end of a run)
    assert name_stall(_at("closed", 5, [0, 1]) + _at("optimizer", 5, [2, 3])) is None
    assert name_stall(_at("validation", 5, [0]) + _at("save", 5, [1])) is None


def test_of_two_ranks_in_collectives_the_one_behind_is_named():
    # two ranks (FSDP2): one stalled before backward, the other waits in backward's all-gather
    for behind, ahead in ((1, 0), (0, 1)):
        stall = name_stall(
            _at("forward", 4, [behind], exchanges=4, forwards=5) + _at("backward", 4, [ahead], exchanges=4, forwards=5)
        )
        assert (stall.pattern, stall.ranks, stall.waiting, stall.step) == ("rank_elsewhere", [behind], [ahead], 4)
        assert stall.text == (
            f"rank {behind} is in forward at step 4; "
            f"rank {ahead} waits in backward (the gradient all-reduce) at step 4"
        )


def test_rank_stalled_after_its_optimizer_step_is_named_at_the_next_step():
    stall = name_stall(
        _at("before_forward", 6, [1], exchanges=6, forwards=6) + _at("forward", 6, [0], exchanges=6, forwards=7)
    )
    assert (stall.ranks, stall.step) == ([1], 6)
    assert stall.text == (
        "rank 1 is in the loop after its optimizer step, before the forward at step 6; "
        "rank 0 waits in forward at step 6"
    )


def test_a_rank_whose_forward_raised_is_named_with_its_error_though_the_others_wait_in_that_forward():
    # FSDP2 (ZeRO-3 alike): rank 1's forward raised after the root's all-gather, rank 0 waits in the next
    # group's; before, both read "forward at step 3" (the same place: no stall) and nothing was named
    raised = _at("raised", 3, [1], exchanges=3, forwards=4, error="ValueError: a bad batch")
    stall = name_stall(_at("forward", 3, [0, 2], exchanges=3, forwards=4, engine="fsdp2") + raised)
    assert (stall.pattern, stall.ranks, stall.waiting, stall.step, stall.definite) == ("raised", [1], [0, 2], 3, False)
    assert stall.text == (
        "rank 1 raised ValueError: a bad batch in its forward at step 3; ranks 0, 2 wait in forward at step 3"
    )
    anomaly = stall_anomaly(stall, {"end": False, "by": 0})
    assert (anomaly.kind, anomaly.rank, anomaly.step) == ("rank_desync", 1, 3)
    assert anomaly.message.endswith(
        "An error on some ranks only (a bad batch, an out-of-memory) leaves the others in the collective it never "
        "reached: let it end the process (the launcher then stops the others), or skip the batch on every rank "
        "together (decide from a value all ranks share); stacks-rank*.txt shows where each rank is."
    )
    # every rank raised (the same bug everywhere): nobody waits, no stall
    assert name_stall(_at("raised", 3, [0, 1], error="ValueError: a bad batch")) is None


class _NoWatcher:
    """A watcher never started (as with a side channel): what the marks call on it, nothing more."""

    def __init__(self):
        self.unwinding = Unwinding(threading.current_thread())


def test_a_forward_that_raises_marks_the_rank_raised_with_its_error_until_the_next_forward(mlp):
    liveness = RankLiveness(Position(rank=1))
    liveness.watcher = _NoWatcher()  # as with a side channel: the marks go on
    liveness.attach([mlp])

    def bad_batch(module, args):
        raise ValueError("a bad\nbatch")

    try:
        with mlp.register_forward_pre_hook(bad_batch):
            with pytest.raises(ValueError, match="a bad"):
                mlp(torch.ones(2, 4))
        p = liveness.position
        assert (p.phase, p.step, p.error, p.forwards) == ("raised", None, "ValueError: a bad batch", 1)
        with liveness.phase("log"):  # a phase of the user's after it: back to the error when it ends
            assert (p.phase, p.error) == ("log", "")
        assert (p.phase, p.error) == ("raised", "ValueError: a bad batch")
        mlp(torch.ones(2, 4)).sum().backward()  # the retry: marked as usual
        assert (p.phase, p.forwards, p.error) == ("backward", 2, "")  # no stale error published meanwhile
        with torch.no_grad(), mlp.register_forward_pre_hook(bad_batch):  # no training forward: no mark
            with pytest.raises(ValueError):
                mlp(torch.ones(2, 4))
        assert p.phase == "backward"
    finally:
        liveness.detach()
    assert not mlp._forward_pre_hooks and not mlp._forward_hooks and not mlp._forward_hooks_always_called


def test_a_rank_that_has_not_entered_zero_s_optimizer_step_is_named_at_that_step():
    # DeepSpeed ZeRO's step all-reduces the gradient norm and overflow flag, then all-gathers the parameters:
    # rank 0 waits in step 6's while rank 1 sits after its monitor (a save); before, both read "after step
    # 6's monitor" (the same place: no stall) and nothing was named
    stall = name_stall(
        _at("optimizer", 6, [1], exchanges=7, forwards=7) + _at("step", 6, [0], exchanges=7, forwards=7, engine="zero")
    )
    assert (stall.pattern, stall.ranks, stall.waiting, stall.step) == ("rank_elsewhere", [1], [0], 6)
    assert stall.text == (
        "rank 1 is after step 6's monitor, before its optimizer step (a save, a log or a wait of its own); "
        "rank 0 waits in the optimizer step (DeepSpeed ZeRO's gradient norm and overflow all-reduce, then its "
        "parameter all-gather) at step 6"
    )


class _CollectiveStep:
    """A stand-in for DeepSpeed ZeRO's optimizer: its ``step`` says where the rank was marked."""

    def __init__(self, liveness):
        self.liveness, self.seen = liveness, []

    def step(self):
        self.seen.append((self.liveness.position.phase, self.liveness.position.step))


def test_an_optimizer_step_that_holds_collectives_is_marked_while_a_monitored_update_runs_in_it(mlp):
    liveness = RankLiveness(Position(rank=0))
    liveness.watcher = _NoWatcher()  # as with a side channel: the marks go on
    zero = _CollectiveStep(liveness)
    liveness.attach([mlp], [zero])
    liveness._last_step = 6
    liveness.mark("optimizer", 6)  # after step 6's monitor
    zero.step()
    assert zero.seen == [("step", 6)] and (liveness.position.phase, liveness.position.step) == ("before_forward", 7)
    liveness.mark("backward", 7)  # a step run inside backward (Accelerate's DeepSpeed plugin): not marked
    zero.step()
    assert zero.seen[-1] == ("backward", 7) and liveness.position.phase == "backward"
    liveness.detach()
    assert "step" not in vars(zero)


def test_rank_list_joins_runs_with_an_en_dash():
    assert [rank_list(r) for r in ([5], [1, 2, 3], [0, 2], [0, 1, 2, 3, 4, 6, 7])] == [
        "rank 5",
        "ranks 1–3",
        "ranks 0, 2",
        "ranks 0–4, 6–7",
    ]


def test_stall_anomaly_is_rank_desync_with_the_sentence_and_advice():
    positions = _at("validation", 2, [0]) + _at("backward", 3, [1])
    anomaly = stall_anomaly(name_stall(positions), {"end": False, "by": 1})
    assert (anomaly.kind, anomaly.severity, anomaly.rank, anomaly.step) == ("rank_desync", "error", 0, 2)
    assert anomaly.message == (
        "Rank 0 is in validation at step 2; rank 1 waits in backward (the gradient all-reduce) at step 3. Work done "
        "on some ranks only (validation, sampling, saving) makes the others wait in their next collective: keep it "
        "short, or run it on every rank; stacks-rank*.txt shows where each rank is."
    )
    assert anomaly.details["ranks"] == [0] and anomaly.details["waiting"] == [1]


# -- the watcher, on a real store shared by four simulated ranks --------------------------------------


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def watched(tmp_path):
    """Four ranks' channels on one store; rank 0's watcher (not started: ticked by hand)."""
    store = dist.PrefixStore("run/", dist.HashStore())
    channels = [SideChannel(store, r, 4) for r in range(4)]
    positions = [Position(rank=r) for r in range(4)]
    recorded = []
    clock = _Clock()
    watcher = StallWatcher(
        channels[0],
        positions[0],
        stall_timeout=3.0,
        end_job=False,
        run_dir=tmp_path,
        record=lambda stall, verdict: recorded.append((stall.text, verdict["end"])),
        clock=clock,
    )

    def tick(after):
        clock.now += after
        for channel, position in zip(channels[1:], positions[1:]):
            channel.publish(position)
        watcher.tick()

    return positions, tick, recorded, channels, tmp_path


def _move(position, phase, step):
    position.phase, position.step = phase, step
    position.counter += 1


def test_watcher_names_a_stall_after_stall_timeout_once_and_again_when_it_recurs(watched):
    positions, tick, recorded, channels, run_dir = watched
    _move(positions[0], "validation", 2)
    for p in positions[1:]:
        _move(p, "backward", 3)
    tick(0.0)
    tick(2.9)
    assert recorded == []  # waited less than stall_timeout
    tick(0.2)
    text = "rank 0 is in validation at step 2; ranks 1–3 wait in backward (the gradient all-reduce) at step 3"
    assert recorded == [(text, False)]
    assert channels[1].acknowledged(0) == 1 and json.loads(channels[1].store.get("verdict/0"))["by"] == 0
    stacks = (run_dir / "stacks-rank0.txt").read_text()  # this thread's stack: the test's own function
    assert stacks.startswith(f"# stall 0: {text}\n") and "in test_watcher_names_a_stall_after_stall_timeout" in stacks
    tick(10.0)
    assert len(recorded) == 1  # still the same stall: named once
    _move(positions[0], "forward", 3)  # it resolves: rank 0 moved; ranks 1-3 have not published since
    _move(positions[1], "monitor", 3)
    tick(0.5)
    assert len(recorded) == 1  # a half-moved snapshot is no new stall
    for p in positions[1:]:
        _move(p, "backward", 4)  # a second one, later
    _move(positions[0], "validation", 3)
    tick(0.0)
    tick(2.9)
    assert len(recorded) == 1
    tick(0.2)
    assert [end for _, end in recorded] == [False, False] and "at step 3; ranks 1–3" in recorded[1][0]


def test_a_snapshot_read_while_the_ranks_leave_a_long_wait_in_one_place_names_nobody(watched):
    # every rank in step 3's forward for 4 s (one slow inside it, the others in its all-gather): one place,
    # nothing to name; then they go on, rank 0 first seen after its monitor while ranks 1-3 have not
    # published their moves yet. Before, that snapshot named rank 0 as holding ranks 1-3 in forward
    positions, tick, recorded, channels, run_dir = watched
    for p in positions:
        _move(p, "forward", 3)
    tick(0.0)
    tick(4.0)
    assert recorded == []
    for phase in ("backward", "monitor", "optimizer"):
        _move(positions[0], phase, 3)
    tick(0.4)
    assert recorded == []
    for p in positions[1:]:
        for phase in ("backward", "monitor", "optimizer"):
            _move(p, phase, 3)
    tick(0.5)
    tick(4.0)
    assert recorded == []
    # a real stall still is, once no rank has moved for two looks: rank 0 held after its monitor
    for p in positions[1:]:
        _move(p, "forward", 4)
    tick(0.5)
    tick(2.9)
    assert recorded == []
    tick(0.2)
    assert recorded == [
        (
            "rank 0 is between step 3's monitor and step 4's forward (its optimizer step, zero_grad or the next "
            "batch); ranks 1–3 wait in forward at step 4",
            False,
        )
    ]


@pytest.mark.parametrize("phases", [("forward",), ("forward", "raised")], ids=["forwards", "oom_retries"])
def test_a_rank_that_keeps_moving_while_the_others_wait_is_named_at_stall_timeout(watched, phases):
    # rank 0 runs training forwards of its own one after the other (a validation in train mode with grad on; an
    # out-of-memory retry loop: raised, forward, raised...) while ranks 1-3 wait in step 3's backward all-reduce.
    # It moves at every look: before, no snapshot was ever still, and nothing was named (the collective's
    # watchdog ended the job unexplained)
    positions, tick, recorded, channels, run_dir = watched
    positions[0].error = "OutOfMemoryError: CUDA out of memory"
    for p in positions[1:]:
        _move(p, "backward", 3)
    _move(positions[0], "forward", 3)
    tick(0.0)
    for look in range(1, 7):  # one move of rank 0 per look (0.5 s): 3.0 s = stall_timeout at the sixth
        _move(positions[0], phases[look % len(phases)], 3)
        tick(0.5)
        assert len(recorded) == (look == 6)
    assert recorded == [
        (
            "rank 0 is in forward at step 3; ranks 1–3 wait in backward (the gradient all-reduce) at step 3",
            False,
        )
    ]


def test_watcher_takes_the_verdict_another_rank_proposed(watched):
    positions, tick, recorded, channels, run_dir = watched
    for p in positions:
        _move(p, "backward", 1)
    stall = name_stall([Position(rank=0, phase="closed", step=0), *positions[1:]])
    channels[2].propose(0, {"stall": stall.to_dict(), "end": False, "by": 2})
    tick(0.0)  # not frozen on rank 0's clock: the verdict is taken all the same
    assert recorded == [
        (
            "rank 0 left the training loop (closed its debugger) after step 0; ranks 1–3 wait in "
            "backward (the gradient all-reduce) at step 1",
            False,
        )
    ]


def test_verdict_ending_the_job_waits_for_every_rank_then_leaves_the_raise_to_the_training_thread(watched):
    positions, tick, recorded, channels, run_dir = watched
    stall = name_stall(_at("monitor", 0, [0], exchanges=1, forwards=1) + _at("forward", None, [1, 2, 3], forwards=2))
    channels[1].propose(0, {"stall": stall.to_dict(), "end": True, "by": 1})
    for channel in channels[1:]:
        channel.acknowledge(0)  # the other ranks dumped their stacks and recorded it
    watcher = StallWatcher(
        channels[0], positions[0], stall_timeout=3.0, end_job=False, run_dir=run_dir, record=lambda *a: None
    )
    watcher.keep_process.set()  # rank 0 waits at its first exchange: it raises instead of os._exit
    watcher.tick()
    assert watcher.handled.is_set() and channels[0].acknowledged(0) == 4 and watcher.next_verdict == 1


def test_stall_action_exit_ends_the_job_for_a_stall_that_may_resolve(watched):
    positions, tick, recorded, channels, run_dir = watched
    clock = _Clock()
    watcher = StallWatcher(
        channels[0], positions[0], stall_timeout=3.0, end_job=True, run_dir=run_dir, record=print, clock=clock
    )
    watcher.keep_process.set()  # (no os._exit in a test process)
    _move(positions[0], "validation", 2)
    for channel, p in zip(channels[1:], positions[1:]):
        _move(p, "backward", 3)
        channel.publish(p)
        channel.acknowledge(0)
    watcher.tick()
    clock.now = 3.0
    watcher.tick()
    verdict = json.loads(channels[1].store.get("verdict/0"))
    assert (verdict["stall"]["pattern"], verdict["end"], watcher.handled.is_set()) == ("rank_elsewhere", True, True)


# -- this rank's marks ----------------------------------------------------------------------------------


class _OneRank:
    rank, world_size, distributed, is_main = 0, 1, False, True


def test_liveness_marks_steps_skipped_by_the_monitor_and_restores_the_phase(tmp_path):
    liveness = RankLiveness.open(_OneRank(), DebugConfig(output_dir=str(tmp_path)), sink=None, owner=None)
    assert liveness.watcher is None  # one process: nothing published, no hook
    for step in (0, 1, 2, 4, 5, 9):
        with liveness.monitoring(step, exchange=True):
            assert (liveness.position.phase, liveness.position.step) == ("monitor", step)
    p = liveness.position
    assert (p.phase, p.step, p.exchanges, p.skipped, p.skipped_total) == ("optimizer", 9, 6, [3, 6, 7, 8], 4)
    with liveness.phase("validation"):
        assert (p.phase, p.step) == ("validation", 9)
    assert (p.phase, p.step) == ("optimizer", 9)
    with liveness.monitoring(10, exchange=False):  # a micro-step enters no exchange
        pass
    assert (p.exchanges, p.counter) == (6, 14)


def test_a_step_the_grad_scaler_skips_fires_no_step_hook_so_the_rank_stays_after_its_monitor(tmp_path):
    # the limit: a GradScaler skip calls no optimizer.step, so the mark "after its optimizer step" is not
    # made; a stall there is named from the monitor's end, which still names the optimizer step among the places
    liveness = RankLiveness(Position(rank=1))
    liveness.watcher = _NoWatcher()  # a rank with a watcher: the optimizer gets the step hook
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    liveness._watch_optimizer(optimizer)
    phases = []
    for step, planted in ((5, math.inf), (6, 1.0)):
        liveness._last_step = step
        liveness.mark("optimizer", step)  # what the monitor's exchange leaves
        scaler.scale(model(torch.ones(1, 2)).sum() * planted).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        phases.append((liveness.position.phase, liveness.position.step))
    assert phases == [("optimizer", 5), ("before_forward", 7)]
    liveness.watcher = None
    liveness.detach()
    stall = name_stall([Position(0, "backward", 6, exchanges=6, forwards=7), Position(1, "optimizer", 5, exchanges=6)])
    assert stall.text == (
        "rank 1 is between step 5's monitor and step 6's forward (its optimizer step, zero_grad or the next batch); "
        "rank 0 waits in backward (the gradient all-reduce) at step 6"
    )


def _two_rank_liveness(tmp_path):
    store = dist.PrefixStore("run/", dist.HashStore())
    watcher = StallWatcher(
        SideChannel(store, 0, 2), Position(rank=0), stall_timeout=3.0, end_job=False, run_dir=tmp_path, record=print
    )
    return RankLiveness(watcher.position, watcher=watcher), SideChannel(store, 1, 2)


def test_optimizer_step_moves_the_rank_to_the_next_steps_forward_until_detached(tmp_path):
    liveness, rank1 = _two_rank_liveness(tmp_path)
    rank1.arrive(1)  # else the first exchange waits out its deadline for rank 1 (16 s; tested below)
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    for step in (5, 6):
        with liveness.monitoring(step, exchange=True, optimizer=optimizer):
            weight.grad = torch.ones(2)
        assert (liveness.position.phase, liveness.position.step) == ("optimizer", step)
        optimizer.step()
        assert (liveness.position.phase, liveness.position.step) == ("before_forward", step + 1)
    assert len(optimizer._optimizer_step_post_hooks) == 1  # once per optimizer
    liveness.detach()
    assert not optimizer._optimizer_step_post_hooks


def test_phase_marks_run_before_the_hooks_registered_earlier():
    # fully_shard registers its hooks before the debugger: its all-gathers must find the rank marked
    model = torch.nn.Linear(2, 1)
    seen, at_hook = [], []
    model.register_forward_pre_hook(lambda mod, args: at_hook.append(seen[-1]))

    def on_output(mod, args, out):
        out.register_hook(lambda grad: at_hook.append(seen[-1]))

    model.register_forward_hook(on_output)
    with apply_phase_marks(model, lambda: seen.append("forward"), lambda: seen.append("backward")):
        model(torch.ones(1, 2)).sum().backward()
    assert at_hook == ["forward", "backward"]


def test_first_exchange_waits_on_the_store_until_every_rank_arrives(tmp_path):
    liveness, rank1 = _two_rank_liveness(tmp_path)
    rank1.arrive(1)
    with liveness.monitoring(0, exchange=True):
        assert liveness.watcher.channel.arrived(1) == 2
    assert not liveness.watcher.keep_process.is_set()  # past the first exchange, a verdict may end the process


def test_first_exchange_raises_the_verdict_that_ends_the_job(tmp_path):
    liveness, rank1 = _two_rank_liveness(tmp_path)  # rank 1 never arrives
    liveness._ended_message = "monitor_training_step is called on rank 0 only: ..."
    liveness.watcher.handled.set()  # the watcher handled a verdict ending the job
    with pytest.raises(DiffusionDebugError, match="^monitor_training_step is called on rank 0 only: ...$"):
        with liveness.monitoring(0, exchange=True):
            pass
    assert liveness.watcher.keep_process.is_set()  # the raise ends this process, not os._exit


def test_first_exchange_stops_waiting_for_a_rank_that_never_arrives_and_no_verdict(tmp_path, monkeypatch, caplog):
    # rank 1's channel failed at set-up: it runs unwatched, never arrives and never publishes, so its
    # watcher names nothing; rank 0 waits twice the stall time plus the margin, then goes on
    monkeypatch.setattr(liveness_module, "_ARRIVAL_MARGIN_S", 0.0)
    liveness, _ = _two_rank_liveness(tmp_path)
    liveness.watcher.stall_timeout = 0.05
    with caplog.at_level("WARNING", logger="diffusion_debug.training"):
        with liveness.monitoring(0, exchange=True):
            pass
    assert liveness.watcher.channel.arrived(1) == 1
    assert "saw 1 of 2 ranks reach their first step" in caplog.text
    assert not liveness.watcher.keep_process.is_set()


def test_debugger_phase_on_one_process_adds_no_hook(mlp, tmp_path):
    with TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path))) as tdbg:
        with tdbg.phase("validation"):
            assert tdbg._liveness.position.phase == "validation"
        hooks = [*mlp._forward_pre_hooks.values(), *mlp._forward_hooks.values()]
        assert not [h for h in hooks if "apply_phase_marks" in h.__qualname__]  # the OOM watch's hooks stay


def test_phase_marks_leave_the_gradient_unchanged_and_skip_eval_forwards(mlp):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    mlp(x).pow(2).sum().backward()
    reference = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    seen = []
    with apply_phase_marks(mlp, lambda: seen.append("forward"), lambda: seen.append("backward")):
        mlp(x).pow(2).sum().backward()
        mlp.eval()
        mlp(x)
    assert seen == ["forward", "backward"]
    assert all(torch.equal(p.grad, r) for p, r in zip(mlp.parameters(), reference))
    assert not mlp._forward_pre_hooks and not mlp._forward_hooks


def test_a_checkpoint_s_recompute_in_backward_is_neither_a_forward_nor_a_raised_forward(mlp):
    """Non-reentrant checkpointing over the watched model: backward re-runs its forward and stops it with torch's
    ``_StopRecomputationError``. The rank is in backward: no forward mark, and not marked ``raised``."""
    from torch.utils.checkpoint import checkpoint

    seen = []
    marks = (lambda: seen.append("forward"), lambda: seen.append("backward"))
    with apply_phase_marks(mlp, *marks, on_error=lambda error: seen.append(type(error).__name__)):
        checkpoint(mlp, torch.ones(2, 4), use_reentrant=False).sum().backward()
    assert seen == ["forward", "backward"]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"stall_timeout": -1}, "Config key 'stall_timeout' must be 0 (off) or positive, not -1."),
        ({"stall_action": "kill"}, "stall_action"),
    ],
)
def test_stall_config_is_checked(options, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DebugConfig(**options)


@pytest.mark.parametrize(
    "engine, waiting",
    [
        ("ddp", "backward (the gradient all-reduce)"),
        ("", "backward (the gradient all-reduce)"),
        ("fsdp2", "backward (FSDP2's parameter all-gather or gradient reduce-scatter)"),
        ("zero", "backward (DeepSpeed ZeRO's gradient reduction)"),
    ],
)
def test_ranks_waiting_in_backward_wait_in_their_engine_s_reduction(engine, waiting):
    positions = _at("validation", 2, [0], exchanges=3, forwards=3, engine=engine)
    positions += _at("backward", 3, range(1, 8), exchanges=3, forwards=4, engine=engine)
    assert name_stall(positions).text == f"rank 0 is in validation at step 2; ranks 1–7 wait in {waiting} at step 3"
    # the same with the roles turned: a lone rank held in backward, the others waiting in the exchange
    positions = _at("backward", 3, [0], exchanges=3, forwards=4, engine=engine)
    positions += _at("monitor", 3, range(1, 8), exchanges=4, forwards=4, engine=engine)
    assert (
        name_stall(positions).text
        == f"rank 0 is in {waiting} at step 3; ranks 1–7 wait in the monitor's exchange at step 3"
    )


def test_under_fsdp2_forward_is_named_as_the_phase_alone():
    # a rank in forward may be in FSDP2's all-gather or in the user's code (a culprit held there): not said
    positions = _at("forward", 4, [1], exchanges=4, forwards=5, engine="fsdp2")
    positions += _at("backward", 4, [0], exchanges=4, forwards=5, engine="fsdp2")
    assert name_stall(positions).text == (
        "rank 1 is in forward at step 4; rank 0 waits in backward (FSDP2's parameter all-gather or gradient "
        "reduce-scatter) at step 4"
    )


def test_the_engine_travels_with_the_position_through_the_store():
    position = Position(rank=1, phase="backward", step=3, engine="zero")
    assert Position.from_dict(json.loads(json.dumps(position.to_dict()))) == position


# -- an error that left the step outside the watched forward (hangs.unwinding) -----------------------------------
def test_where_an_error_left_the_step_is_named_with_the_error():
    loss = _at("raised", 3, [1], error="ValueError: a bad target", raised_in="forward")
    assert name_stall(_at("backward", 3, [0]) + loss).text == (
        "rank 1 raised ValueError: a bad target in its forward or its loss at step 3; "
        "rank 0 waits in backward (the gradient all-reduce) at step 3"
    )  # the phase "forward" begins with the model's forward: an error there (not seen by its hook) reads so too
    loss = _at("raised", 3, [1, 2], error="ValueError: a bad target", raised_in="forward")
    assert name_stall(_at("backward", 3, [0]) + loss).text.startswith(
        "ranks 1–2 raised ValueError: a bad target in their forward or their loss at step 3; "
    )
    both = _at("raised", 2, [1, 2], error="OSError: disk full", raised_in="save", uncaught=True)
    assert name_stall(_at("forward", 3, [0]) + both).text == (
        "ranks 1–2 raised OSError: disk full in save at step 2 (not caught: their processes are ending); "
        "rank 0 waits in forward at step 3"
    )
    stepped = _at("raised", 5, [0], error="RuntimeError: bad state", raised_in="optimizer")
    assert name_stall(stepped + _at("forward", 6, [1])).text == (
        "rank 0 raised RuntimeError: bad state after its monitor (the optimizer step, zero_grad or the next batch) "
        "at step 5; rank 1 waits in forward at step 6"
    )


def test_a_rank_handling_an_error_from_its_backward_is_published_raised_and_named(watched):
    """Rank 0's backward raised (a hook of the user's on the output, outside the watched forward) and it handles
    the error while ranks 1-3 wait in the gradient all-reduce: every rank's last mark is "backward at step 3",
    one place, and nothing was named. While the training thread unwinds with the error the watcher publishes the
    rank as raised, with it; once the rank left its ``except`` clause, as it was."""
    positions, tick, recorded, channels, run_dir = watched
    for p in positions:
        _move(p, "backward", 3)
    tick(0.0)
    try:
        raise ValueError("a bad target")
    except ValueError:
        tick(3.0)
        tick(1.0)  # held for two looks
    assert recorded == [
        (
            "rank 0 raised ValueError: a bad target in its backward at step 3; ranks 1–3 wait in backward (the "
            "gradient all-reduce) at step 3",
            False,
        )
    ]
    tick(0.5)
    published = channels[1].read()[0]
    assert (published.phase, published.step, published.error, published.counter) == ("backward", 3, "", 1)
    assert positions[0].phase == "backward"  # the training thread's own position is never written


@pytest.mark.parametrize("error", [StopIteration(), DiffusionDebugError("policy raise, on every rank")])
def test_an_iterator_ending_or_the_debuggers_own_error_is_not_read_as_raised(watched, error):
    positions, tick, recorded, channels, run_dir = watched
    _move(positions[0], "before_forward", 3)
    try:
        raise error
    except type(error):
        tick(0.0)
    assert channels[1].read()[0].phase == "before_forward"


def test_a_debugger_closed_at_exit_after_an_uncaught_error_publishes_it(tmp_path, monkeypatch):
    """The main thread ended with an uncaught error (``sys.last_value``) and the debugger's finalizer closes it at
    the exit: published as raised with it, not as a rank that left the loop (``left_early``)."""
    import sys
    import threading

    ended = threading.Thread(target=lambda: None)
    ended.start()
    ended.join()
    liveness, rank1 = _two_rank_liveness(tmp_path)
    liveness.watcher.thread = ended
    monkeypatch.setattr(threading, "main_thread", lambda: ended)
    monkeypatch.setattr(sys, "last_value", ValueError("a bad target"), raising=False)
    liveness._last_step = 2
    liveness.mark("backward", 3)
    liveness.close()
    published = rank1.read()[0]
    assert (published.phase, published.step, published.error) == ("raised", 3, "ValueError: a bad target")
    assert (published.raised_in, published.uncaught) == ("backward", True)
    assert name_stall([published, Position(1, "backward", 3)]).text == (
        "rank 0 raised ValueError: a bad target in its backward at step 3 (not caught: its process is ending); "
        "rank 1 waits in backward (the gradient all-reduce) at step 3"
    )
    monkeypatch.undo()
    liveness, rank1 = _two_rank_liveness(tmp_path)
    liveness.close()  # no error: closed
    assert rank1.read()[0].phase == "closed"


def test_a_stall_whose_raised_ranks_all_exit_uncaught_is_definite():
    """A rank whose process ends with an uncaught error will not come back: the job ends whatever stall_action
    says, as main ended it for that rank published ``closed`` (``left_early``). One that caught its error may retry."""
    uncaught = Position(0, "raised", 3, error="ValueError: x", raised_in="backward", uncaught=True)
    caught = Position(2, "raised", 3, error="ValueError: x", raised_in="backward")
    stall = name_stall([uncaught, Position(1, "backward", 3)])
    assert (stall.pattern, stall.uncaught, stall.definite) == ("raised", True, True)
    assert Stall.from_dict(json.loads(json.dumps(stall.to_dict()))).definite is True  # as the verdict carries it
    stall = name_stall([uncaught, Position(1, "backward", 3), caught])
    assert (stall.pattern, stall.uncaught, stall.definite) == ("raised", False, False)
    assert name_stall([caught, Position(1, "backward", 3)]).definite is False


def test_a_rank_exiting_with_an_uncaught_error_ends_the_job_under_stall_action_wait(tmp_path, monkeypatch):
    """Rank 0's main thread ended with an uncaught error raised in backward; its debugger's finalizer publishes it
    at exit. Rank 1 (stall_action "wait", end_job False) names it and ends the job, not waiting for rank 0's
    acknowledgement (its watcher is gone, as a closed rank's)."""
    import sys
    import threading

    ended = threading.Thread(target=lambda: None)
    ended.start()
    ended.join()
    liveness, rank1 = _two_rank_liveness(tmp_path)
    liveness.watcher.thread = ended
    monkeypatch.setattr(threading, "main_thread", lambda: ended)
    monkeypatch.setattr(sys, "last_value", ValueError("a bad target"), raising=False)
    liveness._last_step = 2
    liveness.mark("backward", 3)
    liveness.close()
    clock, handled = _Clock(), []
    watcher = StallWatcher(
        rank1,
        Position(rank=1, phase="backward", step=3, counter=1),
        stall_timeout=3.0,
        end_job=False,
        run_dir=tmp_path,
        record=print,
        clock=clock,
    )
    watcher.handle = lambda number, verdict, expected=None: handled.append((number, verdict, expected))
    for after in (0.0, 3.1):  # frozen for stall_timeout, the stall held for two looks: proposed
        clock.now += after
        watcher.tick()
    [(number, verdict, expected)] = handled
    assert (number, verdict["end"], verdict["stall"]["pattern"], expected) == (0, True, "raised", 1)
    assert verdict["stall"]["text"] == (
        "rank 0 raised ValueError: a bad target in its backward at step 3 (not caught: its process is ending); "
        "rank 1 waits in backward (the gradient all-reduce) at step 3"
    )


_AROUND = "rank 3 is in validation at step 2; ranks 0–2 wait in backward (the gradient all-reduce) at step 3"


@pytest.mark.parametrize("stall", ["rank 3 in validation", "all in one slow backward"])
def test_an_error_handled_around_the_training_loop_is_not_read_as_raised(watched, stall):
    """Rank 0's loop runs inside an ``except`` clause (a resume that fell back to a fresh start:
    ``except FileNotFoundError: trainer.train()``): the handled error encloses every step. Seen while rank 0 was
    at step 2 and still handled after it moved on, it is not the step's: rank 3 in validation is named, and four
    ranks together in one slow backward are no stall."""
    positions, tick, recorded, channels, run_dir = watched
    try:
        raise FileNotFoundError("no checkpoint to resume from")
    except FileNotFoundError:
        for p in positions:
            _move(p, "backward", 2)
        tick(0.0)
        if stall == "rank 3 in validation":
            _move(positions[3], "validation", 2)
        for p in positions[: 3 if stall == "rank 3 in validation" else 4]:
            _move(p, "backward", 3)
        tick(0.5)
        tick(3.1)
        tick(1.0)
        published = channels[1].read()[0]
    assert (published.phase, published.step, published.error) == ("backward", 3, "")
    assert recorded == ([(_AROUND, False)] if stall == "rank 3 in validation" else [])


def test_an_error_handled_when_the_watch_began_is_not_read_as_raised(tmp_path):
    """The debugger was built inside the ``except`` clause the loop runs in: the error is not the step's."""
    store = dist.PrefixStore("run/", dist.HashStore())
    try:
        raise FileNotFoundError("no checkpoint to resume from")
    except FileNotFoundError:
        watcher = StallWatcher(
            SideChannel(store, 0, 2),
            Position(rank=0),
            stall_timeout=3.0,
            end_job=False,
            run_dir=tmp_path,
            record=print,
        )
        _move(watcher.position, "backward", 3)
        watcher.tick()
    published = SideChannel(store, 1, 2).read()[0]
    assert (published.phase, published.step, published.error) == ("backward", 3, "")


def test_an_uncaught_error_left_from_before_the_watch_is_not_read_as_raised(tmp_path, monkeypatch):
    """``sys.last_value`` already set when the debugger was built (an earlier error in a REPL or notebook): at exit
    the rank is published closed, not raised with that error."""
    import sys
    import threading

    monkeypatch.setattr(sys, "last_value", ValueError("an earlier cell's error"), raising=False)
    ended = threading.Thread(target=lambda: None)
    ended.start()
    ended.join()
    liveness, rank1 = _two_rank_liveness(tmp_path)
    liveness.watcher.thread = ended
    monkeypatch.setattr(threading, "main_thread", lambda: ended)
    liveness._last_step = 2
    liveness.mark("backward", 3)
    liveness.close()
    published = rank1.read()[0]
    assert (published.phase, published.step, published.error, published.uncaught) == ("closed", 2, "", False)


def test_an_error_handled_when_the_steps_forward_began_is_not_read_as_raised(tmp_path):
    """The loop runs inside an ``except`` clause and the watcher's first look at the handler comes after rank 0's
    last move (a stall in the first step after it): the training forward's own mark saw the error handled as the
    step began, so it is not the step's. An error raised after the forward (in backward) still is."""
    liveness, rank1 = _two_rank_liveness(tmp_path)
    liveness._last_step = 2
    try:
        raise FileNotFoundError("no checkpoint to resume from")
    except FileNotFoundError:
        liveness._forward()
        liveness._backward()
        liveness.watcher.tick()
        published = rank1.read()[0]
        assert (published.phase, published.step, published.error) == ("backward", 3, "")
        try:
            raise ValueError("a bad target")
        except ValueError:
            liveness.watcher.tick()
    published = rank1.read()[0]
    assert (published.phase, published.error, published.raised_in) == (
        "raised",
        "ValueError: a bad target",
        "backward",
    )


def test_an_error_raised_after_a_forward_retried_in_a_handler_is_the_steps(tmp_path):
    """The step's forward was retried inside an ``except`` clause that then ended (its error freed); backward
    raised another error, which CPython put at the freed one's address: it is this step's, named raised."""
    import sys

    liveness, rank1 = _two_rank_liveness(tmp_path)
    liveness._last_step = 2

    def retried():
        try:
            raise ValueError("out of memory")
        except ValueError:
            liveness._forward()  # the retry's forward, with a smaller batch
            return id(sys.exc_info()[1])

    freed = retried()
    liveness._backward()
    try:
        raise ValueError("a bad target")
    except ValueError as error:
        assert id(error) == freed  # the freed error's id, reused
        liveness.watcher.tick()
    published = rank1.read()[0]
    assert (published.phase, published.error, published.raised_in) == (
        "raised",
        "ValueError: a bad target",
        "backward",
    )


def test_an_error_at_a_freed_errors_address_after_the_rank_moved_on_is_the_steps(tmp_path):
    """Step 3's backward raised, rank 0 handled it (seen by a look) and went on; step 4's backward raised another
    error, which CPython put at the freed one's address, before the watcher looked again: it is step 4's (a
    training forward with nothing handled between them), not an error handled around the loop."""
    import sys

    liveness, rank1 = _two_rank_liveness(tmp_path)
    liveness._last_step = 2

    def step_that_raises():
        liveness._forward()
        liveness._backward()
        try:
            raise ValueError("a bad target")
        except ValueError:
            liveness.watcher.tick()
            return id(sys.exc_info()[1])

    freed = step_that_raises()
    assert rank1.read()[0].phase == "raised"
    liveness._last_step = 3
    liveness._forward()
    liveness._backward()
    try:
        raise ValueError("another bad target")
    except ValueError as error:
        assert id(error) == freed  # the freed error's id, reused
        liveness.watcher.tick()
    published = rank1.read()[0]
    assert (published.phase, published.step, published.error) == ("raised", 4, "ValueError: another bad target")


def test_an_error_leaving_a_phase_of_the_user_s_is_named_in_that_phase(tmp_path, monkeypatch):
    """``with tdbg.phase("save"):`` left by an error: the rank was in its save, not back where it was before it
    (after its optimizer step). Handled (a rank that waits in its ``except`` clause) or not caught (its process
    ending), the other ranks read the error and the phase it left, at the phase's step."""
    import sys

    liveness, rank1 = _two_rank_liveness(tmp_path)
    liveness._last_step = 2
    liveness.mark("before_forward", 3)  # after step 2's optimizer step
    try:
        with liveness.phase("save"):
            raise OSError("disk full")
    except OSError as error:
        seen = liveness.watcher.unwinding.position(liveness.position, threading.current_thread())
        uncaught = error  # (as if not caught: the interpreter's sys.last_value)
    assert (seen.phase, seen.step, seen.error, seen.raised_in) == ("raised", 2, "OSError: disk full", "save")
    assert name_stall([seen, Position(1, "forward", 3)]).text == (
        "rank 0 raised OSError: disk full in save at step 2; rank 1 waits in forward at step 3"
    )
    ended = threading.Thread(target=lambda: None)  # the error not caught: the finalizer closes the debugger at exit
    ended.start()
    ended.join()
    liveness.watcher.thread = ended
    monkeypatch.setattr(threading, "main_thread", lambda: ended)
    monkeypatch.setattr(sys, "last_value", uncaught, raising=False)
    liveness.close()
    published = rank1.read()[0]
    assert (published.phase, published.step, published.raised_in, published.uncaught) == ("raised", 2, "save", True)
    assert "left" not in liveness.position.to_dict() and liveness.position.left  # this rank's own: not published


def test_a_rank_that_caught_an_error_leaving_a_phase_is_back_where_it_was_before_it():
    """A save that raised, caught by the loop, which goes on to load the next batch: the rank is not in save any
    more (it was, stale, until its next mark), and a later phase of the user's does not restore that stale save."""
    liveness = RankLiveness(Position(0, "before_forward", 3))
    liveness._last_step = 2
    with pytest.raises(OSError):
        with liveness.phase("save"):
            raise OSError("disk full")
    assert (liveness.position.phase, liveness.position.step) == ("before_forward", 3)
    with liveness.phase("validation"):
        pass
    assert (liveness.position.phase, liveness.position.step) == ("before_forward", 3)
    thread = threading.current_thread()
    try:  # another error, handled later: read where the rank is, not in that save
        raise ValueError("a bad target")
    except ValueError:
        seen = Unwinding(threading.Thread()).position(liveness.position, thread)
    assert (seen.phase, seen.step, seen.raised_in) == ("raised", 3, "before_forward")


def test_a_stall_left_by_a_rank_s_forward_error_is_headed_by_that_error_at_its_block():
    """Rank 1's forward raised at ``up_blocks.1`` (its ``step_error``) and rank 0 waits in the gradient all-reduce
    (``rank_desync``, an error): one diagnosis, headed by the cause, which names the block; the stall is its
    consequence, ahead of an error of a later step. An error that left elsewhere (a save) heads its stall itself."""
    from diffusion_debug.record import diagnosis_severity, folded, headline, make_anomaly

    error = "ValueError: a bad batch"
    details = {"error": error, "error_type": "ValueError", "phase": "forward"}
    cause = make_anomaly("step_error", component="model", module="up_blocks.1", step=3, rank=1, details=details)
    later = make_anomaly("nonfinite_loss", component="model", step=4, rank=0, details={"loss": math.nan})
    stall = name_stall([Position(0, "backward", 3), Position(1, "raised", 3, error=error)])
    desync = stall_anomaly(stall, {"end": False, "by": 0})
    top = headline([later, desync, cause], world_size=2)
    assert (top["kind"], top["where"], top["consequences"]) == (
        "step_error",
        "model up_blocks.1, step 3, rank 1",
        {"count": 1, "kinds": {"rank_desync": 1}},
    )
    # the diagnosis is an error (its stall is), the step_error itself stays a warning
    assert (top["severity"], diagnosis_severity(*folded([later, desync, cause])[0])) == ("warning", "error")
    assert [(a.kind, [b.kind for b in under]) for a, under in folded([later, desync, cause])] == [
        ("step_error", ["rank_desync"]),
        ("nonfinite_loss", []),
    ]
    saved = Position(1, "raised", 3, error="OSError: disk full", raised_in="save")
    elsewhere = stall_anomaly(name_stall([Position(0, "backward", 3), saved]), {"end": False, "by": 0})
    assert headline([elsewhere, cause], world_size=2)["kind"] == "rank_desync"


def test_a_forward_error_that_left_a_stall_heads_it_as_an_error_in_the_terminal_report_html_and_run_files(
    mlp, tmp_path, monkeypatch
):
    """The forward's ``step_error`` (a warning: the error went on unchanged) left the other rank in the
    all-reduce (``rank_desync``, an error): the diagnosis is an error, and the terminal's row and report.html's
    card say so alike (summary.json's headline keeps the anomaly's own), the stall folded under
    it; each anomaly keeps its own severity in the record (the headline's ``severity`` too), and a killed
    run's report (rebuilt from events.jsonl) says the same."""
    from diffusion_debug.record import load_json, load_run, read_jsonl
    from diffusion_debug.report.terminal import render_terminal

    monkeypatch.setenv("COLUMNS", "400")  # no message wrapped: one line a row
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), log_level="error"))

    def bad_batch(module, args):
        raise ValueError("a bad batch")

    with mlp[2].register_forward_pre_hook(bad_batch), pytest.raises(ValueError):
        mlp(torch.ones(2, 4))
    stall = name_stall([Position(0, "raised", 0, error="ValueError: a bad batch"), Position(1, "backward", 0)])
    tdbg.sink.emit(stall_anomaly(stall, {"end": False, "by": 0}), log=False)
    run_dir = tdbg.report().save()
    tdbg.close()
    message = (
        "The training forward raised ValueError: a bad batch in 2 at step 0: the forward did not finish "
        "(a loop that catches the error and goes on skips the step)."
    )
    assert load_json(run_dir / "summary.json")["headline"] == {
        "kind": "step_error",
        "severity": "warning",
        "where": "model 2, step 0",
        "message": message,
        "consequences": {"count": 1, "kinds": {"rank_desync": 1}},
    }
    events = [(e["kind"], e["severity"]) for e in read_jsonl(run_dir / "events.jsonl") if e.get("type") == "anomaly"]
    assert events == [("step_error", "warning"), ("rank_desync", "error")]  # the record: each its own
    row = ["error", "step_error", "model 2, step 0", f"{message} 1 anomaly follows from it (1 rank_desync)."]

    def rows(run):
        lines = render_terminal(run).splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("anomalies:"))  # after a killed run's note
        return lines[at], [[cell.strip() for cell in line.split("  ") if cell.strip()] for line in lines[at + 3 :]]

    assert rows(load_run(run_dir)) == ("anomalies: 2 (1 error, 1 warning)", [row])
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    card = page[page.index("<li class='anomaly ") :]
    assert card.startswith(
        f"<li class='anomaly error'><span class='chip error'>error</span><div class='message'>{message}<"
    )
    assert "<summary>1 anomaly follows from it (1 rank_desync)</summary>" in card[: card.index("</li>")]
    assert "Most important: step_error at model 2, step 0; 1 of the others follow from it." in page
    (run_dir / "summary.json").unlink()  # killed before it saved: rebuilt from the events file
    assert rows(load_run(run_dir)) == ("anomalies: 2 (1 error, 1 warning)", [row])


def test_a_forward_error_only_its_own_rank_recorded_is_read_from_its_events_file_as_the_stall_s_cause(tmp_path):
    """Rank 1's ``step_error`` is in rank 1's events file alone (found outside the step's exchange); rank 0's
    record holds the stall that follows it: the cause is read back from rank 1's file, that one only, and
    the headline is rank 1's error at its block, an error. Once in the record it is not read again; a rank
    that wrote nothing leaves the stall to head itself."""
    from diffusion_debug.record import RunRecord, diagnosis_severity, folded, headline, make_anomaly
    from diffusion_debug.training.ranks.elsewhere import RankFiles, causes_kept_elsewhere

    details = {"error": "ValueError: a bad batch", "error_type": "ValueError", "phase": "forward"}
    cause = make_anomaly("step_error", component="model", module="conv_in", step=3, rank=1, details=details)
    other = make_anomaly("step_error", component="model", module="conv_in", step=2, rank=1, details=details)
    config = DebugConfig(output_dir=str(tmp_path))
    rank1 = RunRecord(config, kind="training", run_dir=tmp_path, rank=1, events_name="events-rank1.jsonl")
    rank1.add_anomaly(other)  # an earlier step's: not the one the stall follows
    rank1.add_anomaly(cause)
    rank1.close()
    stall = name_stall([Position(0, "backward", 3), Position(1, "raised", 3, error=details["error"])])
    desync = stall_anomaly(stall, {"end": False, "by": 0})
    files = RankFiles(tmp_path, rank=0)
    (found,) = causes_kept_elsewhere([desync], files, rank=0)
    assert found.to_dict() == cause.to_dict()
    # the record's own copy: what the record and RankFiles (which folds that rank's repeats in) each edit is theirs
    assert [a for a in files.read([1]) if a is found] == [] and found.to_dict() in [
        a.to_dict() for a in files.read([1])
    ]
    top = headline([desync, found], world_size=2)
    assert (top["kind"], top["where"], diagnosis_severity(*folded([desync, found])[0])) == (
        "step_error",
        "model conv_in, step 3, rank 1",
        "error",
    )
    assert causes_kept_elsewhere([desync, found], RankFiles(tmp_path, 0), rank=0) == []  # once in the record
    (tmp_path / "events-rank1.jsonl").unlink()
    assert causes_kept_elsewhere([desync], RankFiles(tmp_path, 0), rank=0) == []  # that rank wrote nothing


def test_the_other_ranks_events_file_is_read_once_however_many_reports_wait_for_a_cause_it_never_wrote(tmp_path):
    """A killed rank's cause stays missing: each report used to read its whole file again. Now each line is read
    once (an offset per file): three reads of a file that did not grow read its lines once; a line written after
    is read from where the last read stopped, a line still being written (cut) waits for the next read; a file
    unreadable leaves a cause not read yet unknown (what was read stays), and the read goes on once it is back."""
    from diffusion_debug.record import RunRecord, make_anomaly
    from diffusion_debug.training.ranks.elsewhere import RankFiles, causes_kept_elsewhere, kept_elsewhere

    details = {"error": "ValueError: a bad batch", "error_type": "ValueError", "phase": "forward"}
    earlier = make_anomaly("step_error", component="model", module="conv_in", step=2, rank=1, details=details)
    config = DebugConfig(output_dir=str(tmp_path))
    rank1 = RunRecord(config, kind="training", run_dir=tmp_path, rank=1, events_name="events-rank1.jsonl")
    rank1.add_anomaly(earlier)
    path = tmp_path / "events-rank1.jsonl"
    assert len(path.read_text().splitlines()) == 2  # the start event, the earlier error
    stall = name_stall([Position(0, "backward", 3), Position(1, "raised", 3, error=details["error"])])
    desync = stall_anomaly(stall, {"end": False, "by": 0})
    files = RankFiles(tmp_path, rank=0)
    for _ in range(3):  # three reports while the cause stays missing
        assert causes_kept_elsewhere([desync, earlier], files, rank=0) == []
    assert files.lines_read == 2
    cause = make_anomaly("step_error", component="model", module="conv_in", step=3, rank=1, details=details)
    rank1.add_anomaly(cause)
    rank1.close()
    with open(path, "ab") as handle:
        handle.write(b'{"type": "anomaly", "kind": "st')  # a line its writer has not finished
    (found,) = causes_kept_elsewhere([desync, earlier], files, rank=0)
    assert (found.to_dict(), files.lines_read) == (cause.to_dict(), 3)
    assert kept_elsewhere([desync, earlier, found], files, 0, world_size=2) == []
    assert files.lines_read == 3  # nothing new: nothing parsed
    path.rename(tmp_path / "away.jsonl")
    path.mkdir()  # open() fails (OSError): the cause stays unknown, the report goes on
    assert causes_kept_elsewhere([desync], RankFiles(tmp_path, 0), rank=0) == []
    assert [a.to_dict() for a in kept_elsewhere([desync], files, 0, 2)] == [earlier.to_dict(), cause.to_dict()]
    path.rmdir()
    (tmp_path / "away.jsonl").rename(path)  # back: read on from where the last read stopped
    assert [a.to_dict() for a in kept_elsewhere([desync], files, 0, 2)] == [earlier.to_dict(), cause.to_dict()]
    assert files.lines_read == 3


def test_what_another_rank_recorded_alone_joins_the_main_record_once_as_its_own(tmp_path):
    """Rank 1's file: its debugger_error (outside the exchange), its copy of an exchanged nonfinite (which main's
    record holds, with the details the exchange added and another severity), its skipped_step of a step whose
    skip main holds as rank 0's (one a step). Only the debugger_error joins, as rank 1 wrote it; once."""
    from diffusion_debug.record import RunRecord, make_anomaly, rebuilt
    from diffusion_debug.training.ranks.elsewhere import RankFiles, kept_elsewhere

    error = make_anomaly("debugger_error", step=3, rank=1, details={"where": "recording", "error": "OSError: x"})
    grads = make_anomaly("nonfinite", component="model", module="0", parameter="0.weight", step=4, rank=1,
                         details={"nonfinite_parameters": 1})  # fmt: skip
    skip = {"scale_before": 16.0, "scale_after": 8.0, "reason": "grad_scaler"}
    skips = [make_anomaly("skipped_step", component="model", step=4, rank=r, details=skip) for r in (0, 1)]
    rank1 = RunRecord(DebugConfig(output_dir=str(tmp_path)), kind="training", run_dir=tmp_path, rank=1,
                      events_name="events-rank1.jsonl")  # fmt: skip
    for a in (error, grads, skips[1]):
        rank1.add_anomaly(a)
    rank1.close()
    exchanged = rebuilt(grads, severity="info", details={**grads.details, "follows": {"kind": "nonfinite", "rank": 0}})
    main = [exchanged, skips[0]]
    files = RankFiles(tmp_path, rank=0)
    (added,) = kept_elsewhere(main, files, 0, world_size=2)
    assert added.to_dict() == error.to_dict()
    assert kept_elsewhere([*main, added], files, 0, world_size=2) == []


def test_a_kind_every_rank_records_for_itself_is_not_copied_and_only_one_ranks_kinds_are_parsed(tmp_path, monkeypatch):
    """Rank 1's file: a start, 40 step rows, its own unwatched_parameters (every rank records it alike, the main
    its own), a step_amended of step 2, its debugger_error. Read 64 bytes at a time (rows split across reads): only
    the debugger_error is copied, the amended values are read, every line is counted once and only the two lines
    that name a kept kind or step_amended are parsed (json)."""
    from diffusion_debug.record import RunRecord, make_anomaly
    from diffusion_debug.training.ranks import elsewhere

    unwatched = make_anomaly("unwatched_parameters", message="2 parameters in no optimizer", component="model",
                             step=0, rank=1, details={"outside": {"count": 2}})  # fmt: skip
    error = make_anomaly("debugger_error", step=3, rank=1, details={"where": "recording", "error": "OSError: x"})
    rank1 = RunRecord(DebugConfig(output_dir=str(tmp_path)), kind="training", run_dir=tmp_path, rank=1,
                      events_name="events-rank1.jsonl")  # fmt: skip
    for step in range(40):
        rank1.add_step({"step": step, "loss": 0.5, "rank": 1})
    rank1.add_anomaly(unwatched)
    rank1.amend_step(2, {"loss": 0.25})
    rank1.add_anomaly(error)
    rank1.close()
    lines = (tmp_path / "events-rank1.jsonl").read_bytes().count(b"\n")
    parsed = []
    monkeypatch.setattr(elsewhere, "_CHUNK", 64)
    monkeypatch.setattr(elsewhere, "_row", lambda line, row=elsewhere._row: parsed.append(line) or row(line))
    files = elsewhere.RankFiles(tmp_path, rank=0)
    (added,) = elsewhere.kept_elsewhere([], files, 0, world_size=2)
    assert added.to_dict() == error.to_dict()
    assert (files.amended, files.lines_read, len(parsed)) == ({(1, 2, None): {"loss": 0.25}}, lines, 2)
    files.clear()  # clear_debug_history: the amended rows read go too (a later step 2 of a new phase keeps its own)
    assert (files.amended, elsewhere.kept_elsewhere([], files, 0, world_size=2)) == ({}, [])


def test_a_copy_of_another_ranks_row_found_skipped_after_it_was_written_is_marked_as_its_rank_marked_it(tmp_path):
    """Rank 1 records step 2 at monitored steps 1 and 2 (its count stayed: the first was skipped, found at the
    next call: ``mark_skipped``, ``joined=1``) and step 3. The main process keeps a copy of each; its report
    (``RankFiles`` reads rank 1's step_skipped, as ``training_report`` hands it on) marks the copy taken at
    monitored step 1 alone, in its record and in its events file (rank 1's file gone: ``every_rank_steps``).
    Before, the main's copies never said the step was skipped."""
    from diffusion_debug.record import RunRecord
    from diffusion_debug.record.run_dir import every_rank_steps
    from diffusion_debug.training.ranks.elsewhere import RankFiles

    config = DebugConfig(output_dir=str(tmp_path))
    main = RunRecord(config, kind="training", run_dir=tmp_path, rank=0)
    rank1 = RunRecord(config, kind="training", run_dir=tmp_path, rank=1, events_name="events-rank1.jsonl")
    rows = [{"step": step, "loss": 0.5, "rank": 1} for step in (2, 2, 3)]
    for joined, row in enumerate(rows, 1):
        rank1.add_step(row, joined=joined)
        main.add_rank_step(row, joined=joined)
        if joined == 2:
            rank1.mark_skipped(2, "grad_scaler", joined=1)
    rank1.close()
    files = RankFiles(tmp_path, rank=0)
    files.read([1])
    assert files.amended == {(1, 2, 1): {"skipped": "grad_scaler"}}
    for (rank, step, joined), values in files.amended.items():
        main.amend_rank_step(rank, step, values, joined=joined)
    main.close()
    expected = [{"step": 2, "loss": 0.5, "rank": 1, "skipped": "grad_scaler"}, *rows[1:]]
    assert list(main.rank_steps) == expected
    assert every_rank_steps(tmp_path) == expected  # rank 1's own file
    (tmp_path / "events-rank1.jsonl").unlink()
    assert every_rank_steps(tmp_path) == expected  # the main's copies stand in


def test_the_main_copy_of_another_ranks_anomaly_takes_the_repeats_its_rank_folded(tmp_path):
    """Rank 1's debugger_error at step 3, again at steps 4 and 5 (its sink folds them: count 3, last_step 5).
    A report after step 3 copies it (count 1); the next report's copy, and the one added before, read 3 and 5."""
    import logging

    from diffusion_debug.core import AnomalySink
    from diffusion_debug.record import RunRecord
    from diffusion_debug.training.ranks.elsewhere import RankFiles, kept_elsewhere

    config = DebugConfig(output_dir=str(tmp_path))
    rank1 = RunRecord(config, kind="training", run_dir=tmp_path, rank=1, events_name="events-rank1.jsonl")
    sink = AnomalySink(rank1, config, logging.getLogger("test"))
    files = RankFiles(tmp_path, rank=0)
    for step in (3, 4, 5):
        sink.debugger_error("recording", OSError("disk"), step=step, rank=1)
        sink.end_step()
        rank1.flush_to_disk()
        if step == 3:
            (earlier,) = kept_elsewhere([], files, 0, world_size=2)
    own = [(a.step, a.details["count"], a.details["last_step"]) for a in rank1.anomalies]
    (fresh,) = kept_elsewhere([], RankFiles(tmp_path, rank=0), 0, world_size=2)
    assert kept_elsewhere([earlier], files, 0, world_size=2) == []
    assert own == [(3, 3, 5)]
    assert [(a.step, a.details["count"], a.details["last_step"]) for a in (fresh, earlier)] == own * 2
    assert earlier.details["count"] == 3


def test_a_copy_of_another_ranks_row_read_anew_is_the_one_its_rank_named_where_its_step_number_repeats(tmp_path):
    """Rank 1 (a RunRecord writing its own events file) records step 2 at monitored step 1 (held, its norm scaled:
    65536.0), reads it anew at the next (``amend_step``: 1.0, ``joined=1``), then records step 2 again at
    monitored step 2 (its scaler skipped step 1: the count stayed; 2.0) and step 3 (3.0), each row with its
    monitored step. The main process keeps a copy of each, with its monitored step. Its report (``RankFiles``
    reads rank 1's step_amended) amends the copy taken at monitored step 1 alone (given as 2.0: ``3`` and ``3.0``
    alike; the same values again write nothing):
    in its record, as rank 1's own file reads, and from the main's events file alone (rank 1's file gone:
    ``every_rank_steps``' copies and ``rebuild_summary``), the rows holding no ``joined``. Before, both copies of
    step 2 took 1.0 (the later one the held row's values), in summary.json and the rebuilt summary."""
    from diffusion_debug.record import RunRecord
    from diffusion_debug.record.run_dir import every_rank_steps, rebuild_summary
    from diffusion_debug.training.ranks.elsewhere import RankFiles

    config = DebugConfig(output_dir=str(tmp_path))
    main = RunRecord(config, kind="training", run_dir=tmp_path, rank=0)
    rank1 = RunRecord(config, kind="training", run_dir=tmp_path, rank=1, events_name="events-rank1.jsonl")
    rows = [{"step": 2, "grad_norm": norm, "rank": 1} for norm in (65536.0, 2.0)] + [
        {"step": 3, "grad_norm": 3.0, "rank": 1}
    ]
    for joined, row in enumerate(rows, 1):
        rank1.add_step(row, joined=joined)
        main.add_rank_step(row, joined=joined)
        if joined == 1:
            rank1.amend_step(2, {"grad_norm": 1.0}, joined=1)
    rank1.close()
    files = RankFiles(tmp_path, rank=0)
    files.read([1])
    assert files.amended == {(1, 2, 1): {"grad_norm": 1.0}}
    assert main.amend_rank_step(1, 2.0, {"grad_norm": 1.0}, joined=1) is True
    assert main.amend_rank_step(1, 2, {"grad_norm": 1.0}, joined=1) is False
    main.close()
    expected = [{"step": 2, "grad_norm": 1.0, "rank": 1}, *rows[1:]]
    assert list(main.rank_steps) == expected
    written = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(r["rank"], r["joined"], r["values"]) for r in written if r["type"] == "step_amended"] == [
        (1, 1, {"grad_norm": 1.0})
    ]
    assert every_rank_steps(tmp_path) == expected  # rank 1's own file
    (tmp_path / "events-rank1.jsonl").unlink()
    assert every_rank_steps(tmp_path) == expected  # the main's copies stand in
    assert rebuild_summary(tmp_path)["steps"] == expected
