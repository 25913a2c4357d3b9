"""Run under `accelerate launch --config_file configs/accelerate_2cpu.yaml --num_processes 8` by
test_stalls_multiprocess.py (``--num_processes 3`` for the scenarios that end the job on their own):
hangs the liveness side channel must name (``stall_timeout`` 3 s).

Usage: stall_job.py <output_dir> <scenario> [<scenario> ...]; the scenarios run one after the other
in the same processes, each with its own model, debugger and ``<output_dir>/<scenario>``; every
printed line is prefixed with ``<scenario>: ``. A scenario whose stall ends the job comes last.
Scenarios: multiprocess_job.py's nan_rank5 and clean_history10 (:data:`MULTIPROCESS`, first) | clean
(6 steps, nothing stalls) | validation (rank 0 validates after step 2 while the others go on,
until every rank's watcher has named the stall and :data:`NAMED_MARGIN` s more, 7 s at most;
``stall_action="wait"``: named, then training goes on) | skip_rank5 (rank 5 leaves out step 3
with ``continue``: the others hang in the last step, ended) | monitor_rank0_only (``if
accelerator.is_main_process: monitor_training_step(...)``: ended at the first exchange) |
raise_rank1_backward (6 steps; ``stall_action="wait"``: at step 3 a hook on rank 1's model output raises in backward,
outside the watched forward, while the others wait in the gradient all-reduce; rank 1 catches it and sleeps in its
``except`` clause, as a rank saving a checkpoint on a crash would, until every rank's watcher has named it and
:data:`NAMED_MARGIN` s more, 7 s at most; then it computes the loss again from the same output: all go on) |
raise_rank2_save (6 steps; ``stall_action="wait"``: after step 1's optimizer step rank 2's ``with tdbg.phase("save"):``
raises; rank 2 handles it in its ``except`` clause, as raise_rank1_backward's rank 1, while the others wait in step
2's gradient all-reduce; then all go on) |
left_early_last_rank (uneven data: the last rank's loader is one batch shorter, it leaves the loop
after step 4 and closes its debugger while the others wait in step 5's gradient all-reduce; ended.
The last rank then sleeps, as a rank saving its last checkpoint would, before its own end of the job).
"""

import os
import sys
import time

import torch
from accelerate import Accelerator
from multiprocess_job import count_collectives  # beside this file
from multiprocess_job import run_scenario as multiprocess_scenario

from diffusion_debug import DebugConfig, DiffusionDebugError, TrainingDebugger
from diffusion_debug.testing.launch import sleep_until_stall_named

STALL_TIMEOUT = 3.0
NAMED_MARGIN = 1.5  # three looks of each watcher (every STALL_TIMEOUT / 6 s) while the ranks still wait
MULTIPROCESS = ("nan_rank5", "clean_history10")
"""multiprocess_job.py's 8-process scenarios (test_multiprocess.py's), run by this job before the
stalls': an 8-process launch less (8 processes starting cost ~25 CPU-s on two shared cores)."""


def say(scenario: str, line: str) -> None:
    sys.stdout.write(f"{scenario}: {line}\n")  # one write: the ranks share the launcher's stdout
    sys.stdout.flush()


def run_scenario(accelerator: Accelerator, output_dir: str, scenario: str) -> None:
    rank = accelerator.process_index
    leaves_early = scenario == "left_early_last_rank" and rank == accelerator.num_processes - 1
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    config = DebugConfig(output_dir=output_dir, stall_timeout=STALL_TIMEOUT, level="basic")
    tdbg = TrainingDebugger(model, accelerator=accelerator, config=config)
    generator = torch.Generator().manual_seed(100 + rank)
    try:
        for step in range(5 if leaves_early else 6):
            if scenario == "skip_rank5" and rank == 5 and step == 3:
                continue  # a bad batch on one rank only
            x = torch.randn(8, 4, generator=generator)
            pred = model(x)
            loss = ((pred - x.sum(1, keepdim=True)) ** 2).mean()
            if scenario == "raise_rank1_backward" and rank == 1 and step == 3:
                loss = backward_raising_once(accelerator, tdbg, scenario, pred, x)
            else:
                accelerator.backward(loss)
            if scenario != "monitor_rank0_only" or accelerator.is_main_process:
                try:
                    tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
                except DiffusionDebugError as error:
                    say(scenario, f"RANK {rank} RAISED at step {step}: {error}")
                    raise
            optimizer.step()
            optimizer.zero_grad()
            if scenario == "raise_rank2_save" and rank == 2 and step == 1:
                save_raising_once(accelerator, tdbg, scenario)
            if scenario == "validation" and rank == 0 and step == 2:
                with tdbg.phase("validation"):
                    run_dir, ranks = tdbg.record.run_dir, accelerator.num_processes
                    sleep_until_stall_named(run_dir, ranks, margin=NAMED_MARGIN, most=7.0)  # as a 7 s validation
        if accelerator.is_main_process:
            say(scenario, f"RUN_DIR {tdbg.report().save(html=False)}")  # the tests read no report.html
        say(scenario, f"RANK {rank} DONE")
    finally:
        tdbg.close()
    if leaves_early:
        time.sleep(20.0)  # the others name the stall and end themselves meanwhile


def backward_raising_once(accelerator: Accelerator, tdbg: TrainingDebugger, scenario: str, pred, x):
    """raise_rank1_backward's step 3 on rank 1: a hook on the model's output (after the debugger's backward mark)
    raises in backward while the others wait in the gradient all-reduce; handled, then the loss again (returned)."""
    rank = accelerator.process_index

    def check(grad):
        raise ValueError("planted error in backward on rank 1")

    handle = pred.register_hook(check)
    try:
        accelerator.backward(((pred - x.sum(1, keepdim=True)) ** 2).mean())
    except ValueError as error:
        say(scenario, f"RANK {rank} RAISED at step 3: {error}")
        run_dir, ranks = tdbg.record.run_dir, accelerator.num_processes
        sleep_until_stall_named(run_dir, ranks, margin=NAMED_MARGIN, most=7.0)  # handling it
    handle.remove()
    loss = ((pred - x.sum(1, keepdim=True)) ** 2).mean()  # again: it joins their all-reduce
    accelerator.backward(loss)
    return loss


def save_raising_once(accelerator: Accelerator, tdbg: TrainingDebugger, scenario: str) -> None:
    """raise_rank2_save's step 1 on rank 2: its save (``tdbg.phase("save")``) raises after the optimizer step while
    the others go on to step 2's all-reduce; handled in the ``except`` clause until named, then training goes on."""
    rank = accelerator.process_index
    try:
        with tdbg.phase("save"):
            raise OSError("planted error in the save on rank 2")
    except OSError as error:
        say(scenario, f"RANK {rank} RAISED at step 1: {error}")
        run_dir, ranks = tdbg.record.run_dir, accelerator.num_processes
        sleep_until_stall_named(run_dir, ranks, margin=NAMED_MARGIN, most=7.0)  # handling the save's error


def warm_up(accelerator: Accelerator) -> None:
    """One DDP step without a debugger: first-use costs (lazy imports, bucket rebuilds) on 8 processes
    sharing two cores take seconds, longer than the scenarios' stall_timeout."""
    model = accelerator.prepare(torch.nn.Linear(4, 1))
    for _ in range(2):
        accelerator.backward(model(torch.ones(2, 4)).sum())
    accelerator.wait_for_everyone()


def main() -> None:
    output_dir, scenarios = sys.argv[1], sys.argv[2:]
    accelerator = Accelerator(cpu=True)
    warm_up(accelerator)
    if any(scenario in MULTIPROCESS for scenario in scenarios):
        count_collectives()  # their tests read the collectives each monitored step called
    for scenario in scenarios:
        run = multiprocess_scenario if scenario in MULTIPROCESS else run_scenario
        run(accelerator, os.path.join(output_dir, scenario), scenario)
        accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
