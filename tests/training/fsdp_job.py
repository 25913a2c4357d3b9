"""Run under `torchrun --nproc_per_node 2` (gloo, CPU) by test_fsdp_multiprocess.py: a tiny diffusers
UNet sharded with FSDP2 (``fully_shard`` on each down, mid and up block and on the root), AdamW, MSE on
random latents, watched by a TrainingDebugger (``stall_timeout`` 4 s, ``stall_action`` "exit").

Usage: fsdp_job.py <output_dir> <scenario> [<scenario> ...]; the scenarios run one after the other
in the same two processes, each with its own model, optimizer, debugger and ``<output_dir>/<scenario>``;
every printed line is prefixed with ``<scenario>: ``. A scenario that ends the job comes last.
Scenarios: nan_grad_rank1 (14 steps; rank 1's shard of ``conv_in.weight``'s gradient holds a NaN
at step 12, and the update applies it) | nan_grad_rank1_before_reduction (14 steps; rank 1's own
gradient of ``conv_in`` is NaN at step 12, before the reduce-scatter: a backward pre-hook on the
module makes its grad_output NaN) | mixed_bf16_nan_grad_rank0_before_reduction (4 steps, the same on
rank 0 at step 2, each block sharded with ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``
and ``reshard_after_forward=False``) | nan_loss_rank0 (5 steps; rank 0's loss is NaN at step 4) |
lr_jump_and_wait (12 steps; ``stall_action`` "wait": rank 1 sleeps just before step 4's backward
until both ranks' watchers have named the stall and :data:`NAMED_MARGIN` s more (2.5 stall times at
most), then the run goes on; the learning rate goes from 1e-4 to 1 at step 10) |
stall_rank1 (8 steps; rank 1 sleeps 60 s before step 6's forward, as behind a slow data loader:
ended by the verdict) | fsdp1_nan_grad_rank1 (8 steps; FSDP1 instead: ``FullyShardedDataParallel``
with ``use_orig_params=True`` and ``device_id`` the CPU (without one it asks for an accelerator)
on each block and the root, ``rank_check_every`` 4; rank 1's shard of ``conv_out.weight``'s
gradient holds a NaN at step 6; prints the ParameterSwaps check's refreshes and entries; rank 0's
loss is NaN at step 2, monitored with ``closure=`` (its forward and loss again), and that step's
optimizer step is left out on both ranks, as a loop that skips a NaN step does; prints each rank's
reported gradient norm and FSDP1's own ``clip_grad_norm_`` (max_norm inf: it scales by 1.0) at
each clean step, and the engine a stall in backward names) | fsdp1_flat_nan_grad_rank1 (6 steps; the
same FSDP1 units with ``use_orig_params=False``, FSDP1's default: the model's parameters are each
unit's ``FlatParameter``; rank 1's gradient of ``down_blocks.1``'s flat parameter holds a NaN at
step 4 in the last element of its shard's piece of ``resnets.0.conv2.weight``; prints that piece's
end in each rank's shard and FSDP1's own ``clip_grad_norm_`` beside the reported norm at each clean step) |
embedding_new_row (16 steps; not the UNet: textual inversion's embedding table, its new row in rank 1's
shard trained alone, then from step 5 on no row, :func:`embedding_new_row`) | nan_batch_rank1 (4 steps; rank 1's
batch holds a NaN at step :data:`NAN_BATCH_AT`, the batch given as ``inputs=``: after the reduce-scatter both
ranks' shards are NaN) | raise_rank1_forward (6 steps, ``stall_action`` "wait"; at step :data:`RAISE_AT` rank 1's
forward raises in ``conv_in``, after the root's all-gather, while rank 0 goes on to ``down_blocks.0``'s: rank 1
catches it, sleeps until both watchers have named the stall and :data:`NAMED_MARGIN` s more (2.5 stall times
at most), then runs the forward again, which joins rank 0's all-gather: both go on) |
accumulate_checkpointed_nan_rank1 (:data:`ACCUMULATE_STEPS` optimizer steps of two micro-steps each, FSDP2's gradient
accumulation: ``set_requires_gradient_sync(False)`` on the first micro-step, monitored after every backward with no
``accumulating=``; each block's forward under non-reentrant activation checkpointing; rank 1's gradient of ``conv_in``
is NaN in the first micro-step of step :data:`ACCUMULATE_NAN_AT`; at each clean step each rank prints the reported
norm and ``torch.nn.utils.clip_grad_norm_``'s of the DTensor gradients: ``RANK r CLIP step s: <measured> <clip>``).
"""

import functools
import json
import os
import sys
import time

import torch
import torch.distributed as dist

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch 2.5, the floor: FSDP2 is not yet public
    from torch.distributed._composable.fsdp import fully_shard

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.testing.launch import sleep_until_stall_named
from diffusion_debug.testing.training_unets import sharded_unet
from diffusion_debug.training.hangs.patterns import Position, name_stall
from diffusion_debug.training.watched_models import ParameterSwaps

STALL_TIMEOUT = 4.0
NAMED_MARGIN = 2.0  # three looks of each watcher (every STALL_TIMEOUT / 6 s) while rank 0 still waits
STEPS = {
    "nan_grad_rank1": 14,
    "nan_grad_rank1_before_reduction": 14,
    "mixed_bf16_nan_grad_rank0_before_reduction": 4,
    "nan_loss_rank0": 5,
    "lr_jump_and_wait": 12,
    "stall_rank1": 8,
    "fsdp1_nan_grad_rank1": 8,
    "fsdp1_flat_nan_grad_rank1": 6,
    "embedding_new_row": 16,
    "nan_batch_rank1": 4,
    "raise_rank1_forward": 6,
}
NAN_BATCH_AT, RAISE_AT = 2, 3
"""nan_batch_rank1's step whose batch holds a NaN on rank 1; raise_rank1_forward's step whose forward raises there."""
ACCUMULATE_STEPS, ACCUMULATE_NAN_AT = 4, 2
"""accumulate_checkpointed_nan_rank1's optimizer steps, and the one whose first micro-step makes rank 1's NaN."""
NEW_ROW_UNTIL = 5
SYNC_OFF_CALLS = 260
"""sync_off_forever's calls, all with the sync off: past the finding's floor (256, training.step.sync_off)."""
"""embedding_new_row: the steps before it train the table's last row alone; from it on no row."""


def say(scenario: str, line: str) -> None:
    sys.stdout.write(f"{scenario}: {line}\n")  # one write: the ranks share the launcher's stdout
    sys.stdout.flush()


def tiny_unet():
    torch.manual_seed(0)
    return sharded_unet()


def _mixed(scenario: str) -> dict:
    """``fully_shard``'s arguments: the ``mixed_bf16_`` scenarios compute in bfloat16 and reduce the
    gradients in float32 (``MixedPrecisionPolicy``) and keep the parameters unsharded after forward."""
    if not scenario.startswith("mixed_bf16_"):
        return {}
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    except ImportError:  # torch 2.5, the floor
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return {"mp_policy": policy, "reshard_after_forward": False}


def fsdp1_unet(use_orig_params: bool = True):
    """The same UNet under FSDP1: each block and the root a ``FullyShardedDataParallel`` unit,
    ``conv_out`` under activation checkpointing (``checkpoint_wrapper``, as Accelerate's plugin
    applies it): its weight is ``_fsdp_wrapped_module.conv_out._checkpoint_wrapped_module.weight``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import FullyShardedDataParallel

    def unit(module):
        return FullyShardedDataParallel(module, use_orig_params=use_orig_params, device_id=torch.device("cpu"))

    unet = tiny_unet()
    unet.conv_out = checkpoint_wrapper(unet.conv_out)
    for blocks in (unet.down_blocks, unet.up_blocks):
        for i, block in enumerate(blocks):
            blocks[i] = unit(block)
    unet.mid_block = unit(unet.mid_block)
    return unit(unet)


def embedding_new_row(output_dir: str, scenario: str) -> None:
    """Textual inversion under FSDP2: an ``nn.Embedding(8, 4)`` sharded along its rows (rank 0 holds rows
    0-3, rank 1 rows 4-7), SGD on all of it; after each optimizer step every row but the new token's (the
    last, in rank 1's shard) is put back where it started, as the diffusers script does; from step
    :data:`NEW_ROW_UNTIL` on the new row too (a mask that misses the placeholder token: the run learns
    nothing from then on)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    table = torch.nn.Embedding(8, 4)
    fully_shard(table)
    optimizer = torch.optim.SGD(table.parameters(), lr=0.05)
    tdbg = TrainingDebugger(table, config=DebugConfig(output_dir=output_dir, stall_timeout=STALL_TIMEOUT))
    kept = table.weight.to_local().detach().clone()  # this rank's rows as they started
    generator = torch.Generator().manual_seed(100 + rank)
    try:
        for step in range(STEPS[scenario]):
            tokens = torch.randint(0, 8, (4, 3), generator=generator)
            loss = (table(tokens).sum(-1) - 1.0).square().mean()
            loss.backward()
            tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                rows = table.weight.to_local()
                trained = 1 if rank == dist.get_world_size() - 1 and step < NEW_ROW_UNTIL else 0
                rows[: len(rows) - trained] = kept[: len(rows) - trained]
        _saved(tdbg, scenario, rank)
    finally:
        tdbg.close()


def _saved(tdbg: TrainingDebugger, scenario: str, rank: int) -> None:
    """Rank 0 saves the run (its directory said), then every rank says it is done, after the others."""
    if rank == 0:
        say(scenario, f"RUN_DIR {tdbg.report().save(html=False)}")
    dist.barrier()
    say(scenario, f"RANK {rank} DONE")


def accumulate_checkpointed(output_dir: str, scenario: str) -> None:
    """FSDP2's own gradient accumulation, as its docs write it: no reduce-scatter on the micro-steps
    (``set_requires_gradient_sync(False)``), the debugger called after every backward as in a loop without
    Accelerate (no ``accumulating=``), each block checkpointed (``torch.utils.checkpoint``, non-reentrant)."""
    from torch.utils.checkpoint import checkpoint

    rank = dist.get_rank()
    unet = tiny_unet()
    for block in (*unet.down_blocks, unet.mid_block, *unet.up_blocks):
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        fully_shard(block)
    fully_shard(unet)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    tdbg = TrainingDebugger(unet, config=DebugConfig(output_dir=output_dir, stall_timeout=STALL_TIMEOUT))
    at = [None]
    unet.conv_in.register_full_backward_pre_hook(  # rank 1's own gradient, in a micro-step FSDP2 does not reduce
        lambda module, grad_output: (
            (grad_output[0] * float("nan"),) if (rank, at[0]) == (1, ACCUMULATE_NAN_AT) else None
        )
    )
    generator = torch.Generator().manual_seed(100 + rank)
    try:
        for step in range(ACCUMULATE_STEPS):
            for micro in range(2):
                at[0] = step if micro == 0 else None
                unet.set_requires_gradient_sync(micro == 1)
                latents = torch.randn(2, 4, 8, 8, generator=generator)
                noise = torch.randn(2, 4, 8, 8, generator=generator)
                text = torch.randn(2, 3, 32, generator=generator)
                timesteps = torch.randint(0, 1000, (2,), generator=generator)
                sample = unet(latents + noise, timesteps, encoder_hidden_states=text).sample
                loss = torch.nn.functional.mse_loss(sample, noise)
                loss.backward()
                info = tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
            if step < ACCUMULATE_NAN_AT:
                clipped = torch.nn.utils.clip_grad_norm_(unet.parameters(), float("inf"))  # a DTensor: the whole norm
                say(scenario, f"RANK {rank} CLIP step {step}: {info['grad_norm']!r} {float(clipped.full_tensor())!r}")
            optimizer.step()
            optimizer.zero_grad()
        _saved(tdbg, scenario, rank)
    finally:
        tdbg.close()


def sync_off_forever(output_dir: str, scenario: str) -> None:
    """A loop that turns FSDP2's gradient sync off and never back on (``training.step.sync_off``): a
    small MLP, the debugger after every backward; every rank says its own ``gradient_sync_off`` finding."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    fully_shard(model)
    model.set_requires_gradient_sync(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=output_dir))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))
    try:
        for step in range(SYNC_OFF_CALLS):
            loss = model(x).pow(2).mean()
            loss.backward()
            tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        for a in tdbg.report().anomalies:
            if a.details.get("reason") == "gradient_sync_off":
                say(scenario, f"RANK {rank} SYNC_OFF {a.severity} {a.step} {a.rank} {a.details['cause']}")
        _saved(tdbg, scenario, rank)
    finally:
        tdbg.close()


def run_scenario(output_dir: str, scenario: str) -> None:
    if scenario == "sync_off_forever":
        return sync_off_forever(output_dir, scenario)
    if scenario == "embedding_new_row":
        return embedding_new_row(output_dir, scenario)
    if scenario == "accumulate_checkpointed_nan_rank1":
        return accumulate_checkpointed(output_dir, scenario)
    rank = dist.get_rank()
    fsdp1 = scenario == "fsdp1_nan_grad_rank1"
    flat = scenario == "fsdp1_flat_nan_grad_rank1"
    if flat:
        unet = fsdp1_unet(use_orig_params=False)
        planted = _flat_piece(unet.module.down_blocks[1], "resnets.0.conv2.weight")
        say(scenario, f"RANK {rank} PIECE {planted[1]}")
    elif fsdp1:
        unet = fsdp1_unet()
        refreshes = [0]
        refresh = ParameterSwaps.refresh

        def counted(swaps):
            refreshes[0] += 1
            refresh(swaps)

        ParameterSwaps.refresh = counted  # this process's scenarios after it are FSDP2's: no check
    else:
        unet = tiny_unet()
        for block in (*unet.down_blocks, unet.mid_block, *unet.up_blocks):
            fully_shard(block, **_mixed(scenario))
        fully_shard(unet, **_mixed(scenario))
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    action = "wait" if scenario in ("lr_jump_and_wait", "raise_rank1_forward") else "exit"
    every = {"rank_check_every": 4} if fsdp1 else {}  # FSDP1: two rank checks in 8 steps
    config = DebugConfig(output_dir=output_dir, stall_timeout=STALL_TIMEOUT, stall_action=action, **every)
    tdbg = TrainingDebugger(unet, config=config)
    generator = torch.Generator().manual_seed(100 + rank)
    at = [None]
    made_on = {"nan_grad_rank1_before_reduction": 1, "mixed_bf16_nan_grad_rank0_before_reduction": 0}
    if scenario in made_on:  # a tensor hook on a sharded parameter never fires
        nan_at = (made_on[scenario], STEPS[scenario] - 2)
        unet.conv_in.register_full_backward_pre_hook(
            lambda module, grad_output: (grad_output[0] * float("nan"),) if (rank, at[0]) == nan_at else None
        )
    raised = [False]
    if scenario == "raise_rank1_forward":  # a bad batch on rank 1: conv_in raises once, after the root's all-gather

        def bad_batch(module, args):
            if (rank, at[0]) == (1, RAISE_AT) and not raised[0]:
                raised[0] = True
                raise ValueError("planted bad batch on rank 1")

        unet.conv_in.register_forward_pre_hook(bad_batch)
    try:
        for step in range(STEPS[scenario]):
            at[0] = step
            latents = torch.randn(2, 4, 8, 8, generator=generator)
            noise = torch.randn(2, 4, 8, 8, generator=generator)
            text = torch.randn(2, 3, 32, generator=generator)
            timesteps = torch.randint(0, 1000, (2,), generator=generator)
            if scenario == "stall_rank1" and rank == 1 and step == 6:
                say(scenario, f"RANK 1 STALLS at {time.time()}")
                time.sleep(60.0)  # a rank stuck before its forward (a slow data loader, a save)
            if scenario == "nan_batch_rank1" and rank == 1 and step == NAN_BATCH_AT:
                latents[1, 0, 0, 0] = float("nan")  # rank 1's batch alone
            try:
                pred = unet(latents + noise, timesteps, encoder_hidden_states=text).sample
            except ValueError as error:  # rank 1 alone: rank 0 waits in down_blocks.0's all-gather
                say(scenario, f"RANK {rank} RAISED at step {step}: {error}")
                sleep_until_stall_named(tdbg.record.run_dir, 2, margin=NAMED_MARGIN, most=2.5 * STALL_TIMEOUT)
                pred = unet(latents + noise, timesteps, encoder_hidden_states=text).sample  # retried: they go on
            loss = torch.nn.functional.mse_loss(pred, noise)
            if rank == 0 and (scenario, step) in (("nan_loss_rank0", 4), ("fsdp1_nan_grad_rank1", 2)):
                loss = loss * float("nan")
            if scenario == "lr_jump_and_wait" and rank == 1 and step == 4:
                # just before backward: rank 0 waits in backward's all-gather
                sleep_until_stall_named(tdbg.record.run_dir, 2, margin=NAMED_MARGIN, most=2.5 * STALL_TIMEOUT)
            loss.backward()
            if scenario == "nan_grad_rank1" and rank == 1 and step == 12:
                unet.conv_in.weight.grad.to_local().view(-1)[0] = float("nan")  # rank 1's own shard
            if scenario == "fsdp1_nan_grad_rank1" and rank == 1 and step == 6:
                unet.module.conv_out.weight.grad.view(-1)[0] = float("nan")  # rank 1 holds conv_out
            if scenario == "lr_jump_and_wait" and step == 10:
                for group in optimizer.param_groups:
                    group["lr"] = 1.0
            if flat and rank == 1 and step == 4:
                planted[0].grad[planted[1] - 1] = float("nan")  # the last element of the piece (in rank 1's shard)
            if fsdp1 and step == 2:  # rank 0's NaN loss, with closure=: the same forward and loss again

                def closure():
                    again = torch.nn.functional.mse_loss(unet(latents + noise, timesteps, text).sample, noise)
                    return again * float("nan") if rank == 0 else again

                tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, closure=closure)
                optimizer.zero_grad()  # the NaN step's update left out on both ranks
                continue
            batch = {"latents": latents} if scenario == "nan_batch_rank1" else None
            info = tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, inputs=batch)
            # FSDP1's own norm of the clean whole gradients (an all-reduce; 1.0 x each)
            if (fsdp1 and step < 6) or (flat and step < 4):
                reference = float(unet.clip_grad_norm_(float("inf")))
                norms = {"loss": float(loss), "measured": info["grad_norm"], "reference": reference}
                say(scenario, f"RANK {rank} NORM step {step}: {json.dumps(norms)}")
            optimizer.step()
            optimizer.zero_grad()
        if fsdp1:
            ParameterSwaps.refresh = refresh
            engine = tdbg._liveness.position.engine  # what a stall in backward names
            waiting = name_stall([Position(0, "validation", 2), Position(1, "backward", 3, engine=engine)]).text
            say(scenario, f"RANK {rank} ENGINE {engine}: {waiting}")
            say(scenario, f"RANK {rank} PRE-REDUCTION {json.dumps(tdbg.get_summary()['pre_reduction_check'])}")
            held = tdbg._swaps.check[2]  # each module and parameter the names walk to (None: not found)
            found = sum(h is not None for h in held)
            say(scenario, f"RANK {rank} SWAP CHECK: {refreshes[0]} refreshes, {len(held)} entries, {found} found")
        _saved(tdbg, scenario, rank)
    finally:
        tdbg.close()


def _flat_piece(unit, fqn: str) -> tuple[torch.Tensor, int]:
    """The flat parameter of the FSDP1 unit ``unit`` and the end (exclusive) of the elements of its
    original parameter ``fqn`` in this rank's shard (0: none of them are)."""
    flat = unit._flat_param
    info = flat._shard_param_infos[list(flat._fqns).index(fqn)]
    return flat, info.offset_in_shard + info.numel_in_shard if info.in_shard else 0


def main() -> None:
    output_dir, scenarios = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    for scenario in scenarios:
        run_scenario(os.path.join(output_dir, scenario), scenario)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
