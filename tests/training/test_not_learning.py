"""A run that does not learn (issue 21, item 3): the optimizer steps move no weight although the
gradients are normal. lr=0, an optimizer holding another model's parameters and zero_grad()
between backward() and step() are each named at the step the fifth still update is read (step 5:
the updates of steps 0-4), with the evidence; the clean loop of the same shape stays quiet.

Long because each cause the diagnosis tells is planted in a real loop of its own (a UNet's, textual
inversion's, a GAN's two optimizers, LBFGS's closure, DeepSpeed ZeRO's engine) beside the clean one it must
not be told in, and these share the module's helpers."""

import copy
import math
import weakref

import pytest
import torch
from torch.nn.functional import softplus

from diffusion_debug import DebugConfig
from diffusion_debug.record import severity_rank
from diffusion_debug.training.judges.not_learning import STALL_UPDATES, STILL_RATIO, StallWatch
from diffusion_debug.training.judges.stall_causes import diagnose
from diffusion_debug.training.measure.gradients import TrainableParameters

# the coverage check looks for the optimizers it was not given among the live objects
pytestmark = pytest.mark.usefixtures("only_the_tests_objects")


def _config(tmp_path):
    return DebugConfig(output_dir=str(tmp_path), log_level="error", memory_tracking=False, stream_events=False)


def _serious(tdbg):
    return [a for a in tdbg.report().anomalies if severity_rank(a.severity) >= 1]


def _other_models_optimizer(unet):
    return torch.optim.AdamW(copy.deepcopy(unet).parameters(), lr=1e-4)


@pytest.mark.parametrize(
    "fault, reason",
    [
        (dict(lr=0.0), "lr_zero"),
        (dict(optimizer=_other_models_optimizer), "optimizer_params"),
        (dict(before_step=lambda step, unet, optimizer: optimizer.zero_grad()), "gradients_cleared"),
    ],
    ids=["lr_zero", "another_models_parameters", "zero_grad_before_step"],
)
def test_a_run_whose_updates_move_nothing_is_named_with_its_cause(tmp_path, unet_loop, fault, reason):
    # what any torch.compile earlier in the process may leave until the collector runs: a weakref.proxy
    # whose object died (the coverage check, which walks the collector's list, once raised on it)
    gone = torch.nn.Linear(1, 1)
    dead = weakref.proxy(gone)
    del gone
    tdbg, losses = unet_loop(_config(tmp_path), 7, **fault)
    del dead
    assert len(set(losses)) == 1  # nothing moved: the same loss on the same batch every step
    serious = _serious(tdbg)
    if reason == "optimizer_params":
        # the optimizer-coverage check says it first, at step 0: the watched parameters are in no optimizer
        coverage = serious.pop(0)
        assert (coverage.kind, coverage.step, coverage.details.get("not_optimized", {}).get("count")) == (
            "unwatched_parameters",
            0,
            len(TrainableParameters.of(tdbg.model)),
        ), [a.to_dict() for a in tdbg.report().anomalies]  # say what came instead, if it ever does
        assert tdbg.report().summary["headline"]["kind"] == "unwatched_parameters"
    (found,) = serious
    assert (found.kind, found.step, found.component, found.severity) == ("not_learning", 5, "optimizer", "warning")
    d = found.details
    assert (d["reason"], d["first_step"], d["last_step"], d["updates"], d["max_update_ratio"]) == (
        reason,
        0,
        4,
        STALL_UPDATES,
        0.0,
    )
    watched = len(TrainableParameters.of(tdbg.model))
    assert d["watched_parameters"] == watched
    assert d["held_by_optimizer"] == (0 if reason == "optimizer_params" else watched)
    assert d["grad_norm"] > 1.0  # normal gradients, never applied
    if reason != "optimizer_params":
        assert d["lr"] == (0.0 if reason == "lr_zero" else 1e-4)
    if reason == "gradients_cleared":
        assert d["state_empty"] is True  # AdamW skipped every parameter: its grad was None
        assert found.message == (
            f"No weight moved in the 5 optimizer steps 0-4 (the largest update 0x a module's norm) although the "
            f"gradients are normal (norm {d['grad_norm']:.3g}): the optimizer holds them with a learning rate above "
            "0, so their gradients are gone when optimizer.step() runs: call zero_grad() after step(), not between "
            "backward() and step(); the optimizer holds no state for them: its step never saw a gradient."
        )


def test_the_clean_loop_of_the_same_shape_moves_its_weights_and_stays_quiet(tmp_path, unet_loop):
    tdbg, losses = unet_loop(_config(tmp_path), 7)
    assert losses[-1] < losses[0]
    assert _serious(tdbg) == []
    assert all(r["max_applied_update_ratio"] > 1e-4 for r in tdbg.report().steps[1:])


def test_skipped_steps_vanishing_gradients_and_one_still_warmup_step_restart_the_count():
    still, moving = {"a": 0.0, "b": math.inf}, {"a": 1e-3}
    watch = StallWatch()
    found = [
        watch.update(0, still, grad_norm=0.5, skipped=False),  # a warmup's first step at lr 0
        watch.update(1, moving, grad_norm=0.5, skipped=False),
        *[watch.update(s, still, grad_norm=0.5, skipped=s == 4) for s in range(2, 6)],  # 4: skipped by the scaler
        *[watch.update(s, still, grad_norm=math.nan if s == 7 else 0.5, skipped=False) for s in range(6, 9)],
        *[watch.update(s, still, grad_norm=0.5, skipped=False) for s in range(9, 15)],
    ]
    assert [s for s, clear in enumerate(found) if clear] == [12]  # updates 8-12: the first five in a row
    assert (watch.first_step, watch.last_step, watch.updates) == (8, 14, 7)
    assert watch.update(15, moving, grad_norm=0.5, skipped=False) is False and not watch.flagged
    watch.policy_skipped = True  # policy skip zeroed the gradients of the step whose update comes next
    assert [watch.update(s, still, grad_norm=0.5, skipped=False) for s in range(16, 22)] == [False] * 5 + [True]


def test_bf16_weights_whose_updates_round_away_are_told_apart_from_cleared_gradients():
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7)
    model(torch.ones(1, 4, dtype=torch.bfloat16)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))  # lost to rounding
    params = TrainableParameters.of(model)
    assert diagnose(optimizer, params) == {
        "reason": "below_precision",
        "dtype": "bfloat16",
        "watched_parameters": 2,
        "held_by_optimizer": 2,
        "other_parameters": 0,
        "lr": 1e-7,
        "state_empty": False,
    }
    assert diagnose(None, params) == {"reason": "unknown"}


def test_an_optimizer_that_makes_its_own_lr_is_diagnosed_without_one():
    # transformers' Adafactor(relative_step=True, lr=None) keeps lr None in its group: float(None) raised
    from transformers.optimization import Adafactor

    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    optimizer = Adafactor(model.parameters(), relative_step=True, warmup_init=True, lr=None)
    model(torch.ones(1, 4, dtype=torch.bfloat16)).sum().backward()
    params = TrainableParameters.of(model)
    assert diagnose(optimizer, params, 0.5) == {
        "reason": "gradients_cleared",
        "watched_parameters": 2,
        "held_by_optimizer": 2,
        "other_parameters": 0,
        "lr": None,
        "state_empty": True,
    }


@pytest.mark.parametrize("lr, named", [(5e-3, False), (2.0, True)], ids=["quiet", "spike_named_model"])
def test_a_run_that_trains_only_an_embeddings_new_row_reads_that_rows_update(tmp_path, lr, named):
    # textual inversion: only the new token's row (appended last) learns and every other row is put
    # back after each step. The sampled block was the table's middle: it read 0.0 at every step, and
    # at lr 2 (AdamW moving the new row by ~60 times the norm of its block in one step) nothing was said
    from diffusion_debug import TrainingDebugger

    torch.manual_seed(0)
    model, head = torch.nn.Sequential(torch.nn.Embedding(1001, 8)), torch.nn.Linear(8, 1).requires_grad_(False)
    table = torch.nn.init.normal_(model[0].weight, std=0.02)  # as CLIP's token embedding
    kept = table.detach().clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    tdbg = TrainingDebugger({"text_encoder": model} if named else model, config=_config(tmp_path))
    weights = []
    for step in range(12):
        weights.append(table.detach().clone())
        loss = (head(model(torch.tensor([1000, 3, 7]))).mean() - 1.0) ** 2
        loss.backward()
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            table[:1000] = kept[:1000]
    assert (table[1000] - kept[1000]).norm() > 0.1  # it learned
    # the block is the table's last 128 elements (16 rows): the naive reference, read on the steps of
    # the per-module schedule (the first ten, then one in five)
    block = [w.double().reshape(-1)[-128:] for w in weights]
    naive = [((block[k] - block[k - 1]).norm() / block[k - 1].norm()).item() for k in range(1, 11)]
    read = [r for r in tdbg.report().steps[1:] if "max_applied_update_ratio" in r][:10]  # an anomaly reads on
    assert [r["step"] for r in read] == list(range(1, 11))
    assert [r["max_applied_update_ratio"] for r in read] == pytest.approx(naive, rel=1e-6)
    serious = _serious(tdbg)
    if lr < 1:
        assert max(naive) < 0.2 and serious == []
        return
    spikes = [(a.kind, a.step, a.module, a.details["reason"], a.details["detected_at_step"]) for a in serious]
    assert spikes[0] == ("lr_spike", 0, "text_encoder.0", "applied_update", 1)
    assert serious[0].details["update_to_weight_ratio"] == pytest.approx(naive[0], rel=1e-6) and naive[0] > 10
    # the figure is the last rows' (the whole table moved far less): the message says whose it is
    assert serious[0].message == (
        "The optimizer step of step 0 moved 1 of 1 modules by more than 1 times their own norm (the most: "
        f"text_encoder.0's last rows, where added tokens go, {naive[0]:.3g}x; measured from the weights): lower "
        "the learning rate or warm it up."
    )


def test_bf16_weights_under_sgd_without_momentum_round_away_and_are_not_cleared_gradients():
    # plain SGD keeps no state whatever happens: its plain step lr x |g| / |w| against bf16's epsilon decides
    model = torch.nn.Linear(64, 64).to(torch.bfloat16)
    model(torch.ones(16, 64, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    params = TrainableParameters.of(model)
    grad_norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
    weight_norm = math.sqrt(sum(float(p.detach().double().square().sum()) for p in model.parameters()))
    small, large = (
        diagnose(torch.optim.SGD(model.parameters(), lr=1e-5), params, grad_norm),
        diagnose(torch.optim.SGD(model.parameters(), lr=10.0), params, grad_norm),
    )
    assert (small["reason"], small["dtype"], small["state_empty"]) == ("below_precision", "bfloat16", True)
    assert small["step_ratio"] == pytest.approx(1e-5 * grad_norm / weight_norm, rel=1e-9)
    assert small["step_ratio"] < torch.finfo(torch.bfloat16).eps / 2 < large["step_ratio"]
    assert large["reason"] == "gradients_cleared"


def test_a_converged_float32_run_whose_updates_round_away_is_not_reported_as_not_learning(tmp_path):
    # plain SGD fits a linear map to a loss of ~2e-13 with gradients of ~7e-7 (above the vanishing
    # threshold): its updates then round away in float32 and it keeps no optimizer state; that is
    # no stall and no cleared gradient, nothing is left to learn (it was not_learning at step 219)
    from diffusion_debug import TrainingDebugger

    torch.manual_seed(0)
    x = torch.randn(256, 8)
    y = x @ torch.randn(8, 1)
    torch.nn.Linear(8, 1)  # the initial weights the report came with
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tdbg = TrainingDebugger(model, config=_config(tmp_path))
    for step in range(250):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        info = tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        optimizer.step()
        optimizer.zero_grad()
    assert float(loss) < 1e-12 and info["grad_norm"] > DebugConfig().grad_vanishing_threshold
    read = [r["max_applied_update_ratio"] for r in tdbg.report().steps[-10:] if "max_applied_update_ratio" in r]
    assert len(read) == 2 and all(ratio <= STILL_RATIO for ratio in read)  # still (one step in five read)
    assert not [a for a in tdbg.report().anomalies if a.kind == "not_learning"]


def _beside_a_rank_that_learns(tdbg, monkeypatch, until: int) -> list[int]:
    """Makes ``tdbg`` rank 0 of two; rank 1 stands for the shard that learns (FSDP2's textual inversion):
    its weights move in every update it reads up to monitored step ``until``, on the steps every rank
    reads (``step.detail``: the first ten, then one in five) and on no other, and it finds nothing of its
    own. Returns the monitored steps (from 1) whose details every rank exchanged."""
    from diffusion_debug.training.ranks.summary import ReduceLayout

    ctx, exchanged, reduced = tdbg._steps.ctx, [], []

    def all_reduce_max(values):
        reduced.append(values)
        monitored = len(reduced)
        reads = 1 < monitored <= 10 or (monitored - 1) % 5 == 0
        other = ReduceLayout(2).pack({}, {"weights_moved": reads and monitored <= until}, rank=1)
        return [max(a, b) for a, b in zip(values, other)]

    def gather_objects(payload):
        exchanged.append(len(reduced))
        return [payload, {"row": payload["row"], "anomalies": [], "records": [], "buckets": None}]

    for name, value in dict(distributed=True, world_size=2, all_reduce_max=all_reduce_max).items():
        monkeypatch.setattr(ctx, name, value)
    monkeypatch.setattr(ctx, "gather_objects", gather_objects)
    return exchanged


def test_a_shard_still_beside_a_learning_rank_reads_on_the_schedule_again_after_a_finding(tmp_path, monkeypatch):
    # rank 0's shard of the table never moves (every row put back) while rank 1's learns until step 35. A
    # loss spike of rank 0's own at step 12 reads every step for ten steps: rank 0 counts five still updates
    # by step 20 (rank 1 reads only the steps of the schedule), a stall withdrawn once the reduce says rank
    # 1's weights moved. It marked the schedule again before it was withdrawn: rank 0 read every step, and
    # every rank exchanged its details every fifth step, for the rest of the run. Once rank 1 stops learning
    # the stall stands (the updates of steps 39-59, read on the schedule) and the steps after it read in full
    from diffusion_debug import TrainingDebugger

    torch.manual_seed(0)
    table = torch.nn.Embedding(8, 4)
    kept = table.weight.detach().clone()
    optimizer = torch.optim.SGD(table.parameters(), lr=0.05)
    tdbg = TrainingDebugger(table, config=_config(tmp_path))
    exchanged = _beside_a_rank_that_learns(tdbg, monkeypatch, until=36)
    generator = torch.Generator().manual_seed(100)
    for step in range(63):
        loss = (table(torch.randint(0, 8, (4, 3), generator=generator)).sum(-1) - 1.0).square().mean()
        loss.backward()
        tdbg.monitor_training_step(loss * 100 if step == 12 else loss, optimizer=optimizer, step=step)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            table.weight.copy_(kept)
    found = tdbg.report().anomalies
    assert [(a.kind, a.step, a.rank) for a in found] == [("loss_spike", 12, 0), ("not_learning", 60, 0)]
    assert [found[1].details[k] for k in ("first_step", "last_step", "updates")] == [39, 59, 5]
    read = [r["step"] for r in tdbg.report().steps if "max_applied_update_ratio" in r]
    assert read == [*range(1, 11), *range(13, 23), 25, 30, 35, 40, 45, 50, 55, 60, 61, 62]
    # the spike's step (monitored 13) and the stall that stands (step 60): the one withdrawn at step 20 (the
    # updates of steps 15-19) set the reduce's "has anomalies" flag before it was withdrawn, and every rank
    # exchanged its details there (monitored 21) for a finding gone by then
    assert exchanged == [13, 61]


def _textual_inversion(text_encoder, tmp_path, fault: str, steps: int = 7):
    """Textual inversion on the tiny CLIP text encoder under plain SGD without momentum (no optimizer state
    whatever happens): a placeholder token appended as the token table's last row, every other weight frozen,
    one fixed batch that holds it. After monitoring, before ``optimizer.step()``, the script's gradient mask
    zeroes every row but the one it keeps: the placeholder's (``fault="none"``), or the row before it
    (``"mask_misses"``: the mask misses the placeholder token); ``"zero_grad"`` calls ``zero_grad()`` there
    instead; ``"put_back"`` keeps the right mask and then puts every row back after the step, the
    placeholder's too. Returns the debugger (closed), the table's rows as they started, the table, the
    optimizer and the norm of the gradient each step's ``optimizer.step()`` received (the naive reference)."""
    from diffusion_debug import TrainingDebugger

    torch.manual_seed(0)
    model = copy.deepcopy(text_encoder).train()
    model.resize_token_embeddings(model.config.vocab_size + 1)
    placeholder = model.config.vocab_size - 1
    model.requires_grad_(False)
    table = model.get_input_embeddings().weight.requires_grad_(True)
    started = table.detach().clone()
    optimizer = torch.optim.SGD([table], lr=1e-2)
    tdbg = TrainingDebugger(model, config=_config(tmp_path))
    ids = torch.tensor([[0, 11, 29, placeholder, 5, 2]])
    target = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    kept = placeholder - 1 if fault == "mask_misses" else placeholder
    received = []
    try:
        for step in range(steps):
            loss = (model(ids).last_hidden_state[0, 3] - target).square().mean()
            loss.backward()
            tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
            if fault == "zero_grad":
                optimizer.zero_grad()
            else:
                with torch.no_grad():
                    table.grad[torch.arange(len(table)) != kept] = 0.0
            received.append(0.0 if table.grad is None else table.grad.double().norm().item())
            optimizer.step()
            optimizer.zero_grad()
            if fault == "put_back":
                with torch.no_grad():
                    table.copy_(started)
    finally:
        tdbg.close()
    return tdbg, started, table, optimizer, received


@pytest.mark.parametrize(
    "fault, reason, cleared, zero_at_step",
    [
        ("mask_misses", "gradients_zeroed", 0, True),
        ("zero_grad", "gradients_cleared", 1, None),
        ("put_back", "undone_after_step", 0, False),
    ],
)
def test_textual_inversion_under_plain_sgd_names_what_its_step_received(
    tmp_path, _tiny_sd, fault, reason, cleared, zero_at_step
):
    # SGD without momentum keeps no state, so its empty state said "gradients cleared, call zero_grad() after
    # step()" whatever stopped the run; the step's own hook (on while the updates stay still) tells a mask that
    # misses the placeholder token (its gradients reach step() zeroed) from a zero_grad() before step() (none
    # reach it) and from a restore after step() (the monitored gradients reached it)
    tdbg, started, table, optimizer, received = _textual_inversion(_tiny_sd.text_encoder, tmp_path, fault)
    assert torch.equal(table, started)  # nothing learned
    assert not optimizer._optimizer_step_pre_hooks  # the hook went off once the stall was reported
    (found,) = _serious(tdbg)
    d = found.details
    assert (found.kind, found.step, d["reason"], d["first_step"], d["last_step"], d["updates"]) == (
        "not_learning",
        5,
        reason,
        0,
        4,
        STALL_UPDATES,
    )
    assert (d["state_empty"], d["lr"], d["held_by_optimizer"], d["held_at_step"], d["cleared_at_step"]) == (
        True,
        1e-2,
        1,
        1,
        cleared,
    )
    if fault == "zero_grad":
        assert d["grad_norm_at_step"] == 0.0 and found.message.endswith(
            "call zero_grad() after step(), not between backward() and step(); the optimizer holds no state for "
            "them: its step never saw a gradient."
        )
        return
    # the naive reference: the gradient step 4's optimizer.step() received (the last still update's)
    assert d["grad_norm_at_step"] == pytest.approx(received[4], rel=1e-6)
    assert (d["grad_norm_at_step"] == 0.0) is zero_at_step and d["grad_norm"] > 1e-3
    if fault == "mask_misses":
        assert found.message == (
            f"No weight moved in the 5 optimizer steps 0-4 (the largest update 0x a module's norm) although the "
            f"gradients are normal (norm {d['grad_norm']:.3g}): their gradients reach optimizer.step() zeroed (norm "
            "0 there): a mask or hook between monitor_training_step and step() zeroes the rows that should learn "
            "(textual inversion's mask must keep the placeholder token's id, as the tokenizer gives it once the "
            "token is added), or zero_grad(set_to_none=False) runs before step()."
        )
    else:
        assert found.message.endswith(
            f"optimizer.step() received their gradients (norm {d['grad_norm_at_step']:.3g}) and the next step found "
            "the weights where they were: something after step() puts them back (textual inversion's restore of "
            "the other rows must leave the placeholder token's row out) or loads them again."
        )


def test_textual_inversion_whose_mask_keeps_the_placeholder_learns_and_stays_quiet(tmp_path, _tiny_sd):
    tdbg, started, table, optimizer, _ = _textual_inversion(_tiny_sd.text_encoder, tmp_path, "none")
    moved = (table - started).norm(dim=1).nonzero().flatten().tolist()
    assert moved == [len(table) - 1]  # the placeholder's row alone
    assert _serious(tdbg) == []
    assert not optimizer._optimizer_step_pre_hooks  # none of ours left on it


def test_what_the_step_received_decides_among_cleared_zeroed_and_undone():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    params = TrainableParameters.of(model)

    def reason(cleared, at_step, grad_norm=2.0):
        seen = {"held_at_step": 2, "cleared_at_step": cleared, "grad_norm_at_step": at_step}
        return diagnose(optimizer, params, grad_norm, seen)["reason"]

    assert [reason(2, 0.0), reason(1, 0.0), reason(0, 0.0), reason(0, 1e-7), reason(0, 3e-6), reason(0, 2.0)] == [
        "gradients_cleared",  # none reached the step
        "gradients_zeroed",  # one none, the other zero
        "gradients_zeroed",
        "gradients_zeroed",  # below 1e-6 of the monitored norm
        "undone_after_step",
        "undone_after_step",
    ]
    assert [reason(0, 0.0, math.nan), reason(0, 1e-30, math.nan)] == ["gradients_zeroed", "undone_after_step"]
    assert diagnose(optimizer, params, 2.0)["reason"] == "gradients_cleared"  # no step seen: as before


def test_no_step_seen_of_an_optimizer_whose_state_shows_its_steps_saw_gradients_names_no_cause():
    """No step's reading (a compiled step reads nothing) of an AdamW holding state for the parameters: its steps
    saw gradients, so "their gradients are gone when optimizer.step() runs" (the fallback for an optimizer
    without state) is unfounded there; the cause is unknown."""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    params = TrainableParameters.of(model)
    assert diagnose(optimizer, params, 2.0)["reason"] == "gradients_cleared"  # no state: no gradient ever seen
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    found = diagnose(optimizer, params, 2.0)
    assert (found["reason"], found["state_empty"], found["held_by_optimizer"]) == ("unknown", False, 2)


def test_the_steps_watch_recompiles_no_compiled_optimizer_step():
    """``torch.compile``'d ``optimizer.step()`` (PyTorch's recipe) guards on the optimizer's step hooks:
    a hook put on when a run of still updates began (a warmup's first step at lr 0, a clean run's too)
    and taken off after recompiled the step each time. The hook goes on at the first monitored step,
    before the step is compiled, and stays; under compilation it reads nothing (traced away)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params, watch = TrainableParameters.of(model), StallWatch()

    @torch.compile(backend="eager")
    def step():
        optimizer.step()

    def one(updates):
        model(torch.ones(1, 4)).sum().backward()
        watch.updates = updates  # a run of still updates counted (or not) at this monitored step
        watch.follow_step(optimizer, params)
        step()
        optimizer.zero_grad()

    try:
        one(0)  # the first monitored step: nothing still
        one(0)  # (SGD's momentum buffers made at the first step: its own recompile)
        graphs = counters["stats"]["unique_graphs"]
        for updates in (1, 2, 0, 1, 0):
            one(updates)
        assert counters["stats"]["unique_graphs"] == graphs
        assert watch.seen.read() is None  # compiled: nothing seen, the diagnosis as without a step's reading
        model(torch.ones(1, 4)).sum().backward()
        watch.updates = 1
        watch.follow_step(optimizer, params)
        optimizer.step()  # eager, while still: seen
        assert watch.seen.read()["held_at_step"] == 2
    finally:
        watch.seen.stop()
        torch._dynamo.reset()
    assert not optimizer._optimizer_step_pre_hooks


def _gan_that_stalls(tmp_path, steps=7):
    """A GAN's loop (``test_several_optimizers``'s shape) on one debugger, each model under its own SGD
    without momentum, monitored after each backward with the optimizer that steps next: the discriminator's
    lr is 0 and the generator's gradients are cleared (``zero_grad()`` before its step), so no update moves a
    weight. The debugger (closed) and the two optimizers."""
    from diffusion_debug import TrainingDebugger

    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    discriminator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=0.0)
    opt_g = torch.optim.SGD(generator.parameters(), lr=1e-2)
    tdbg = TrainingDebugger({"generator": generator, "discriminator": discriminator}, config=_config(tmp_path))
    data = torch.Generator().manual_seed(1)
    hooked = []
    for it in range(steps):
        real, fake = torch.randn(16, 4, generator=data) + 3, generator(torch.randn(16, 4, generator=data))
        opt_d.zero_grad()
        loss_d = softplus(-discriminator(real)).mean() + softplus(discriminator(fake.detach())).mean()
        loss_d.backward()
        tdbg.monitor_training_step(loss_d, optimizer=opt_d, step=2 * it)
        opt_d.step()
        opt_g.zero_grad()
        loss_g = softplus(-discriminator(fake)).mean()
        loss_g.backward()
        tdbg.monitor_training_step(loss_g, optimizer=opt_g, step=2 * it + 1)
        opt_g.zero_grad()  # the fault: the generator's gradients gone before its step
        opt_g.step()
        hooked.append((len(opt_d._optimizer_step_pre_hooks), len(opt_g._optimizer_step_pre_hooks)))
    tdbg.close()
    return tdbg, opt_d, opt_g, hooked


def test_each_of_a_gans_optimizers_carries_the_step_hook_and_the_stall_names_the_one_that_stepped(tmp_path):
    # one hook, moved to the optimizer of each monitored step, was on the generator's optimizer when the
    # stall was reported (step 5) while the update read there was the discriminator's step (step 4): its lr 0
    # was diagnosed with the generator's optimizer and the discriminator's step reading, "undone_after_step"
    tdbg, opt_d, opt_g, hooked = _gan_that_stalls(tmp_path)
    assert set(hooked[1:]) == {(1, 1)}  # each one's from its first step judged (step 1, step 2), staying on
    (found,) = _serious(tdbg)
    d = found.details
    assert (found.kind, found.step, d["reason"], d["first_step"], d["last_step"]) == (
        "not_learning",
        5,
        "lr_zero",
        0,
        4,
    )
    assert (d["lr"], d["held_by_optimizer"], d["watched_parameters"], d["stepped_optimizer"]) == (
        0.0,
        4,
        8,
        "SGD holding discriminator.0.weight and 3 more",
    )
    # the cause is one optimizer's of the two: the message says whose (the details alone said it before)
    assert found.message.startswith(
        "No weight moved in the 5 optimizer steps 0-4 (the largest update 0x a module's norm) although the "
        "gradients are normal (norm "
    )
    assert (
        "; read from SGD holding discriminator.0.weight and 3 more, the optimizer that stepped last: the learning "
        "rate is 0 in every param group that holds them" in found.message
    )
    assert not opt_d._optimizer_step_pre_hooks and not opt_g._optimizer_step_pre_hooks  # off at close


def test_a_closure_optimizers_step_is_read_after_its_closure_made_the_gradients(tmp_path):
    """``torch.optim.LBFGS`` steps with ``step(closure)``: its closure makes the gradients the step applies, so
    what the step received is read after the closure's first call, not before the step. The loop clears the
    gradients before ``step()`` (harmless there) and puts the weights back after it: the run is undone after
    its steps. Read before the closure, no gradient reached the step: ``gradients_cleared``, advising to move a
    ``zero_grad()`` that changed nothing."""
    from diffusion_debug import TrainingDebugger

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    started = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=2)
    x, y = torch.randn(16, 4, generator=torch.Generator().manual_seed(1)), torch.ones(16, 1)
    tdbg = TrainingDebugger(model, config=_config(tmp_path))
    received = []

    def closure():
        optimizer.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        received.append(math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters())))
        return loss

    for step in range(7):
        loss = closure()
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        optimizer.zero_grad()  # LBFGS's closure makes the step's gradients again
        optimizer.step(closure)
        with torch.no_grad():
            for p, kept in zip(model.parameters(), started):
                p.copy_(kept)
    tdbg.close()
    (found,) = _serious(tdbg)
    d = found.details
    assert (found.kind, found.step, d["reason"], d["first_step"], d["last_step"]) == (
        "not_learning",
        5,
        "undone_after_step",
        0,
        4,
    )
    assert (d["held_at_step"], d["cleared_at_step"], d["state_empty"]) == (4, 0, False)
    # the first of its closure's calls in step 4's step() (3 a step: the loop's, then max_iter 2): as the monitor read
    assert d["grad_norm_at_step"] == pytest.approx(received[13], rel=1e-6) == pytest.approx(d["grad_norm"], rel=1e-6)


def _put_back_after_each_engine_step(engine, optimizer, tmp_path, steps=7):
    """A DeepSpeed engine's loop on one batch whose weights are put back after each ``engine.step()``, monitored
    before it: the debugger (closed), how many step pre-hooks its torch optimizer carried after the last step,
    and the norm of the gradients each step received (after ``engine.backward``)."""
    from diffusion_debug import TrainingDebugger
    from diffusion_debug.training.measure.optimizer_state import raw_optimizer

    kept = [p.detach().clone() for p in engine.module.parameters()]
    tdbg = TrainingDebugger(engine, config=_config(tmp_path))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)).to(next(engine.module.parameters()).dtype)
    received = []
    for step in range(steps):
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]  # (ZeRO-2's: in its buckets)
        received.append(math.sqrt(sum(float(g.double().square().sum()) for g in grads)))
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        engine.step()
        hooked = len(raw_optimizer(optimizer)._optimizer_step_pre_hooks)
        with torch.no_grad():
            for p, k in zip(engine.module.parameters(), kept):
                p.copy_(k)
    tdbg.close()
    return tdbg, hooked, received


@pytest.mark.parametrize("stage, lr", [(1, 0.01), (2, 0.01), (2, 0.0)])
def test_under_deepspeed_zero_a_stall_names_no_cause_the_engines_optimizer_cannot_show(
    one_rank_group, deepspeed_engine, tmp_path, stage, lr
):
    """ZeRO-1/2 (one CPU rank in this process): the engine's ``step()`` steps a torch optimizer of flat float32
    partitions, whose step pre-hook fires but holds none of the watched parameters, whose ``.grad`` ZeRO has
    taken into its buckets by then: what the step received cannot be read, so no hook goes on. Weights put back
    after each ``engine.step()`` were told 'the optimizer holds none of the watched model's parameters'
    (``optimizer_params``: the partitions are not the watched tensors); the diagnosis now says only what it
    can read there (an lr of 0), else that the cause is unknown."""

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    engine, optimizer = deepspeed_engine(model, stage, {"optimizer": {"type": "SGD", "params": {"lr": lr}}})
    tdbg, hooked, _ = _put_back_after_each_engine_step(engine, optimizer, tmp_path)
    assert hooked == 0
    (found,) = _serious(tdbg)
    d = found.details
    reason = "lr_zero" if lr == 0 else "unknown"
    assert (found.kind, found.step, d["reason"], d["first_step"], d["last_step"], d["lr"]) == (
        "not_learning",
        5,
        reason,
        0,
        4,
        lr,
    )
    assert "held_at_step" not in d and d["held_by_optimizer"] == 0 and d["watched_parameters"] == 4
    if reason == "unknown":
        assert found.message.endswith("the cause is unknown: check the optimizer and the loop's order.")


@pytest.mark.parametrize(
    "precision, lr, reason",
    [("fp32", 0.01, "undone_after_step"), ("fp32", 0.0, "lr_zero"), ("bf16", 0.01, "unknown")],
)
def test_under_deepspeed_stage0_a_stall_is_diagnosed_from_what_its_step_received(
    one_rank_group, deepspeed_engine, tmp_path, precision, lr, reason
):
    """DeepSpeed without ZeRO (stage 0, one CPU rank in this process): in float32 the engine's ``step()`` steps
    the torch optimizer it was given, on the watched parameters themselves and their reduced ``.grad``, so its
    step pre-hook reads what the step received, as without DeepSpeed. No hook went on under any DeepSpeed
    engine, and weights put back after each ``engine.step()`` were told ``gradients_cleared`` ("call
    zero_grad() after step()"), the fallback where no step was seen. In bf16 the engine's own optimizer trains
    float32 copies: no hook goes on there (its step holds none of the watched parameters), and the cause is
    unknown (ZeRO's)."""

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    mixed = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    engine, optimizer = deepspeed_engine(model, 0, {"optimizer": {"type": "SGD", "params": {"lr": lr}}, **mixed})
    tdbg, hooked, received = _put_back_after_each_engine_step(engine, optimizer, tmp_path)
    assert hooked == (precision == "fp32")  # from the first step judged, as without DeepSpeed; none on copies
    (found,) = _serious(tdbg)
    d = found.details
    assert (found.kind, found.step, d["reason"], d["first_step"], d["last_step"], d["lr"]) == (
        "not_learning",
        5,
        reason,
        0,
        4,
        lr,
    )
    if reason == "undone_after_step":  # step 4's step received the gradients the monitor read
        assert (d["held_at_step"], d["cleared_at_step"], d["held_by_optimizer"]) == (4, 0, 4)
        assert d["grad_norm_at_step"] == pytest.approx(received[4], rel=1e-6)
        assert "something after step() puts them back" in found.message
    elif reason == "unknown":
        assert "held_at_step" not in d and d["held_by_optimizer"] == 0


def test_two_optimizers_compiled_steps_are_not_recompiled_by_the_steps_watch():
    """A GAN's two ``torch.compile``'d steps, each optimizer followed in turn: one hook moved to each step's
    optimizer was taken off the other's and put back at its next step, a recompile of each step every time
    a run of still updates lasted. Each carries its own hook from its first follow, both staying."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    models = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    params, watch = TrainableParameters.of(torch.nn.ModuleList(models)), StallWatch()
    steps = [torch.compile(lambda o=o: o.step(), backend="eager") for o in optimizers]

    def one(which, updates):
        models[which](torch.ones(1, 4)).sum().backward()
        watch.updates = updates
        watch.follow_step(optimizers[which], params)
        steps[which]()
        optimizers[which].zero_grad()

    try:
        for which in (0, 1, 0, 1):  # each one's first steps (SGD's momentum buffers: their own recompiles)
            one(which, 0)
        frames = counters["frames"]["total"]  # (the steps share torch's wrapper: past 8 compiles, none counted)
        for updates in (1, 1, 2, 2, 0, 0, 1, 1):
            one(0, updates)
            one(1, updates)
        assert counters["frames"]["total"] == frames  # before: 7 more, the last past the recompile limit
        assert [len(o._optimizer_step_pre_hooks) for o in optimizers] == [1, 1]
    finally:
        watch.seen.stop()
        torch._dynamo.reset()
    assert not any(o._optimizer_step_pre_hooks for o in optimizers)


def test_a_steps_argument_that_is_no_closure_reaches_the_step_unchanged():
    """An optimizer whose ``step()`` takes something other than a closure first (here a scale) gets it as
    given: the pre-hook wrapped any second argument as a closure, so the step received a function in place of
    the user's value."""
    from diffusion_debug.training.judges.not_learning import StepGradients

    class Scaled(torch.optim.SGD):
        def step(self, scale=None):
            super().step()
            return scale

    layer = torch.nn.Linear(2, 2)
    optimizer, seen = Scaled(layer.parameters(), lr=0.1), StepGradients()
    seen.watch(optimizer, TrainableParameters.of(layer))
    layer(torch.ones(1, 2)).sum().backward()
    try:
        assert optimizer.step(2.0) == 2.0
        assert optimizer.step(scale=3.0) == 3.0
        assert seen.read()["held_at_step"] == 2  # read before the step, as a step without closure
    finally:
        seen.stop()


def test_an_optimizer_replaced_mid_run_is_not_named_as_one_of_several():
    """A user's optimizer dropped and replaced (a new phase, a resume) leaves one live optimizer: the stall
    names none (``stepped_optimizer`` is for several); the gone one's hook entry counted it as a second."""
    import gc

    from diffusion_debug.training.judges.not_learning import StepGradients

    layer = torch.nn.Linear(2, 2)
    params, seen = TrainableParameters.of(layer), StepGradients()
    first = torch.optim.SGD(layer.parameters(), lr=0.1)
    seen.watch(first, params, active=False)
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None  # the hook holds no optimizer alive
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    seen.watch(optimizer, params)
    assert len(seen.hooks) == 1  # the gone one's entry dropped as the new one goes on (an optimizer an epoch)
    layer(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    try:
        assert seen.stepped() is optimizer
    finally:
        seen.stop()


def test_an_optimizer_of_an_unwatched_model_stepped_after_the_watched_ones_leaves_its_reading():
    """A GAN whose debugger watches the generator alone, given both optimizers: the discriminator's step
    (after the generator's) took the reading over, and a stall of the generator's lr 0 was told
    ``optimizer_params`` ("holds none of the watched model's parameters") of the discriminator's."""
    from diffusion_debug.training.judges.not_learning import StepGradients

    generator, discriminator = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    params, seen = TrainableParameters.of(generator), StepGradients()
    opt_g = torch.optim.SGD(generator.parameters(), lr=0.0)
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=0.1)
    seen.watch(opt_g, params)
    seen.watch(opt_d, params)
    discriminator(generator(torch.ones(1, 2))).sum().backward()
    opt_g.step()
    opt_d.step()
    try:
        assert seen.stepped() is opt_g
        reading = seen.read()
        assert reading is not None and (reading["held_at_step"], reading["cleared_at_step"]) == (2, 0)
    finally:
        seen.stop()
