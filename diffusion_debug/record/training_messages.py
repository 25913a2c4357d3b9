"""The one sentence of each training anomaly, built from the anomaly's own place and details:
one builder a kind, given to ``register_kind`` as its ``message`` in ``record/kinds.py``. Pure.
Long because every training kind's sentence is here with the variants its details call for (the
reduction's origin, a cause, clipping, an overflowed sum), sharing their clauses: split by kind,
the shared clauses would be imported back and forth.

>>> from diffusion_debug.record import make_anomaly
>>> print(make_anomaly("lr_spike", component="optimizer", step=5, rank=0,
...       details={"reason": "lr_jump", "lr_before": 1e-4, "lr": 0.1, "factor": 1000.0}).message)
The learning rate jumped from 0.0001 to 0.1 (x1e+03) at step 5, above every earlier value: check the scheduler
and any code that sets the lr; the loss reacts at the next steps.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .messages import counted, follows, memory_source

if TYPE_CHECKING:
    from .anomaly import Anomaly


def nonfinite_forward(anomaly: Anomaly) -> str:
    """A trained model's module made NaN/Inf in its forward: a ``nonfinite`` found by launch's replay of
    the step's forward (``details["localized_by"] == "forward replay"``).

    >>> from diffusion_debug.record import make_anomaly
    >>> print(make_anomaly("nonfinite", component="text_encoder", module="encoder.layers.0.mlp", step=3, rank=0,
    ...                    details={"micro_step": 0, "localized_by": "forward replay"}).message)
    text_encoder.encoder.layers.0.mlp made NaN/Inf from finite inputs in the forward of step 3 on rank 0 (found by
    replaying that forward with every module probed): the loss and the gradients of this step follow from it; check
    that module's forward and dtype (fp16 overflow: bf16 or fp32), and any division, log or square root in it.
    """
    made = anomaly.component + (f".{anomaly.module}" if anomaly.module else " (its own code between its modules)")
    micro = anomaly.details.get("micro_step") or 0
    call = f" (micro-step {micro} of the step)" if micro else ""
    return (
        f"{made} made NaN/Inf from finite inputs in the forward of step {anomaly.step}{call} on rank {anomaly.rank} "
        "(found by replaying that forward with every module probed): the loss and the gradients of this step follow "
        "from it; check that module's forward and dtype (fp16 overflow: bf16 or fp32), and any division, log or "
        "square root in it."
    )


def nonfinite_input(anomaly: Anomaly) -> str:
    """The batch held NaN/Inf, or (``component`` other than ``input``) a frozen model made them from
    finite inputs: the text encoder whose output the trained model takes."""
    d = anomaly.details
    seen = d.get("inputs") or []
    follows = ": the loss and the gradients of this step follow from it"
    if not seen or seen[0].startswith("inputs"):  # the batch passed as inputs=: every tensor its own
        where = f", in {', '.join(seen)}" if seen else ""
        return (
            f"The input batch (inputs=) holds {d['nonfinite_values']} NaN/Inf value(s) at step {anomaly.step} on "
            f"rank {anomaly.rank}{where}{follows}; check the data pipeline (decoding, normalisation, cached latents)."
        )
    # seen by launch where the script made it (launch_inputs): the first, then where it went
    count = d.get("first_input_values", d["nonfinite_values"])
    where = f" in {seen[0]}" + (f" (then in {', '.join(seen[1:])})" if seen[1:] else "")
    if anomaly.component != "input":
        if "nonfinite_weight_values" in d:  # its own weight holds them
            made = anomaly.component
            check = (
                f"its weight {anomaly.parameter} holds {d['nonfinite_weight_values']} NaN/Inf value(s): check the "
                "checkpoint it was loaded from and any code that changes it"
            )
        else:
            made = anomaly.component + (f".{anomaly.module}" if anomaly.module else "")
            check = "check that model's weights and dtype (a checkpoint that holds NaN, an fp16 cast that overflows)"
        return (
            f"{made}, which is not trained, made {count} NaN/Inf value(s) from finite inputs at step {anomaly.step} "
            f"on rank {anomaly.rank},{where}{follows}; {check}."
        )
    if made_in_forward(d.get("follows", {})):  # a trained model's forward made it
        return (
            f"The input {seen[0]} of the trained model holds {count} NaN/Inf value(s) at step {anomaly.step} on rank "
            f"{anomaly.rank}, from the NaN/Inf made in the forward of {_forward_of(d['follows'])}"
            " of this step."
        )
    if "weights" in d:  # seen first at a trained model's argument, made by a trained model's non-finite weights
        return (
            f"The input {seen[0]} of the trained model holds {count} NaN/Inf value(s) at step {anomaly.step} on rank "
            f"{anomaly.rank}, and the loss and the gradients of this step follow from it{_earlier(d, anomaly.rank)}."
        )
    return (
        f"The training batch holds {count} NaN/Inf value(s) at step {anomaly.step} on rank {anomaly.rank},{where}"
        f"{follows}; check the data pipeline (decoding, normalisation, cached latents)."
    )


def nonfinite_loss(anomaly: Anomaly) -> str:
    d = anomaly.details
    if "weights" in d or "cause" in d:
        loss = f"The loss is {_fmt(d['loss'])} at step {anomaly.step} on rank {anomaly.rank}"
        return loss + _earlier(d, anomaly.rank) + "."
    if "follows" in d:
        kind = d["follows"]["kind"]
        what = "non-finite loss weight" if kind == "nonfinite_loss_weight" else _input(d["follows"])
        if made_in_forward(d["follows"]):
            what = f"NaN/Inf made in the forward of {_forward_of(d['follows'])}"
        return (
            f"The loss is {_fmt(d['loss'])} at step {anomaly.step} on rank {anomaly.rank}, from the {what} of this "
            "step" + _samples(d) + "."
        )
    batch = (
        "the input batch was finite, so the forward pass or the loss made it"
        if d.get("input_checked")
        else "the input batch was not checked (pass inputs=batch to tell a bad batch from a bad forward pass)"
    )
    engine = _no_replay(d)
    replayed = d.get("forward_replay")  # launch's replay of the trained model's forward (no closure= there)
    op = (
        ""  # a closure= was passed: it replayed
        if "localization" in d
        else " (a replay of the trained model's forward with every module probed stayed finite: the loss "
        "computation after it made it)"
        if replayed == "finite"
        else " (the trained model's forward was not replayed: the script changed its arguments in place after "
        "the call)"
        if replayed == "changed"
        else " (the trained model's forward was not replayed: it is compiled in place, and torch before 2.6 "
        "cannot run it eagerly)"
        if replayed == "compiled"
        else " (the trained model's forward was not replayed: its SyncBatchNorm gathers every rank's statistics in "
        "training mode, and a replay on this rank alone would wait for the others)"
        if replayed == "collective"
        else f" (closure= replays nothing under {engine}: to name the op, rerun this batch without it, on one "
        "process or under DDP, with closure=)"
        if engine
        else " (pass closure= to name the op)"
    )
    text = (
        f"The loss is {_fmt(d['loss'])} at step {anomaly.step} on rank {anomaly.rank}" + _samples(d) + f"; {batch}: "
        f"check the forward pass{op}, or lower the learning rate"
    )
    return text + _localized(d) + "."


def scaler_not_passed(anomaly: Anomaly) -> str:
    d = anomaly.details
    if "undecided" in d:  # closed before its scaler.step: the step's findings neither confirmed nor ruled out
        found = ", ".join(d["undecided"]) or "nothing"
        return (
            f"A {d.get('scaler', 'GradScaler')} (scale {_fmt(d['grad_scale'])}) alive but not passed to "
            f"monitor_training_step was never seen stepping the optimizer of step {anomaly.step} before the run "
            f"closed: what that step read ({found}) is reported as read, though its gradients may have been "
            f"{_fmt(d['grad_scale'])}x their size. Pass the scaler: "
            "monitor_training_step(loss, optimizer=optimizer, scaler=scaler)."
        )
    return (
        f"A {d.get('scaler', 'GradScaler')} (scale {_fmt(d['grad_scale'])}) stepped the optimizer of step "
        f"{anomaly.step} but was not passed to monitor_training_step: its gradients were {_fmt(d['grad_scale'])}x "
        "their size and each overflow it skips read as a NaN error; read unscaled from this step on. Pass it: "
        "monitor_training_step(loss, optimizer=optimizer, scaler=scaler)."
    )


def lr_spike(anomaly: Anomaly) -> str:
    d = anomaly.details
    if d["reason"] == "lr_jump":
        return (
            f"The learning rate jumped from {d['lr_before']:.4g} to {d['lr']:.4g} (x{d['factor']:.3g}) at step "
            f"{anomaly.step}, above every earlier value: check the scheduler and any code that sets the lr; the loss "
            "reacts at the next steps."
        )
    if d["reason"] == "applied_update":
        found = (
            f"The optimizer step of step {anomaly.step} moved {d['modules_over']} of {d['modules_measured']} modules "
            f"by more than {d['threshold']:g} times their own norm (the most: {anomaly.module or '(root)'}"
            + ("'s last rows, where added tokens go" if d.get("last_rows") else "")
            + f", {d['update_to_weight_ratio']:.3g}x; measured from the weights)"
        )
        advice = ": lower the learning rate or warm it up."
    else:
        found = (
            f"This step's update would move {anomaly.module or '(root)'} by {d['update_to_weight_ratio']:.3g} times "
            f"its weights (lr x gradient norm / weight norm, above {d['threshold']:g})"
        )
        advice = ": lower the learning rate" + ("." if d.get("clipping") else " or clip gradients.")
    if "cause" in d:  # an earlier lr jump or update: the one to fix
        return found + _earlier(d, anomaly.rank) + "."
    return found + advice


def distributed_split(anomaly: Anomaly) -> str:
    return (
        f"WORLD_SIZE={anomaly.details['environment_world_size']} in the environment but this process runs alone "
        "(world size 1): every process trains on its own with its own run directory. On CPU set "
        "ACCELERATE_USE_CPU=true in the launcher's environment or create the Accelerator with Accelerator(cpu=True) "
        "(accelerate launch --cpu starts one process; diffusion-debug launch sets the variable for CPU processes)."
    )


def nonfinite_gradients(anomaly: Anomaly) -> str:
    """The training side's ``nonfinite``: gradients that hold NaN/Inf, or the backward op that
    autograd anomaly mode caught (``details["localization"]`` alone)."""
    d = anomaly.details
    if "nonfinite_parameters" not in d:
        return _anomaly_mode(d["localization"])
    if anomaly.severity == "info":
        scaler = "DeepSpeed's loss scaler" if d.get("loss_scaler") == "deepspeed" else "the GradScaler"
        hint = f"{scaler} will skip this optimizer step and lower the scale"
    elif "localization" in d:  # closure= was passed and replayed: its finding follows
        hint = "lower the learning rate or check the loss for NaN/Inf"
    else:
        hint = "lower the learning rate, check the loss for NaN/Inf, or use closure= to name the backward op"
        if _no_replay(d):  # sharded: closure= is never replayed
            hint = (
                f"lower the learning rate, check the loss for NaN/Inf, or, as closure= replays nothing under "
                f"{_no_replay(d)}, rerun this batch without it (on one process or under DDP) with closure= to name "
                "the backward op"
            )
    named = _gradient_named(d, anomaly.parameter, anomaly.module)
    if "cause" in d or "weights" in d:
        return (
            f"{d['nonfinite_parameters']} gradient(s) hold NaN/Inf, {named}"
            + _earlier(d, anomaly.rank)
            + _localized(d)
            + "."
        )
    if "found" in d.get("reduction", {}):  # made here, held by another rank after the reduction
        return _made_elsewhere(anomaly, hint)
    if d.get("follows", {}).get("kind") == "nonfinite":  # another rank's, spread by the all-reduce
        return (
            f"{d['nonfinite_parameters']} gradient(s) hold NaN/Inf ({_gradient_named(d, anomaly.parameter)})"
            + _reduction(d, d["follows"]["rank"])
            + _localized(d)
            + "."
        )
    if "follows" in d:
        cause = d["follows"]
        what = {"nonfinite_loss": "non-finite loss", "nonfinite_loss_weight": "non-finite loss weight"}.get(
            cause["kind"]
        ) or _input(cause)
        return (
            f"{d['nonfinite_parameters']} gradient(s) hold NaN/Inf, from the {what} on rank "
            f"{cause['rank']} at this step ({_gradient_named(d, anomaly.parameter)})" + _localized(d) + "."
        )
    return (
        f"{d['nonfinite_parameters']} gradient(s) hold NaN/Inf, {named}"
        + _reduction(d)
        + f": {hint}"
        + _localized(d)
        + "."
    )


_SHARDING = {"fsdp2": "FSDP2", "fsdp1": "FSDP1", "zero": "DeepSpeed ZeRO"}
"""By ``details["sharded"]`` (``training.judges.local_judging.LocalJudge.sharding``): the engine
under which no ``closure=`` replay runs."""


def _no_replay(details: dict[str, Any]) -> str | None:
    """The engine under which no ``closure=`` replay runs (``details["sharded"]``), by its name; None: none."""
    engine = details.get("sharded")
    return _SHARDING.get(engine, engine) if engine else None


def _gradient_named(details: dict[str, Any], parameter: str | None, module: str | None = None) -> str:
    """The non-finite gradient a ``nonfinite`` names, with the rule that chose it
    (``details["order"]``, ``training.judges.step_checks.locate_nonfinite``); ``module``: said
    after it (None: the parameter alone, in parentheses)."""
    order = details.get("order")
    at = f"{parameter} in module {module or '(root)'}" if module is not None else f"{parameter}"
    if order == "last_in_forward":  # several modules under a finite loss: where backward made the NaN
        return f"made in backward at {at}, the last in forward order of those that hold NaN/Inf"
    if order == "last_registered":  # the same, on an engine that records no backward order (or compiled)
        why = "its backward ran compiled" if details.get("compiled_backward") else "no backward order was recorded"
        return f"made in backward at {at}, the last registered of those that hold NaN/Inf ({why})"
    return f"first registered {at}" if module is not None else f"first registered: {at}"


_REDUCTION = "the gradient all-reduce"


def _made_elsewhere(anomaly: Anomaly, hint: str) -> str:
    """This rank's own gradients were non-finite before the reduction, which gave the NaN to other
    ranks only (``training.ranks.origin.made_elsewhere``): what the receiving rank found there."""
    reduction = anomaly.details["reduction"]
    found = reduction["found"]
    made = (
        f"This rank's own gradients held NaN/Inf before {reduction['through']}, which gave them to "
        f"{_ranks(reduction['received_by'])} ({_ranks([found['rank']])} holds "
        f"{anomaly.details['nonfinite_parameters']} non-finite gradient(s), "
        f"{_gradient_named(anomaly.details, found['parameter'], found['module'])}"
    )
    if anomaly.parameter is None:  # several ranks made it: which parameter each made is not known
        made += f"; {_ranks(reduction['origins'])} made NaN/Inf: which made which is not known"
    return made + f"; this rank's own share holds none after it): {hint}."


def _ranks(ranks: list[int]) -> str:
    """``rank 0``, ``ranks 0, 3``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _reduction(details: dict[str, Any], head: int | None = None) -> str:
    """Where a NaN gradient came from (``details["reduction"]``, ``training.ranks.origin``): this
    rank's own gradients before the all-reduce, or another rank's received through it ("": not said)."""
    reduction = details.get("reduction")
    if not isinstance(reduction, dict):
        return ""
    through = reduction.get("through", _REDUCTION)
    if reduction.get("made_here"):
        return f", non-finite in this rank's own gradients before {through}"
    origins = reduction.get("origins")
    if origins:
        listed = ", ".join(str(r) for r in origins)
        return f", received through {through} from rank {listed}, whose own gradients were non-finite before it"
    if origins is None and head is not None:
        return (
            f", the same as rank {head}'s after {through} (which rank's own gradients were non-finite "
            "is not known: they were not checked before it)"
        )
    if origins is None:
        return ""
    return (
        f", non-finite after {through} though no rank's own gradients were before it (their sum overflowed, "
        "or they were changed after it)"
    )


def loss_spike(anomaly: Anomaly) -> str:
    d = anomaly.details
    jumped = (
        f"The loss jumped to {d['loss']:.4g}, {d['score']:.1f} robust deviations above its rolling median "
        f"{d['median']:.4g}"
    )
    if "cause" in d:
        return jumped + _earlier(d, anomaly.rank) + "."
    if d.get("follows", {}).get("kind") == "sample_loss_outlier":
        return jumped + ", from the outlying sample(s) of this step (sample_loss_outlier): look at those samples."
    return jumped + ": look at the learning rate and this batch."


def gradient_explosion(anomaly: Anomaly) -> str:
    d = anomaly.details
    if "follows" in d:
        return "A gradient norm is not finite, from the non-finite loss or input of this step."
    if d.get("sum_overflow"):  # training.judges.step_checks: finite parts, a float32 sum past its largest value
        found = _sum_overflow(d["grad_norm"])
    elif "threshold" not in d:
        found = "A gradient norm overflowed float32 (values above ~1e19)"
    else:
        found = f"The global gradient norm (before clipping) is {d['grad_norm']:.4g}, above {d['threshold']:g}"
    if "cause" in d or "weights" in d:
        return found + _earlier(d, anomaly.rank) + "."
    if d.get("sum_overflow"):  # clipping by that sum is what zeroes the gradients: not the advice
        return found + "; lower the learning rate and look at this step's batch."
    if d.get("clipping"):  # the script clips already: clipping more hides it
        return found + ": lower the learning rate and look at this step's batch (the gradients are clipped already)."
    return found + ": lower the learning rate or clip gradients."


def _sum_overflow(norm: float) -> str:
    """A global gradient norm summed from finite parts past float32's largest value (``norm``:
    the float64 sum, or inf where only the user's ``grad_norm=`` showed it)."""
    if math.isfinite(norm):
        found = f"The global gradient norm is {norm:.4g}, past the largest norm float32 sums (1.845e+19)"
    else:
        found = "The gradient norm passed as grad_norm= is inf"
    return (
        found + " though every parameter's (and shard's) own norm is finite: their sum overflows float32, so "
        "clip_grad_norm_ reads it as inf and scales every gradient by 0"
    )


def gradient_vanishing(anomaly: Anomaly) -> str:
    d = anomaly.details
    if d.get("reason") == "module":
        found = _dead_module(anomaly)
        advice = (
            ""  # a module that never received the loss: its sentence says where to look already
            if d.get("history_log10") is None
            else ": check that it still receives the loss (a detached or bypassed branch, a frozen part, a gradient "
            "hook or mask that scales it)."
        )
    else:
        found = f"The global gradient norm is {d['grad_norm']:.3g}, below {d['threshold']:g}"
        advice = ": check that the loss depends on the trained parameters and that zero_grad() runs after the step."
        if d.get("no_gradients"):
            found = "No watched parameter has a gradient (every .grad is None: the global gradient norm is 0)"
            advice = (
                ": call monitor_training_step after loss.backward() and before optimizer.step(), and zero_grad() "
                "after the step, not between backward() and the monitor."
            )
    if "cause" in d:  # after a blow-up: the blow-up is what to fix
        return found + _earlier(d, anomaly.rank) + "."
    return found + advice


def memory_growth(anomaly: Anomaly) -> str:
    d = anomaly.details
    what = memory_source(d["source"])
    return (  # the text names the user's own call (advice, not a read of ours)
        f"{what} grew by {d['growth_mb']:.0f} MB over the last {counted(d['window_steps'], 'step')}: look for "
        "tensors kept across steps (e.g. appending the loss without .item())."
    )


def skipped_step(anomaly: Anomaly) -> str:
    d = anomaly.details
    if "skipped_in_a_row" in d:  # every step from the start: the scale never settled
        by = "DeepSpeed's overflow check" if d.get("reason") == "deepspeed_overflow" else "the GradScaler"
        return (
            f"Every optimizer step since step {d['skipped_since']} was skipped by {by} ({d['skipped_in_a_row']} "
            f"in a row, the loss scale now {_fmt(d['scale_after'])}): nothing trains, the gradients are non-finite "
            "at every scale; fix what makes them NaN/Inf (the first non-finite gradient or loss named), or train "
            "in bf16."
        )
    if d.get("reason") == "deepspeed_overflow":
        ranks = d.get("overflow_ranks")
        made = f" of rank {', '.join(str(r) for r in ranks)} before the reduction" if ranks else ""
        return (
            f"The optimizer step {anomaly.step} was skipped by DeepSpeed's overflow check "
            f"(non-finite gradients{made}, "
            '"OVERFLOW! Skipping step"): the weights were not updated; frequent skips mean the gradients overflow.'
        )
    ranks = d.get("overflow_ranks")
    if ranks:  # training.ranks.origin: checked before the all-reduce
        listed = ", ".join(str(r) for r in ranks)
        overflowed = f"rank {listed}'s own gradients overflowed, before {_REDUCTION}"
    else:
        overflowed = "gradients overflowed"
    return (
        f"The optimizer step {anomaly.step} was skipped by the GradScaler ({overflowed}; scale "
        f"{_fmt(d['scale_before'])} -> {_fmt(d['scale_after'])}): frequent skips mean fp16 overflow, consider "
        "bf16 or a lower learning rate."
    )


def rank_desync(anomaly: Anomaly) -> str:
    stall = anomaly.details.get("stall")
    if stall:  # named by the liveness side channel: where every rank is, then what to do
        text = stall["text"]
        return f"{'R' + text[1:] if text.startswith('rank') else text}. {stall['advice']}"
    return (
        f"Rank {anomaly.rank}'s parameters differ from rank 0's (first {anomaly.parameter}): the replicas "
        "diverged; check that every rank loads the same weights and no rank updates outside DDP."
    )


def nonfinite_update(anomaly: Anomaly) -> str:
    d = anomaly.details
    return (
        f"The weights went non-finite in the optimizer step of step {anomaly.step} on rank {anomaly.rank} "
        f"({d['nonfinite_parameters']} parameter(s) hold NaN/Inf, first {anomaly.parameter}) from finite gradients, "
        "with no learning-rate jump before it: check the optimizer's settings (eps, weight decay; a custom or 8-bit "
        "optimizer) and any code that writes the weights between steps."
    )


def unwatched_parameters(anomaly: Anomaly) -> str:
    d = anomaly.details
    parts = []
    if "outside" in d:
        outside = d["outside"]
        unfrozen = outside.get("unfrozen", 0)
        remake = "make the TrainingDebugger after unfreezing them (or unfreeze them before making it)"
        bad = outside.get("nonfinite_gradients", 0)
        unseen = (
            f"{bad} of them {'holds' if bad == 1 else 'hold'} NaN/Inf gradients now, and later NaN gradients and "
            "updates are not seen"
            if bad
            else "their NaN gradients and updates are not seen"
        )
        added = outside.get("added", 0)
        if unfrozen == outside["count"]:
            parts.append(
                f"the optimizer trains {outside['count']} parameter tensor(s) ({outside['values']:,} values) of the "
                f"watched model(s) that were frozen when the TrainingDebugger was made and unfrozen since, in "
                f"{_groups(outside['groups'])}: {unseen}; {remake}"
            )
        elif added == outside["count"]:  # a LoRA adapter added mid-run
            parts.append(
                f"the optimizer trains {outside['count']} parameter tensor(s) ({outside['values']:,} values) added "
                f"to the watched model(s) since the TrainingDebugger was made, in {_groups(outside['groups'])}: "
                f"{unseen}; make the TrainingDebugger after adding them"
            )
        else:
            where = "not watched" if unfrozen or added else "outside the watched model(s)"
            of_them = f" ({unfrozen} of them frozen when the TrainingDebugger was made and unfrozen since: {remake})"
            new = f" ({added} of them added to the watched model(s) since the TrainingDebugger was made)"
            parts.append(
                f"the optimizer trains {outside['count']} parameter tensor(s) ({outside['values']:,} values) {where}, "
                f"in {_groups(outside['groups'])}{of_them if unfrozen else ''}{new if added else ''}: {unseen}; "
                'watch them too: TrainingDebugger({"unet": unet, "text_encoder": text_encoder}, ...)'
            )
    if "not_optimized" in d:
        missing = d["not_optimized"]
        parts.append(
            f"{missing['count']} watched trainable parameter tensor(s) are in no optimizer, in "
            f"{_groups(missing['groups'])}: they never change; add them to the optimizer or set requires_grad=False"
        )
    text = "; ".join(parts)
    return f"At step {anomaly.step}: {text}." if anomaly.step is not None else text[:1].upper() + text[1:] + "."


def nonfinite_loss_weight(anomaly: Anomaly) -> str:
    d = anomaly.details
    times = ", ".join(str(t) for t in d["timesteps"])
    return (
        f"The loss weight is {_fmt(d['weight'])} at timestep(s) {times} ({d['count']} of {d['samples_in_step']} "
        f"samples: {_named(d['samples'])}) at step {anomaly.step} on rank {anomaly.rank}: min-SNR weighting divides "
        "by the SNR, 0 at the last timestep of a zero-terminal-SNR schedule; clamp the SNR (snr.clamp(min=1e-8)) "
        "or weight by snr / (snr + 1) with v_prediction."
    )


def sample_loss_outlier(anomaly: Anomaly) -> str:
    d = anomaly.details
    which = f"Sample {_named(d['samples'])}" if d["count"] == 1 else f"{d['count']} samples ({_named(d['samples'])})"
    if d["reason"] == "nonfinite":
        return (
            f"{which} had a NaN/Inf loss at step {anomaly.step} on rank {anomaly.rank} although the step's loss was "
            "finite (masked or replaced): check those samples and the loss at their timesteps."
        )
    first, one = d["samples"][0], d["count"] == 1
    loss = f"has a loss of {first['loss']:.4g}" if one else f"have losses up to {first['loss']:.4g}"
    return (
        f"{which} {loss}, {first['ratio']:.3g}x the 90th percentile of recent per-sample losses ({d['p90']:.4g}), "
        f"at step {anomaly.step} on rank {anomaly.rank}: check "
        + (
            "that sample (its image, caption, cached latents) and the loss at that timestep."
            if one
            else "those samples (their images, captions, cached latents) and the loss at those timesteps."
        )
    )


def _samples(details: dict[str, Any]) -> str:
    samples = details.get("samples")
    return f"; non-finite in sample(s) {_named(samples)}" if samples else ""


def _named(samples: list[dict[str, Any]]) -> str:
    """``b (t=500), c (t=999)``: the samples kept, with their timesteps."""
    return ", ".join(
        f"{s['sample']}" + (f" (t={s['timestep']})" if s.get("timestep") is not None else "") for s in samples
    )


def _groups(groups: dict[str, int]) -> str:
    return ", ".join(f"{name} ({count})" for name, count in groups.items())


def _dead_module(anomaly: Anomaly) -> str:
    d = anomaly.details
    count = d["modules"]
    what = f"{anomaly.module or '(root)'}" + (f" ({count} modules)" if count > 1 else "")
    if d.get("history_log10") is None:  # no healthy reading ever: it never received the loss
        return (
            f"The gradients of {what} have been 1e{d['log10_grad_norm']:.0f} since step {d['since_step']}, "
            f"{d['orders_below_peers']:.0f} orders of magnitude below the other modules (1e{d['peers_log10']:.0f}), "
            f"for {counted(d['steps'], 'step')} from its first: it has never received the loss (a branch detached "
            "from the loss or bypassed from the start, a gradient hook or mask that scales it)."
        )
    return (
        f"The gradients of {what} fell to 1e{d['log10_grad_norm']:.0f} at step {anomaly.step}, "
        f"{d['orders_below_peers']:.0f} orders of magnitude below the other modules (1e{d['peers_log10']:.0f}) and "
        f"{d['orders_below_history']:.0f} below their own history (1e{d['history_log10']:.0f}), for "
        f"{counted(d['steps'], 'step')} since step {d['since_step']}"
    )


def loss_divergence(anomaly: Anomaly) -> str:
    d = anomaly.details
    return (
        f"The loss has been rising over steps {d['from_step']}-{d['to_step']} without a single spike: its median went "
        f"from {d['median_before']:.4g} to {d['median_after']:.4g} (x{d['rise_ratio']:.3g}, {d['slope_per_step']:.3g} "
        f"per step; beyond its noise: the later half's lower bound {d['bound_after']:.4g} is above the earlier "
        f"half's upper bound {d['bound_before']:.4g}): lower the learning rate or check the schedule and the data of "
        "that window."
    )


_NOT_LEARNING = {
    "lr_zero": "the learning rate is 0 in every param group that holds them: set it (check the scheduler's warmup)",
    "optimizer_params": (
        "the optimizer holds none of the watched model's trainable parameters: build it on this model's parameters "
        "(after any copy, .to() or wrapping)"
    ),
    "gradients_cleared": (
        "the optimizer holds them with a learning rate above 0, so their gradients are gone when optimizer.step() "
        "runs: call zero_grad() after step(), not between backward() and step()"
    ),
    "below_precision": (
        "the weights are {dtype} and each update is smaller than their rounding step: keep float32 master weights "
        "(mixed precision) or raise the learning rate"
    ),
    "below_precision_full": (  # float32 weights: no master copy to keep, the lr is what is too small
        "the weights are {dtype} and each update (lr {lr:g}) is smaller than their rounding step: raise the learning "
        "rate (check its units and the scheduler's base lr)"
    ),
    "gradients_zeroed": (
        "their gradients reach optimizer.step() zeroed (norm {at_step:.3g} there): a mask or hook between "
        "monitor_training_step and step() zeroes the rows that should learn (textual inversion's mask must keep "
        "the placeholder token's id, as the tokenizer gives it once the token is added), or "
        "zero_grad(set_to_none=False) runs before step()"
    ),
    "undone_after_step": (
        "optimizer.step() received their gradients (norm {at_step:.3g}) and the next step found the weights "
        "where they were: something after step() puts them back (textual inversion's restore of the other rows "
        "must leave the placeholder token's row out) or loads them again"
    ),
}


def _unscaled_loss(d: dict) -> str:
    """``not_learning``'s cause where DeepSpeed's fp16 engine without ZeRO never scaled the loss."""
    scale = d["loss_scale"]
    return (
        f"DeepSpeed's fp16 engine without ZeRO (stage 0, {d['optimizer']}) backpropagates the loss unscaled in "
        f"engine.backward, yet its optimizer's step divides every gradient by the loss scale {scale:g}, so every "
        f"update is {scale:g}x too small and the run barely learns (DeepSpeed's bug, {d['issue']}; the gradient "
        "norms reported are the true ones): train in bf16, or with ZeRO stage >= 1, or with a DeepSpeed that has "
        f"{d['issue']}'s fix"
    )


def not_learning(anomaly: Anomaly) -> str:
    d = anomaly.details
    if d["reason"] == "gradient_sync_off":  # training.step.sync_off: no optimizer step at all
        return _sync_off(d)
    if d["reason"] == "deepspeed_fp16_unscaled_loss":  # found at the first step, or the stall it makes
        cause = _unscaled_loss(d)
        if "updates" not in d:
            return cause[0].upper() + cause[1:] + "."
    else:
        cause = _cause(d)
    cleared = d.get("state_empty") and d["reason"] == "gradients_cleared"
    state = "; the optimizer holds no state for them: its step never saw a gradient" if cleared else ""
    if "stalled_optimizer" in d:  # one optimizer of several: the cause is that one, named first
        others = "the other optimizer's" if d["optimizers"] == 2 else "the other optimizers'"
        beside = f"while {others} updates moved theirs"
        if d.get("others_moved") is False:  # none of theirs read moving in its run: not said to have moved
            other = "the other optimizer" if d["optimizers"] == 2 else "the other optimizers"
            beside = f"(no update of {other} read in that time moved weights either)"
        return (
            f"The optimizer {d['stalled_optimizer']} (one of {d['optimizers']}) moved none of its weights in its "
            f"{d['updates']} steps {d['first_step']}-{d['last_step']} (the largest update "
            f"{d['max_update_ratio']:.3g}x a module's norm) {beside}, although its "
            "gradients are normal "
            f"(norm {d['grad_norm']:.3g}): " + cause + state + "."
        )
    # several optimizers all still: the cause is read from one of them, which the reader must know
    read = f"; read from {d['stepped_optimizer']}, the optimizer that stepped last" if "stepped_optimizer" in d else ""
    others = ""
    if d.get("still_optimizers"):  # each one's updates in the run: the whole model's stall, every optimizer named
        names = d["still_optimizers"]
        read = f"; the updates of all {len(names)} optimizers are still ({'; '.join(names)})" + read
        # each other one whose own updates show another cause (a generator's lr 0 beside a critic read last)
        for name, own in zip(names, d.get("still_causes", ())):
            if name != d.get("stepped_optimizer") and own["reason"] != d["reason"]:
                others += f"; for {name}: " + _cause(own)
    return (
        f"No weight moved in the {d['updates']} optimizer steps {d['first_step']}-{d['last_step']} (the largest "
        f"update {d['max_update_ratio']:.3g}x a module's norm) although the gradients are normal (norm "
        f"{d['grad_norm']:.3g}){read}: " + cause + state + others + "."
    )


def _sync_off(d: dict) -> str:
    last = d.get("last_optimizer_step")
    stepped = f"the last at step {last}" if last is not None else "none since the run began"
    return (
        f"{d['backward_passes']} backward passes since step {d['since_step']} with no optimizer step "
        f"({stepped}): gradient sync is off ({d['held_by']}), so every call reads as a micro-step of gradient "
        "accumulation and the weights never move; turn the sync back on for the backward before each "
        "optimizer step."
    )


def _cause(d: dict[str, Any]) -> str:
    """The sentence of a ``not_learning`` reason, with the values it reads from ``d`` (a stall's details, or one
    optimizer's own cause in the whole run's: ``still_causes``)."""
    reason = d["reason"]
    if reason == "below_precision" and "float16" not in d.get("dtype", ""):  # float16 and bfloat16 keep masters
        reason = "below_precision_full"
    cause = _NOT_LEARNING.get(reason, "the cause is unknown: check the optimizer and the loop's order")
    return cause.format(dtype=d.get("dtype"), at_step=d.get("grad_norm_at_step", math.nan), lr=d.get("lr") or 0.0)


# -- what the stability actions did (config: clip_grad_on_explosion, lr_reduce_after_spikes, ...) --
def gradients_clipped(anomaly: Anomaly) -> str:
    d = anomaly.details
    return (
        f"The gradients were scaled by {d['factor']:.3g} (global norm {d['grad_norm']:.4g} -> {d['max_norm']:g}) "
        "before the optimizer step (clip_grad_on_explosion)."
    )


def lr_reduced(anomaly: Anomaly) -> str:
    d = anomaly.details
    return (
        f"{d['spikes']} spikes within {d['window']} steps: the learning rate was multiplied by {d['factor']:g} "
        f"({_rates(d['lr_before'])} -> {_rates(d['lr'])}) (lr_reduce_after_spikes)."
    )


def weights_restored(anomaly: Anomaly) -> str:
    d = anomaly.details
    if not d["restored"]:
        return (
            f"The weights are non-finite and so is the copy kept at step {d['from_step']}: nothing was restored "
            "(they went non-finite before the loss showed it; restore_finite_weights_mb)."
        )
    return (
        f"The weights were non-finite; the copy kept at step {d['from_step']} was put back ({d['mb']:.1f} MB), the "
        f"gradients zeroed and the optimizer state of {d['optimizer_state_dropped']} parameters dropped "
        "(restore_finite_weights_mb)."
    )


def _rates(rates: list[float]) -> str:
    return ", ".join(f"{r:.3g}" for r in rates)


def _earlier(details: dict[str, Any], rank: int = 0) -> str:
    """What an earlier step did to this one: the weights it made non-finite, and the anomaly to fix
    first (another rank's named as such: the origin of what every rank then shows)."""
    text = ""
    weights = details.get("weights")
    if weights:
        held = f"{weights['nonfinite_parameters']} parameter(s) hold NaN/Inf, first {weights['parameters'][0]}"
        if weights.get("update_step") is None:
            text += f": the weights were already non-finite at the first monitored step ({held})"
        else:
            text += f": the weights went non-finite in the optimizer step of step {weights['update_step']} ({held})"
    cause = details.get("cause")
    if cause and cause.get("rank", rank) != rank and cause.get("kind") != "lr_spike":  # the ranks share the lr
        place = f" ({cause['place']})" if cause.get("place") else ""
        text += follows(f"rank {cause['rank']}'s {cause['kind']}", f"step {cause['step']}{place}")
    elif cause:
        text += follows(f"the {cause['kind']}", cause["where"])
    return text


def _anomaly_mode(found: dict[str, Any]) -> str:
    """What autograd anomaly mode caught, as the message of its own ``nonfinite``."""
    source = f", from {found['forward_line']}" if found.get("forward_line") else ""
    return (
        f"Autograd anomaly mode: {found.get('op', 'a backward function')} returned {found.get('value', 'non-finite')} "
        f"values{source}: fix that op's inputs (e.g. a division by zero or the log of 0)."
    )


def _localized(details: dict[str, Any]) -> str:
    """What the closure= replay under anomaly mode found (nothing said when there was no replay)."""
    if "localization" not in details:
        return ""
    found = details.get("localization") or {}
    if not found.get("op") and found.get("error"):
        return f"; the closure= replay under anomaly mode failed ({found['error']})"
    if not found.get("op"):
        return "; the closure= replay under anomaly mode stayed finite (the closure must recompute this batch's loss)"
    return f"; anomaly mode names {found['op']}" + (
        f" from {found['forward_line']}" if found.get("forward_line") else ""
    )


def _fmt(value: float | str | None) -> str:
    """A number as the message shows it; a non-finite one that travelled as JSON is the string "nan"."""
    if isinstance(value, str):
        return value
    return "n/a" if value is None else f"{value:.4g}"


def made_in_forward(follows: dict[str, Any]) -> bool:
    """Whether a ``details["follows"]`` names a ``nonfinite`` made in a trained model's forward (launch's
    replay: it names the module), not another rank's NaN gradients (``{"kind": "nonfinite", "rank": r}``)."""
    return follows.get("kind") == "nonfinite" and "module" in follows


def _forward_of(follows: dict[str, Any]) -> str:
    """The module a ``follows`` on a forward's ``nonfinite`` names: ``text_encoder.encoder.layers.0``."""
    return follows["component"] + (f".{follows['module']}" if follows.get("module") else "")


def _input(follows: dict[str, Any]) -> str:
    """What a ``follows`` on a ``nonfinite_input`` names: the batch, or the frozen model that made it."""
    made_by = follows.get("component")
    return f"NaN/Inf output of {made_by}" if made_by else "non-finite input batch"


def step_error(anomaly: Anomaly) -> str:
    """An error leaving a watched model's training forward (``training.oom_watch``).

    >>> from diffusion_debug.record import make_anomaly
    >>> print(make_anomaly("step_error", component="model", module="up_blocks.1", step=3,
    ...       details={"error": "ValueError: a bad batch", "phase": "forward"}).message)
    The training forward raised ValueError: a bad batch in up_blocks.1 at step 3: the forward did not finish (a loop
    that catches the error and goes on skips the step).
    """
    d = anomaly.details
    place = " ".join(p for p in (anomaly.component if anomaly.component != "model" else "", anomaly.module) if p)
    where = (f" in {place}" if place else "") + (f" at step {anomaly.step}" if anomaly.step is not None else "")
    return (
        f"The training {d.get('phase', 'forward')} raised {d['error']}{where}: the {d.get('phase', 'forward')} did "
        "not finish (a loop that catches the error and goes on skips the step)."
    )
