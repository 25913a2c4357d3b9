"""Run under `torchrun --nproc_per_node 2` (DS_ACCELERATOR=cpu, gloo) by test_deepspeed.py (and
test_deepspeed_stage0_launch.py, the ``stage0_`` scenarios): the tiny diffusers UNet trained by a raw
DeepSpeed ZeRO-2 engine (``deepspeed.initialize``; ZeRO-3 or no ZeRO: the prefixes below), the debugger given
the engine as the model and its optimizer.

Usage: deepspeed_job.py <output_dir> <scenario> [<scenario> ...]; the scenarios run one after the
other in the same processes, each with its own engine, debugger and ``<output_dir>/<scenario>``;
every printed line is prefixed with ``<scenario>: ``; at step 1 each rank prints the debugger's
gradient norm and DeepSpeed's own (``safe_get_full_grad``). Scenarios: nan_grad_rank1 (14 steps, clean
but for a NaN written into one parameter's gradient in rank 1's partition at step 12) |
nan_grad_rank1_before_reduction (14 steps; a tensor hook makes rank 1's own gradient of the same parameter
NaN at step 12, during backward, before ZeRO reduces it) | nan_grad_rank1_in_rank0_partition (the same, on
``RANK0_PARAMETER``, whose reduced gradient ZeRO keeps in rank 0's partition: rank 1 holds none of its
NaN; each rank prints whether its partition holds that parameter) | nan_loss_rank0
(rank 0's loss is NaN at step 4 of 6) | lr_jump (the lr x1e4 at step 10 of 12) | stall_rank1 (rank 1
sleeps before step 6's forward; ``stall_action="exit"`` ends the job: it comes last). A scenario
prefixed ``zero3_`` runs on a ZeRO-3 engine (every parameter partitioned over the ranks): zero3_clean
(14 clean steps) | zero3_nan_grad_rank1_before_reduction | zero3_stall_rank1 (rank 1 sleeps
with ``stall_action="wait"`` until both ranks' watchers have named the stall and ``NAMED_MARGIN`` s
more, ``STALL_RESUMES`` s at most: named, then both ranks go on).
fp16_overflow / zero3_fp16_overflow (4 steps in fp16 with DeepSpeed's dynamic loss scale from
``2**FP16_SCALE_POWER``: the first steps overflow and are skipped while the scale settles; after each
step each rank prints the debugger's norm, DeepSpeed's own (``get_global_grad_norm``, unscaled) and
its skip count: ``RANK r FP16 step s: <measured> <deepspeed> <skipped>``). DeepSpeed's CPU
accelerator says it has no fp16: it is told it has (torch runs these fp16 ops on the CPU).
A scenario prefixed ``stage0_`` runs on an engine without ZeRO (``zero_optimization.stage`` 0) in bf16;
``stage0_fp16_``: in fp16, DeepSpeed's dynamic loss scale from ``2**STAGE0_SCALE_POWER``, which holds
but for the plant (each rank prints the ``RANK r FP16`` lines above). Each rank prints the engine's
optimizer (``RANK r OPTIMIZER <class>``: DeepSpeed's mixed-precision wrapper of the AdamW) and, at the
end, what its own report leads with (``RANK r HEADLINE <kind> <severity> rank <r> step <s> <parameter>``):
stage0_nan_grad_rank1_before_reduction / stage0_fp16_nan_grad_rank1_before_reduction (``STAGE0_STEPS``
steps; the tensor hook makes rank 1's own gradient of ``NAN_PARAMETER`` NaN at step ``STAGE0_NAN_AT``,
during backward, before the engine's all-reduce) | stage0_accumulate_boundary_off (bf16,
``gradient_accumulation_steps`` 2, each micro-step monitored, ``BOUNDARY_OFF_STEPS`` steps: two whole, then
from step ``BOUNDARY_OFF_AT`` the loop turns the engine's boundary off,
``engine.set_gradient_accumulation_boundary(False)``, and never back on: no all-reduce, no optimizer step after it).

zero3_nan_batch_rank1 (ZeRO-3, 4 steps: rank 1's batch holds a NaN at step 2) | fp16_inf_batch_rank1 (ZeRO-2 in
fp16, the scale from ``2**STAGE0_SCALE_POWER``, which holds: rank 1's batch holds an Inf at step 2, DeepSpeed's
loss scaler skips that step) | fp16_accumulate_inf_last_rank1 (the same in ``gradient_accumulation_steps``
2, each micro-step monitored, ``ACCUMULATE_STEPS`` steps: rank 1's batch holds an Inf in the first micro-step
of the last, which DeepSpeed skips; the report is made before close) | stall_before_step_rank1 (ZeRO-2,
``stall_action`` "wait": after step 6's monitor rank 1 sleeps, as the main process saving a checkpoint would,
until both ranks' watchers have named the stall and ``NAMED_MARGIN`` s more, ``STALL_RESUMES`` s at most,
while rank 0 waits in ``engine.step()``'s collectives).

Every scenario prints, per rank and monitored step, the torch.distributed collectives the
debugger called in it (``RANK r COLLECTIVES step s: all_reduce[n],...``, as multiprocess_job.py).
"""

import math
import os
import sys
import time

import torch

try:
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import safe_get_full_grad
except Exception as error:  # the test skips, saying why
    print(f"NO_DEEPSPEED {error!r}".replace("\n", " "), flush=True)
    sys.exit(0)

from multiprocess_job import count_collectives, monitored  # beside this file

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.testing.launch import sleep_until_stall_named
from diffusion_debug.testing.training_unets import tiny_sd_unet

STALL_TIMEOUT = 3.0
STALL_RESUMES = 10.0  # the most seconds rank 1 sleeps where the stall is only named (stall_action "wait")
NAMED_MARGIN = 1.5  # three looks of each watcher (every STALL_TIMEOUT / 6 s) while rank 0 still waits
NAN_PARAMETER = "up_blocks.1.resnets.0.conv2.weight"  # in rank 1's half of the flat partition
RANK0_PARAMETER = "up_blocks.0.resnets.0.conv1.weight"  # in rank 0's half
FP16_SCALE_POWER = 19  # steps 0 and 1 overflow (the scale halves at the second), 2 and 3 do not
STAGE0_STEPS, STAGE0_NAN_AT = 4, 2  # a clean step each side of the planted one, and the one after
STAGE0_SCALE_POWER = 8  # fp16 without ZeRO: no overflow but the planted one
ACCUMULATE_STEPS = 3  # fp16_accumulate_inf_last_rank1: two clean steps, then the skipped one last
BOUNDARY_OFF_STEPS, BOUNDARY_OFF_AT = 6, 2  # stage0_accumulate_boundary_off: 2 steps, then 8 micro-steps unsynced
HTML = ("nan_grad_rank1_in_rank0_partition", "nan_loss_rank0")  # the others' tests read no report.html (seconds each)


def say(scenario: str, line: str) -> None:
    sys.stdout.write(f"{scenario}: {line}\n")  # one write: the ranks share the launcher's stdout
    sys.stdout.flush()


def run_scenario(output_dir: str, scenario: str) -> None:
    rank = int(os.environ["RANK"])
    unet = tiny_sd_unet(seed=0).train()  # the tiny SD pipeline's UNet, without the rest of the pipeline
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    stage = 3 if scenario.startswith("zero3_") else 0 if scenario.startswith("stage0_") else 2
    kind = scenario.removeprefix("zero3_").removeprefix("stage0_")  # the same scenario, on another engine
    fp16 = kind.startswith("fp16_")
    kind = kind if kind == "fp16_overflow" else kind.removeprefix("fp16_")  # stage0_fp16_<kind>: <kind> in fp16
    scale = FP16_SCALE_POWER if kind == "fp16_overflow" else STAGE0_SCALE_POWER
    precision = {"fp16": {"enabled": True, "initial_scale_power": scale}} if fp16 else {}
    if stage == 0 and not fp16:
        precision = {"bf16": {"enabled": True}}
    nan_at = STAGE0_NAN_AT if stage == 0 else 12
    micro_steps = 2 if kind.startswith("accumulate_") else 1
    engine, optimizer, _, _ = deepspeed.initialize(
        model=unet,
        optimizer=optimizer,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
            "gradient_accumulation_steps": micro_steps,
            "steps_per_print": 10**6,
            **precision,
        },
    )
    stall = kind in ("stall_rank1", "stall_before_step_rank1")
    # ZeRO-2's stall ends the job (it comes last); ZeRO-3's is named and the ranks go on
    action = "wait" if stage == 3 or kind == "stall_before_step_rank1" else "exit"
    config = DebugConfig(output_dir=output_dir, stall_timeout=STALL_TIMEOUT if stall else 0, stall_action=action)
    tdbg = TrainingDebugger(engine, config=config)
    generator = torch.Generator().manual_seed(100 + rank)
    at = [None]
    planted = {"nan_grad_rank1_before_reduction": NAN_PARAMETER, "nan_grad_rank1_in_rank0_partition": RANK0_PARAMETER}
    if kind in planted:  # rank 1's own gradient, before ZeRO's reduction
        param = dict(engine.module.named_parameters())[planted[kind]]
        param.register_hook(lambda g: g * math.nan if (rank, at[0]) == (1, nan_at) else g)
        if stage == 2:  # ZeRO-2 links a parameter to this rank's flat partition where that holds it
            say(scenario, f"RANK {rank} HOLDS {getattr(param, '_hp_mapping', None) is not None}")
    steps = {
        "nan_grad_rank1": 14,
        "nan_grad_rank1_before_reduction": 14,
        "nan_grad_rank1_in_rank0_partition": 14,
        "nan_loss_rank0": 6,
        "lr_jump": 12,
        "stall_rank1": 8,
        "clean": 14,
        "fp16_overflow": 4,
        "nan_batch_rank1": 4,
        "inf_batch_rank1": 4,
        "stall_before_step_rank1": 8,
        "accumulate_inf_last_rank1": ACCUMULATE_STEPS,
        "accumulate_boundary_off": BOUNDARY_OFF_STEPS,
    }[kind]
    if stage == 0:  # DeepSpeed's mixed-precision optimizer around the AdamW
        say(scenario, f"RANK {rank} OPTIMIZER {type(optimizer).__name__}")
        steps = BOUNDARY_OFF_STEPS if kind == "accumulate_boundary_off" else STAGE0_STEPS
    for call in range(steps * micro_steps):
        step, micro = divmod(call, micro_steps)
        at[0] = step
        if kind == "stall_rank1" and rank == 1 and step == 6:  # the others wait in step 6's gradient reduce
            if action == "exit":
                time.sleep(60.0)  # the watcher ends the job
            else:  # the watcher names it, then both ranks go on
                sleep_until_stall_named(tdbg.record.run_dir, 2, margin=NAMED_MARGIN, most=STALL_RESUMES)
        latents = torch.randn(2, 4, 8, 8, generator=generator)
        context = torch.randn(2, 4, 32, generator=generator)
        timesteps = torch.randint(0, 1000, (2,), generator=generator)
        if fp16:
            latents, context = latents.half(), context.half()
        elif precision:
            latents, context = latents.bfloat16(), context.bfloat16()
        if kind in ("nan_batch_rank1", "inf_batch_rank1") and (rank, step) == (1, 2):
            latents[1, 0, 0, 0] = math.nan if kind == "nan_batch_rank1" else math.inf  # rank 1's batch alone
        if kind == "accumulate_inf_last_rank1" and (rank, step, micro) == (1, steps - 1, 0):
            latents[1, 0, 0, 0] = math.inf
        if kind == "accumulate_boundary_off" and (step, micro) == (BOUNDARY_OFF_AT, 0):
            engine.set_gradient_accumulation_boundary(False)  # a manual accumulation never set back to True
        prediction = engine(latents, timesteps, encoder_hidden_states=context).sample
        loss = torch.nn.functional.mse_loss(prediction.float(), latents.float())
        if scenario == "nan_loss_rank0" and rank == 0 and step == 4:
            loss = loss * math.nan
        engine.backward(loss)
        if scenario == "nan_grad_rank1" and rank == 1 and step == 12:
            plant_nan(engine)
        if scenario == "lr_jump" and step == 10:
            for group in optimizer.param_groups:
                group["lr"] *= 1e4
        info = monitored(scenario, rank, tdbg, loss, optimizer=optimizer, step=step)
        if kind == "stall_before_step_rank1" and rank == 1 and step == 6:  # rank 0 waits in engine.step()
            sleep_until_stall_named(tdbg.record.run_dir, 2, margin=NAMED_MARGIN, most=STALL_RESUMES)
        if (
            step == 1 and micro == micro_steps - 1 and not fp16
        ):  # the reference: every whole gradient, assembled by DeepSpeed (a collective each)
            reference = math.sqrt(sum(float(safe_get_full_grad(p).double().square().sum()) for p in unet.parameters()))
            say(scenario, f"RANK {rank} GRAD_NORM {info['grad_norm']!r} REFERENCE {reference!r}")
        engine.step()
        if fp16 and micro == micro_steps - 1:  # DeepSpeed's own norm of the step, unscaled (inf where it overflowed)
            say(
                scenario,
                f"RANK {rank} FP16 step {step}: {info['grad_norm']!r} {float(engine.get_global_grad_norm())!r} "
                f"{engine.skipped_steps}",
            )
    report = tdbg.report()
    if stage == 0:  # what each rank's own report leads with (rank 0's holds every rank's anomalies)
        lead = report.headline
        said = (
            "None"
            if lead is None
            else f"{lead.kind} {lead.severity} rank {lead.rank} step {lead.step} {lead.parameter}"
        )
        say(scenario, f"RANK {rank} HEADLINE {said}")
    if rank == 0:
        say(scenario, f"RUN_DIR {report.save(html=scenario in HTML)}")
    else:
        report.save()  # a non-main rank writes no HTML
    say(scenario, f"RANK {rank} DONE skipped={engine.skipped_steps}")
    tdbg.close()


def plant_nan(engine) -> None:
    """A NaN in rank 1's partition of one parameter's averaged gradient (where ZeRO-2 keeps it)."""
    param = dict(engine.module.named_parameters())[NAN_PARAMETER]
    fragment = param._hp_mapping.get_lp_grad_fragment(param._index_in_param_group)
    fragment.view(-1)[0] = math.nan


def main() -> None:
    output_dir, scenarios = sys.argv[1], sys.argv[2:]
    # DeepSpeed's shared-memory collectives are compiled on first use (minutes); gloo's serve
    deepspeed.ops.__compatible_ops__ = {}
    accelerator = type(get_accelerator())  # fp16 scenarios: torch runs their ops on the CPU
    accelerator.is_fp16_supported = lambda self: True
    accelerator.supported_dtypes = lambda self: [torch.float32, torch.bfloat16, torch.float16]
    deepspeed.init_distributed(dist_backend="gloo")
    count_collectives()
    for scenario in scenarios:
        run_scenario(os.path.join(output_dir, scenario), scenario)


if __name__ == "__main__":
    main()
