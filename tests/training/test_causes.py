"""Cause before consequence across steps, on the tiny SD UNet with AdamW: the planted cause is the
headline (report.html, the terminal summary, summary.json's ``headline``), and its consequence in a
later step points at it by ``where()``."""

import math
from html import escape

import pytest
import torch
from torch import nn

from diffusion_debug import DebugConfig
from diffusion_debug.record import KINDS, by_cause, consequences, diagnosis_severity, folded, load_run, severity_rank
from diffusion_debug.report.html_anomalies import anomalies_context
from diffusion_debug.report.terminal import render_terminal
from diffusion_debug.training.judges.causes import CauseTracker


def _config(tmp_path):
    return DebugConfig(output_dir=str(tmp_path), log_level="error")


def _warnings(anomalies):
    return [a for a in anomalies if severity_rank(a.severity) >= severity_rank("warning")]


def _headline_everywhere(tdbg, kind, where):
    """The same first anomaly in report.html, the terminal summary and get_summary."""
    run = load_run(tdbg.report().save())
    assert escape(f"Most important: {kind} at {where}") in (run.run_dir / "report.html").read_text()
    first_row = next(line for line in render_terminal(run).split("\n") if line.startswith(("error", "warning")))
    assert first_row.split()[1] == kind  # the where column wraps
    headline = run.summary["headline"]  # summary.json
    assert (headline["kind"], headline["where"]) == (kind, where) and headline == tdbg.report().summary["headline"]
    anomalies = run.anomalies  # read from the file at each access: one list, as consequences() finds by identity
    first = by_cause(anomalies)[0]
    assert (first.kind, first.where()) == (kind, where)
    # the diagnosis's severity (the worst of the cause and what follows from it) in the terminal and report.html;
    # summary.json's headline keeps the anomaly's own
    severity = diagnosis_severity(first, consequences(anomalies, first))
    card = anomalies_context(run)["groups"][0]["cards"][0]
    assert headline["severity"] == first.severity
    assert first_row.split()[0] == card["severity"] == severity


def _lr_times(factor, at):
    def plant(step, unet, optimizer):
        if step == at:
            for group in optimizer.param_groups:
                group["lr"] *= factor

    return plant


def test_a_clean_adamw_run_of_the_same_shape_is_quiet(tmp_path, unet_loop):
    tdbg, losses = unet_loop(_config(tmp_path), 9)
    assert losses[-1] < losses[0]
    assert _warnings(tdbg.report().anomalies) == []
    assert tdbg.report().summary["headline"] is None


def test_a_learning_rate_jump_is_the_headline_over_the_nan_loss_it_causes(tmp_path, unet_loop):
    tdbg, losses = unet_loop(_config(tmp_path), 8, plant=_lr_times(1e6, at=5))
    assert all(math.isfinite(v) for v in losses[:6]) and math.isnan(losses[6])
    anomalies = tdbg.report().anomalies
    (jump,) = [a for a in anomalies if a.kind == "lr_spike"]
    (loss,) = [a for a in anomalies if a.kind == "nonfinite_loss"]
    assert (jump.step, jump.severity, loss.step, loss.severity) == (5, "warning", 6, "error")
    assert loss.details["cause"]["where"] == "optimizer, step 5"
    assert (
        loss.message
        == "The loss is nan at step 6 on rank 0; it follows the lr_spike at optimizer, step 5: fix that first."
    )
    _headline_everywhere(tdbg, "lr_spike", "optimizer, step 5")
    assert diagnosis_severity(*folded(tdbg.report().anomalies)[0]) == "error"  # the jump heads the NaN it caused


def test_nan_loss_after_a_nan_gradient_says_the_update_made_the_weights_nonfinite(tmp_path, unet_loop):
    def plant(step, unet, optimizer):
        if step == 3:
            unet.mid_block.resnets[0].conv1.weight.grad.view(-1)[0] = math.nan

    tdbg, losses = unet_loop(_config(tmp_path), 5, plant=plant)
    anomalies = tdbg.report().anomalies
    (loss,) = [a for a in anomalies if a.kind == "nonfinite_loss"]
    assert loss.step == 4 and loss.details["weights"]["update_step"] == 3
    assert loss.message == (
        "The loss is nan at step 4 on rank 0: the weights went non-finite in the optimizer step of step 3 "
        "(1 parameter(s) hold NaN/Inf, first mid_block.resnets.0.conv1.weight); it follows the nonfinite at model "
        "mid_block.resnets.0.conv1.weight, step 3: fix that first."
    )
    assert not any(a.kind == "nonfinite_update" for a in anomalies)  # the NaN gradient explains the update
    _headline_everywhere(tdbg, "nonfinite", "model mid_block.resnets.0.conv1.weight, step 3")
    # the report's first card is the headline, with the NaN loss under it; training gets training advice
    first = anomalies_context(load_run(tdbg.report().run_dir))["groups"][0]
    assert (first["kind"], first["cards"][0]["where"][-1]) == ("nonfinite", ("step", 3, "b"))
    assert first["cards"][0]["consequences_label"] == "2 anomalies follow from it (1 nonfinite_loss, 1 nonfinite)"
    assert "VAE" not in first["action"] and first["action"] == KINDS["nonfinite"].training_action


def test_weights_made_nonfinite_by_the_update_itself_are_a_nonfinite_update_at_its_step(tmp_path, unet_loop):
    def after_step(step, unet, optimizer):  # what a broken optimizer (or code writing the weights) does
        if step == 3:
            with torch.no_grad():
                unet.down_blocks[1].resnets[0].conv2.weight.view(-1)[5] = math.inf

    tdbg, _ = unet_loop(_config(tmp_path), 5, after_step=after_step)
    anomalies = tdbg.report().anomalies
    (update,) = [a for a in anomalies if a.kind == "nonfinite_update"]
    parameter = "down_blocks.1.resnets.0.conv2.weight"
    assert (update.step, update.severity, update.parameter, update.details["detected_at_step"]) == (
        3,
        "error",
        parameter,
        4,
    )
    assert update.message == (
        f"The weights went non-finite in the optimizer step of step 3 on rank 0 (1 parameter(s) hold NaN/Inf, first "
        f"{parameter}) from finite gradients, with no learning-rate jump before it: check the optimizer's settings "
        "(eps, weight decay; a custom or 8-bit optimizer) and any code that writes the weights between steps."
    )
    (loss,) = [a for a in anomalies if a.kind == "nonfinite_loss"]
    assert loss.details["cause"]["where"] == f"model {parameter}, step 3"
    _headline_everywhere(tdbg, "nonfinite_update", f"model {parameter}, step 3")


class _LoRA(nn.Module):
    """A LoRA adapter as peft makes one: ``lora_B`` starts at zero."""

    def __init__(self, base: nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x))


def test_on_lora_the_learning_rate_jump_is_the_headline_not_an_adapter_parameter(tmp_path, unet_loop, _tiny_unet):
    import copy

    unet = copy.deepcopy(_tiny_unet).requires_grad_(False)
    for name, module in list(unet.named_modules()):
        if name.endswith(("attn1", "attn2")):
            for projection in ("to_q", "to_k", "to_v"):
                setattr(module, projection, _LoRA(getattr(module, projection)))
    tdbg, _ = unet_loop(_config(tmp_path), 8, plant=_lr_times(1e6, at=5), unet=unet)
    anomalies = tdbg.report().anomalies
    # the adapters' gradients overflow first (the loss of step 6 is still finite): once the
    # consequence that headed the report, naming one LoRA parameter
    (gradients,) = [a for a in anomalies if a.kind == "nonfinite" and a.step == 6]
    assert ".lora_" in gradients.parameter and "follows" not in gradients.details
    assert gradients.details["cause"]["where"] == "optimizer, step 5"
    assert gradients.message.endswith("; it follows the lr_spike at optimizer, step 5: fix that first.")
    _headline_everywhere(tdbg, "lr_spike", "optimizer, step 5")


def test_a_jump_explains_only_later_steps_within_the_window():
    from diffusion_debug.record import make_anomaly

    def nan_loss(step):
        return make_anomaly("nonfinite_loss", component="model", step=step, details={"loss": math.nan})

    tracker = CauseTracker()
    jump = make_anomaly(
        "lr_spike",
        component="optimizer",
        step=5,
        details={"reason": "lr_jump", "lr_before": 1e-4, "lr": 1.0, "factor": 1e4},
    )
    (same_step,) = tracker.link([jump, nan_loss(5)], rank=0, joined=6)[1:]
    assert "cause" not in same_step.details  # the jump's own step ran at the old rate
    tracker.remember([jump], joined=6)
    (next_step,) = tracker.link([nan_loss(6)], rank=0, joined=7)
    assert next_step.details["cause"]["where"] == "optimizer, step 5"
    (too_late,) = tracker.link([nan_loss(20)], rank=0, joined=21)
    assert "cause" not in too_late.details


def test_nonfinite_weights_explain_only_this_ranks_nan_steps():
    from diffusion_debug.record import make_anomaly

    tracker = CauseTracker()
    update = tracker.weights_found(["0.weight", "0.bias"], "0", update_step=3, step=4, rank=0)
    assert (update.kind, update.step, update.parameter, update.details["detected_at_step"]) == (
        "nonfinite_update",
        3,
        "0.weight",
        4,
    )
    tracker.remember([update], joined=5)
    assert tracker.weights_found(["0.weight"], "0", update_step=4, step=5, rank=0) is None  # known already
    nan_loss = make_anomaly("nonfinite_loss", component="model", step=5, rank=0, details={"loss": math.nan})
    other_rank = make_anomaly("nonfinite_loss", component="model", step=5, rank=1, details={"loss": math.nan})
    spike = make_anomaly(
        "loss_spike", component="model", step=5, details={"loss": 9.0, "median": 1.0, "robust_std": 0.1, "score": 80}
    )
    own, other, later_spike = tracker.link([nan_loss, other_rank, spike], rank=0, joined=6)
    assert own.details["weights"]["update_step"] == 3 and own.details["cause"]["kind"] == "nonfinite_update"
    assert "weights" not in other.details and "cause" not in other.details  # rank 1's weights are rank 1's to check
    assert "weights" not in later_spike.details  # a finite loss: the weights were not checked at its step


def test_sharded_weights_make_another_ranks_nan_gradients_the_cause_of_this_ranks_nan_loss():
    from diffusion_debug.record import make_anomaly

    def nan_loss(step):
        return make_anomaly("nonfinite_loss", component="model", step=step, rank=0, details={"loss": math.nan})

    nan_gradient = make_anomaly(
        "nonfinite",
        component="model",
        module="conv_in",
        parameter="conv_in.weight",
        step=12,
        rank=1,
        details={"nonfinite_parameters": 1, "grad_norm": math.nan, "order": "registration"},
    )
    for shared in (False, True):  # FSDP2: rank 1's NaN update reaches rank 0's forward by the all-gather
        tracker = CauseTracker(shared_weights=shared)
        tracker.remember([nan_gradient], joined=13, rank=0)
        assert tracker.weights_found([], "", update_step=12, step=13, rank=0) is None  # rank 0's shards are finite
        (linked,) = tracker.link([nan_loss(13)], rank=0, joined=14)
        assert linked.details.get("cause", {}).get("where") == (
            "model conv_in.weight, step 12, rank 1" if shared else None
        )


def test_under_ddp_the_nan_weights_on_a_rank_that_received_the_nan_follow_the_rank_that_made_it():
    # rank 2's own gradients went NaN at step 2, the all-reduce gave them to ranks 0 and 1: at step 3
    # rank 0's NaN loss (its weights NaN since step 2's update) named rank 0's received copy as the
    # cause, not rank 2's, the headline (this rank's own was kept, every other rank's dropped)
    from diffusion_debug.record import make_anomaly
    from diffusion_debug.training.ranks.origin import name_origin

    copies = [
        make_anomaly(
            "nonfinite",
            component="model",
            module="block.inner",
            parameter="block.inner.weight",
            step=2,
            rank=rank,
            details={"nonfinite_parameters": 4, "grad_norm": math.nan, "order": "last_in_forward"},
        )
        for rank in (0, 1, 2)
    ]
    tracker = CauseTracker()
    tracker.remember(name_origin(copies, [0.0, 0.0, 4.0], 2), joined=3, rank=0)
    assert tracker.weights_found(["first.weight"], "first", update_step=2, step=3, rank=0) is None
    nan_loss = make_anomaly("nonfinite_loss", component="model", step=3, rank=0, details={"loss": math.nan})
    (linked,) = tracker.link([nan_loss], rank=0, joined=4)
    assert linked.details["cause"]["where"] == "model block.inner.weight, step 2, rank 2"


def test_what_follows_a_lasting_lr_jump_is_linked_to_it_and_folded_under_it(tmp_path, unet_loop):
    # the lr x1e4 from step 10 on: a loss spike, gradient explosions and modules
    # whose gradients die all follow; the jump is the headline, the rest under it
    tdbg, losses = unet_loop(_config(tmp_path), 18, plant=_lr_times(1e4, at=10))
    anomalies = tdbg.report().anomalies
    jump = by_cause(anomalies)[0]
    assert (jump.kind, jump.step, jump.details["reason"]) == ("lr_spike", 10, "lr_jump")
    later = [a for a in anomalies if a is not jump]
    kinds = {a.kind for a in later}
    # on the floor stack (torch 2.5) the run goes on to NaN too: that follows the jump like the rest.
    # No later lr_spike: AdamW's oversized updates are the jump's (its step's own measured update), and lr x
    # gradient / weight, which read them as more at every step, foretells only a gradient step's (SGD's)
    expected = {"loss_spike", "gradient_explosion", "gradient_vanishing"}
    assert expected <= kinds <= expected | {"nonfinite", "nonfinite_loss"}
    assert all(a.details["cause"]["where"] == "optimizer, step 10" or "follows" in a.details for a in later)
    (shown,) = folded(anomalies)  # one headline, everything else under it
    assert shown[0] is jump and len(shown[1]) == len(later)
    _headline_everywhere(tdbg, "lr_spike", "optimizer, step 10")
    run = load_run(tdbg.report().save(html=False))  # the page was built and read just above
    first = anomalies_context(run)["groups"][0]  # report.html: one group, one card, the rest folded in it
    assert [g["kind"] for g in anomalies_context(run)["groups"]] == ["lr_spike"] and len(first["cards"]) == 1
    assert first["cards"][0]["consequences_label"].startswith(f"{len(later)} anomalies follow from it (")
    assert run.summary["headline"]["consequences"]["count"] == len(later)
    terminal = render_terminal(run)
    rows = [line for line in terminal.split("\n") if line.startswith(("error", "warning", "info"))]
    assert len(rows) == 1 and f"{len(later)} anomalies follow from it" in " ".join(terminal.split())


def test_a_nan_made_in_a_middle_module_s_backward_under_a_finite_loss_is_named_at_that_module(
    tmp_path, unet_loop, _tiny_unet
):
    """A NaN planted in the backward of down_blocks.1.resnets.0.conv2 (its grad_output, at step 3)
    makes that convolution's gradients NaN and those of every module before it in forward order
    (conv_in, the time embedding, down_blocks.0 ...), while the loss stays finite: the gradients
    name the convolution, the last of them in forward order, where backward made the NaN, and no
    module upstream of it (conv_in, the first in forward order, is the far end)."""
    import copy

    unet = copy.deepcopy(_tiny_unet)
    middle = "down_blocks.1.resnets.0.conv2"
    planted = [False]
    unet.get_submodule(middle).register_full_backward_pre_hook(
        lambda module, grad_output: (grad_output[0] * math.nan,) if planted[0] else None
    )

    def before_backward(step, unet, optimizer):  # plant runs after backward: arm the hook one step before
        planted[0] = step == 2

    tdbg, losses = unet_loop(_config(tmp_path), 5, unet=unet, after_step=before_backward)
    assert all(math.isfinite(v) for v in losses[:4]) and math.isnan(losses[4])  # step 3's loss is finite
    anomalies = tdbg.report().anomalies
    (made,) = [a for a in anomalies if a.kind == "nonfinite" and a.step == 3]
    assert (made.step, made.module, made.parameter, made.details["order"]) == (
        3,
        middle,
        f"{middle}.weight",
        "last_in_forward",
    )
    assert "conv_in" in made.details["modules"] and made.details["nonfinite_parameters"] > 2
    assert made.details["first_registered"] == {
        "component": "model",
        "parameter": "conv_in.weight",
        "module": "conv_in",
    }
    assert made.message.startswith(
        f"{made.details['nonfinite_parameters']} gradient(s) hold NaN/Inf, made in backward at {middle}.weight in "
        f"module {middle}, the last in forward order of those that hold NaN/Inf: lower the learning rate"
    )
    assert not any(a.kind == "nonfinite_loss" and a.step == 3 for a in anomalies)
    _headline_everywhere(tdbg, "nonfinite", f"model {middle}.weight, step 3")


def test_a_nan_made_in_backward_is_named_at_its_module_when_a_trainable_parameter_goes_unused(
    tmp_path, unet_loop, _tiny_unet
):
    """An LCM-style UNet (``time_cond_proj_dim``) trains ``time_embedding.cond_proj``, which a call
    without ``timestep_cond`` never reaches: no backward accumulates every parameter, so the order's
    window (one entry a parameter) held the tail of the backward before the last, the parameters
    nearest the input, ahead of the last one's. A NaN made in a middle module's backward was then
    named at that stale tail (the far end), not where backward made it."""
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_config({**_tiny_unet.config, "time_cond_proj_dim": 4, "_use_default_values": []})
    unet.load_state_dict(_tiny_unet.state_dict(), strict=False)  # the same weights, cond_proj its own
    middle = "down_blocks.1.resnets.0.conv2"
    planted = [False]
    unet.get_submodule(middle).register_full_backward_pre_hook(
        lambda module, grad_output: (grad_output[0] * math.nan,) if planted[0] else None
    )

    def before_backward(step, unet, optimizer):
        planted[0] = step == 2

    tdbg, losses = unet_loop(_config(tmp_path), 4, unet=unet, after_step=before_backward)
    assert math.isfinite(losses[3])
    (made,) = [a for a in tdbg.report().anomalies if a.kind == "nonfinite" and a.step == 3]
    assert (made.module, made.parameter, made.details["order"]) == (middle, f"{middle}.weight", "last_in_forward")
    assert "time_embedding.cond_proj" not in made.details["modules"] and "conv_in" in made.details["modules"]


def test_a_nan_loss_is_the_cause_of_its_step_s_nan_update_and_of_the_nan_loss_after_it(
    tmp_path, unet_loop, _tiny_unet
):
    """A NaN loss at step 2 (the UNet's output made NaN by a forward hook) makes step 2's gradients
    NaN (a consequence of it, named by their first registered parameter, not conv_out where backward
    starts: issue 13), AdamW's update makes the weights NaN, and step 3's loss is NaN: the headline
    is step 2's loss, and step 3's loss and gradients point at it, not at step 2's gradients."""
    import copy

    unet = copy.deepcopy(_tiny_unet)
    calls = []

    def nan_output(module, args, output):
        calls.append(1)
        if len(calls) == 3:  # the forward of step 2
            return type(output)(sample=output.sample * math.nan)
        return None

    unet.register_forward_hook(nan_output)
    tdbg, losses = unet_loop(_config(tmp_path), 4, unet=unet)
    assert all(math.isfinite(v) for v in losses[:2]) and math.isnan(losses[2]) and math.isnan(losses[3])
    anomalies = tdbg.report().anomalies
    assert sorted((a.kind, a.step) for a in anomalies if a.severity == "error") == [
        ("nonfinite", 2),
        ("nonfinite", 3),
        ("nonfinite_loss", 2),
        ("nonfinite_loss", 3),
    ]
    (cause,) = [a for a in anomalies if a.kind == "nonfinite_loss" and a.step == 2]
    assert (cause.component, cause.kind, cause.step, cause.rank) == ("model", "nonfinite_loss", 2, 0)
    (gradients,) = [a for a in anomalies if a.kind == "nonfinite" and a.step == 2]
    assert gradients.details["follows"] == {"kind": "nonfinite_loss", "rank": 0}
    assert (gradients.parameter, gradients.details["order"]) == ("conv_in.weight", "registration")
    assert gradients.message == (
        f"{gradients.details['nonfinite_parameters']} gradient(s) hold NaN/Inf, from the non-finite loss on rank 0 "
        "at this step (first registered: conv_in.weight)."
    )
    later = [a for a in anomalies if a.step == 3 and a.severity == "error"]
    assert sorted(a.kind for a in later) == ["nonfinite", "nonfinite_loss"]
    for a in later:
        assert a.details["cause"]["where"] == "model, step 2" and a.details["cause"]["kind"] == "nonfinite_loss"
    (loss,) = [a for a in later if a.kind == "nonfinite_loss"]
    assert loss.message.endswith("; it follows the nonfinite_loss at model, step 2: fix that first.")
    assert not any(a.kind == "nonfinite_update" for a in anomalies)  # the NaN loss explains the update
    _headline_everywhere(tdbg, "nonfinite_loss", "model, step 2")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_a_nan_made_in_backward_is_named_alike_eager_and_compiled(tmp_path, unet_loop, _tiny_unet, compiled):
    """The gradients a NaN made in down_blocks.1.resnets.0.conv2's backward reaches (its own and
    every module's before it in forward order: conv_in, the time embedding, down_blocks.0 ...),
    planted at step 1 under a finite loss, name that convolution under ``torch.compile(unet,
    backend="aot_eager")`` as in eager. The compiled backward accumulates every parameter from one
    node in an order of its own (time_embedding.linear_1 first), which named the time embedding;
    its order is not used: the last registered of them, which is the convolution here."""
    import copy

    unet = copy.deepcopy(_tiny_unet)
    middle = "down_blocks.1.resnets.0"
    upstream = ("conv_in.", "time_embedding.", "down_blocks.0.")
    upstream += tuple(f"{middle}.{m}." for m in ("norm1", "conv1", "time_emb_proj", "norm2", "conv2"))
    model = torch.compile(unet, backend="aot_eager") if compiled else unet

    def plant(step, model, optimizer):
        if step == 1:
            for name, p in unet.named_parameters():
                if name.startswith(upstream):
                    p.grad.fill_(math.nan)

    tdbg, losses = unet_loop(_config(tmp_path), 2, unet=model, plant=plant)
    assert all(math.isfinite(v) for v in losses)
    (made,) = [a for a in tdbg.report().anomalies if a.kind == "nonfinite"]
    rule = "last_registered" if compiled else "last_in_forward"
    assert (made.step, made.module, made.parameter, made.details["order"]) == (
        1,
        f"{middle}.conv2",
        f"{middle}.conv2.weight",
        rule,
    )
    planted = [name for name, _ in unet.named_parameters() if name.startswith(upstream)]
    assert made.details["nonfinite_parameters"] == len(planted) and made.details["parameters"] == planted[:20]
    assert tdbg._order.compiled is compiled
    which = "its backward ran compiled" if compiled else "the last in forward order of those that hold NaN/Inf"
    assert which in made.message and made.details.get("compiled_backward", False) is compiled


@pytest.mark.parametrize("order", [(0, 2), (2, 0)])
def test_sharded_a_nan_made_on_rank_2_is_the_cause_on_every_rank_whatever_the_order_of_the_ranks(order):
    # FSDP2 / ZeRO on 3 ranks: rank 2's own gradient went NaN at step 12, the reduce-scatter put the NaN
    # in rank 0's shard only (rank 0 received it; rank 2 holds none; rank 1 has nothing of its own), the
    # update made rank 0's shard NaN, and every rank's forward all-gathers it: step 13's NaN loss on every
    # rank, whether its own weights are NaN or not, follows rank 2's, in whichever order the ranks' rows come
    from diffusion_debug.record import make_anomaly
    from diffusion_debug.training.ranks.origin import name_origin

    received = make_anomaly(
        "nonfinite",
        component="model",
        module="conv_in",
        parameter="conv_in.weight",
        step=12,
        rank=0,
        details={"nonfinite_parameters": 1, "grad_norm": math.nan, "order": "registration"},
    )
    step_12 = name_origin([received], [0.0, 0.0, 1.0], 12, through="the gradient reduce-scatter")
    assert sorted(a.rank for a in step_12) == [0, 2]
    rows, nan = sorted(step_12, key=lambda a: order.index(a.rank)), {"loss": math.nan}
    for rank in (0, 1, 2):
        for nan_weights in (True, False):  # its shard NaN since step 12's update, or finite
            tracker = CauseTracker(shared_weights=True)
            tracker.remember(rows, joined=13, rank=rank)
            found = ["conv_in.weight"] if nan_weights else []
            assert tracker.weights_found(found, "conv_in", update_step=12, step=13, rank=rank) is None
            nan_loss = make_anomaly("nonfinite_loss", component="model", step=13, rank=rank, details=nan)
            (linked,) = tracker.link([nan_loss], rank=rank, joined=14)
            assert linked.details["cause"]["where"] == "model conv_in.weight, step 12, rank 2", (rank, nan_weights)
    tracker = CauseTracker(shared_weights=True)  # rank 2's row missing: rank 0's copy, not nothing
    tracker.remember([a for a in step_12 if a.rank == 0], joined=13, rank=1)
    (linked,) = tracker.link(
        [make_anomaly("nonfinite_loss", component="model", step=13, rank=1, details=nan)], rank=1, joined=14
    )
    assert linked.details["cause"]["rank"] == 0


def test_a_forward_s_nan_explains_only_its_own_rank_s_nan_at_a_trained_model_s_argument():
    """A trained text encoder's forward made NaN on rank 0 (launch's replay): rank 0's UNet argument follows
    it; rank 1's NaN batch in the same step, and a NaN at rank 1's UNet argument, do not."""
    from diffusion_debug.record import make_anomaly
    from diffusion_debug.training.judges.causes import trace_causes

    made = make_anomaly(
        "nonfinite", component="text_encoder", module="fc1", step=2, rank=0, details={"localized_by": "forward replay"}
    )
    argument = {"inputs": ["unet(encoder_hidden_states)"], "nonfinite_values": 3, "trained_argument": True}
    own = make_anomaly("nonfinite_input", component="input", step=2, rank=0, details=dict(argument))
    other = make_anomaly("nonfinite_input", component="input", step=2, rank=1, details=dict(argument))
    batch = make_anomaly(
        "nonfinite_input", component="input", step=2, rank=1, details={"inputs": ['batch["x"]'], "nonfinite_values": 1}
    )
    follows = {
        (a.rank, a.details["inputs"][0]): a.details.get("follows")
        for a in trace_causes([batch, other, own, made])
        if a.kind == "nonfinite_input"
    }
    assert follows == {
        (0, "unet(encoder_hidden_states)"): {
            "kind": "nonfinite",
            "rank": 0,
            "component": "text_encoder",
            "module": "fc1",
        },
        (1, "unet(encoder_hidden_states)"): None,
        (1, 'batch["x"]'): None,
    }
