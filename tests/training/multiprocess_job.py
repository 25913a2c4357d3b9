"""Run under `accelerate launch --multi_gpu --num_processes 2` by test_multiprocess.py; its 8-process
scenarios (nan_rank5, clean_history10) are run by stall_job.py, in the 8-process launch that
test_multiprocess.py and test_stalls_multiprocess.py share.

Usage: multiprocess_job.py <output_dir> <scenario> [<scenario> ...]; the scenarios run one after the
other in the same two processes (one launch: each costs seconds of start-up), each with its own
model, optimizer, debugger and output directory ``<output_dir>/<scenario>``, every printed line
prefixed with ``<scenario>: ``. A scenario's planted failures are undone before the next begins.
Scenarios: nan_rank1 | raise | desync |
measure_fails_rank1 (rank 1's gradient norms raise at step 3) | judge_fails_rank1 (rank 1's loss
is NaN at step 3, a step whose details are exchanged, and its per-module norms
(gradients.ModuleNormBook.update) raise after the gather) |
judge_fails_quietly_rank1 (rank 1's per-module norms raise at step 3, a step nobody else finds special) |
record_fails_rank1_raise (policy raise; rank 1's loss is NaN at step 3 and its record.add_step raises then) |
record_fails_rank1 (policy record; rank 1's record.add_step raises at step 3, a clean step: its debugger_error,
recorded after the step's collectives, is in rank 1's events file alone) |
finetune_nan_loss_rank1 (the diffusers-style job of ``diffusion-debug train``: tiny UNet, DDPM noise, MSE;
rank 1's loss is NaN at step 5; the job builds its own Accelerator, so the finetune scenarios run after the others) |
finetune_lr_jump10 (the same job, 18 steps, its AdamW's learning rate x1e4 from step 10 on) |
models_and_samples_rank1 (two models watched by name, {"unet", "text_encoder"}, with per-sample losses and
loss weights: rank 1's weight of its sample at t=999 is NaN at step 2, its text encoder's gradient at step 4;
neither step is applied) |
scaler_not_passed_ddp / scaler_not_passed_nan0_rank1 (plain torch DDP, no Accelerate, fp16 with a GradScaler not
passed, policy raise: rank 1's NaN batch at step 6 / 0, :func:`scaler_not_passed`) | scaler_not_passed_nan0_record
(rank 1's NaN batch at step 0, policy record: the run goes on) | scaler_not_passed_finite_ddp
(the same in fp32, 3 steps, no NaN, ``max_grad_norm=100``: step 0 finite, held, its row unscaled once confirmed) |
scaler_not_passed_fails0_record (fp16, policy record, no NaN batch: rank 1's gradient norms raise at step 0;
``closure=`` given, its calls printed: ``RANK r REPLAYS [steps]``) |
closure_scaler_rank1 (a DDP model with a BatchNorm, whose forward broadcasts its buffers, and a GradScaler;
``closure=`` given on both ranks; rank 1's batch holds an Inf at step 1: only rank 1 has an error, both replay;
rank 0 alone reports after step 1) |
fsdp2 (the model sharded with FSDP2 ``fully_shard``, not prepared by Accelerate; per monitored step
each rank prints its measured norms and the reference from the whole gradients, ``full_tensor()``) |
nan_rank5 (8 processes: rank 5's loss is NaN at step 3) |
clean_history10 (30 clean steps, history_size=10: the record's bound) |
nan_grad_rank1 (14 steps; a tensor hook makes rank 1's own gradient of ``2.weight`` NaN at step 12,
during backward, before DDP's all-reduce gives it to rank 0) |
accumulate_unused (DDP with ``find_unused_parameters=True`` under ``accelerator.accumulate``, two
micro-steps a step, 8 calls; a branch ``unused`` joins the forward at call 3 only; at each optimizer
step each rank prints the norm measured, the learning rate times it (SGD: the update it applies),
the update applied to the weights and the steps counted: ``RANK r UPDATE call c: <json>``)
accumulate_nan_batch_rank1 / accumulate_nan_grad_rank1 (DDP under ``accelerator.accumulate``, two micro-steps a
step: rank 1's NaN, in its batch or made in its backward, at a micro-step DDP does not all-reduce,
:func:`accumulate_nan`)
launched_ddp_nan12 / launched_fsdp2_nan0 / launched_zero2_nan24 / launched_zero3_nan12 / launched_fsdp2_oom0 /
launched_zero3_oom0 (test_launch_engines.py's
launches of launch_torch_script.py and launch_zero_script.py, :data:`LAUNCHED`: each script run as a process of
``diffusion-debug launch`` runs it, by ``diffusion_debug.jobs.launched.main``, in this launch's processes,
:func:`run_launched`: four launches less, ~18 CPU-s each) | launched_accelerate_zero2_oom0 (test_launch_deepspeed.py's
launch_deepspeed_script.py under Accelerate's DeepSpeed plugin, ZeRO-2, out of memory in step 0's forward: its
environment as ``accelerate launch --use_deepspeed`` sets it) | plain_zero3_script (no debugger: the ZeRO-3 one's
script and arguments, the reference it must train exactly as) | launched_accelerate_nan0 (test_launch.py's
launch_script.py, rank 1's NaN gradient at step 0, run so)
plain_launch_script (no debugger: test_launch.py's launch_script.py run here as its plain launch would
run it, :data:`PLAIN`, saving its weights in the scenario's directory: the reference the watched launch
must train bitwise as; it builds its own Accelerator, as a finetune does; run last, after the launched scripts)

Every scenario prints, per rank and monitored step, the torch.distributed collectives the
debugger called in it (``RANK r COLLECTIVES step s: all_reduce,...``).

Both ranks call ``report().save()`` at the end (main first); each prints its training summary.

Long because it is one launch for many modules' scenarios (a start-up paid once): each scenario's body, and
the way a launched script runs in these processes as in its own (:func:`run_launched`), live here.
"""

import contextlib
import functools
import gc
import json
import os
import runpy
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator

from diffusion_debug import DebugConfig, DiffusionDebugError, TrainingDebugger
from diffusion_debug.training.measure import gradients

# the scenarios whose tests read report.html (seconds to draw each)
_HTML = ("nan_rank1", "nan_grad_rank1", "record_fails_rank1")
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier")
_called: list[str] | None = None  # the collectives called while the debugger monitors a step


def count_collectives() -> None:
    """Wrap torch.distributed's collectives so that :data:`_called` lists those made inside
    ``monitor_training_step`` (the ones a collective makes inside itself are not counted)."""

    def wrap(name, original):
        @functools.wraps(original)
        def counted(*args, **kwargs):
            if _called is not None:  # an all_reduce with the number of values it reduces
                _called.append(f"{name}[{args[0].numel()}]" if name == "all_reduce" else name)
            return original(*args, **kwargs)

        return counted

    for name in _COLLECTIVES:
        setattr(dist, name, wrap(name, getattr(dist, name)))


def monitored(scenario, rank, tdbg, loss, **kwargs):
    """``tdbg.monitor_training_step``, printing the collectives it called."""
    global _called
    _called = []
    try:
        return tdbg.monitor_training_step(loss, **kwargs)
    finally:
        called, _called = _called, None
        say(scenario, f"RANK {rank} COLLECTIVES step {kwargs.get('step')}: {','.join(called)}")


def _norms(model, info) -> dict:
    """The debugger's gradient norms (global, per module) and the same from the whole gradients."""
    whole = {name: p.grad.full_tensor().norm().item() for name, p in model.named_parameters()}
    modules = {m: sum(v**2 for k, v in whole.items() if k.rpartition(".")[0] == m) ** 0.5 for m in ("0", "2")}
    return {
        "measured": info["grad_norm"],
        "reference": sum(v**2 for v in whole.values()) ** 0.5,
        "measured_modules": info["module_grad_norms"],
        "reference_modules": modules,
    }


def say(scenario: str, line: str) -> None:
    """One line in ONE write: the ranks share the launcher's stdout, and print() writes the text and
    its newline separately when Python runs unbuffered (PYTHONUNBUFFERED=1), so lines interleave."""
    sys.stdout.write(f"{scenario}: {line}\n")
    sys.stdout.flush()


@contextlib.contextmanager
def _fail_at(step_box, rank, owner, name, at=3):
    """Make ``owner.name`` raise on rank 1 while ``step_box[0] == at``; restored on exit."""
    original = getattr(owner, name)

    def failing(*args, **kwargs):
        if rank == 1 and step_box[0] == at:
            raise RuntimeError(f"planted failure in {name}")
        return original(*args, **kwargs)

    setattr(owner, name, failing)
    try:
        yield
    finally:
        setattr(owner, name, original)


_FINETUNES = {"finetune_nan_loss_rank1": (7, "nan-loss-rank1@5"), "finetune_lr_jump10": (18, "lr-jump@10")}
"""The finetune scenarios: their steps and planted fault."""


def finetune(output_dir: str, scenario: str) -> None:
    from diffusion_debug.jobs.finetune import FinetuneOptions, Injection, run_finetune

    steps, fault = _FINETUNES[scenario]
    options = FinetuneOptions(
        steps=steps, cpu=True, injections=[Injection.parse(fault)], config=DebugConfig(output_dir=output_dir)
    )
    summary = run_finetune(options)
    say(scenario, f"FINETUNE DONE {summary.get('run_dir', '')}")


PLAIN = {"plain_launch_script": ("--steps", "3", "--accumulate", "2")}
"""The plain runs of launch_script.py: its arguments (test_launch.py's clean launch's), then ``--weights``."""
SCRIPT = Path(__file__).resolve().parents[1] / "jobs" / "launch_script.py"


def run_plain_script(output_dir: str, scenario: str) -> None:
    """launch_script.py with no debugger, as ``python SCRIPT ARGS`` runs it in a launched process (its
    folder first on ``sys.path``; ACCELERATE_USE_CPU=true, as its plain launch says, where no scenario
    made the process's Accelerator before), its final weights saved as ``<output_dir>/plain.pt``."""
    os.makedirs(output_dir, exist_ok=True)
    os.environ["ACCELERATE_USE_CPU"] = "true"
    argv, path = sys.argv, list(sys.path)
    sys.argv = [str(SCRIPT), *PLAIN[scenario], "--weights", os.path.join(output_dir, "plain.pt")]
    sys.path[:0] = [str(SCRIPT.parent)]
    try:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = argv, path
    say(scenario, "PLAIN DONE")


NAN_AT_12 = ("--steps", "14", "--nan-grad-at", "12")
ZERO, ZERO2 = {"DS_ACCELERATOR": "cpu"}, ("--nan-grad-at", "24", "--stage", "2")
OOM_AT_0 = ("--steps", "1", "--oom-at", "0")
ACCELERATE_DEEPSPEED = {
    "ACCELERATE_USE_DEEPSPEED": "true",
    "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(
        Path(__file__).resolve().parents[1] / "jobs" / "launch_deepspeed_config.json"
    ),
    "ACCELERATE_MIXED_PRECISION": "no",
}
"""What ``accelerate launch --use_deepspeed --deepspeed_config_file launch_deepspeed_config.json --mixed_precision no``
sets in its processes' environment (test_launch_deepspeed.py's own launch)."""
LAUNCHED = {
    "launched_ddp_nan12": ("launch_torch_script.py", ("--ddp", *NAN_AT_12), {}),
    "launched_fsdp2_nan0": (
        "launch_torch_script.py",
        ("--steps", "1", "--nan-grad-at", "0", "--autograd-backward"),
        {"DIFFUSION_DEBUG_NO_HTML": "1"},  # launch_end.NO_HTML: the test reads no page
    ),
    "launched_zero2_nan24": ("launch_zero_script.py", ("--steps", "14", "--accumulation", "2", *ZERO2), ZERO),
    "launched_zero3_nan12": ("launch_zero_script.py", (*NAN_AT_12, "--stage", "3"), ZERO),
    "plain_zero3_script": ("launch_zero_script.py", (*NAN_AT_12, "--stage", "3"), ZERO),  # no debugger
    # out of memory in step 0's forward, on both ranks (the scripts raise it): last of the engines' runs
    "launched_fsdp2_oom0": ("launch_torch_script.py", OOM_AT_0, {"DIFFUSION_DEBUG_NO_HTML": "1"}),
    "launched_zero3_oom0": ("launch_zero_script.py", OOM_AT_0, {**ZERO, "DIFFUSION_DEBUG_NO_HTML": "1"}),
    # test_launch_deepspeed.py's: Accelerate's DeepSpeed plugin (ZeRO-2), out of memory in step 0's forward
    "launched_accelerate_zero2_oom0": (
        "launch_deepspeed_script.py",
        OOM_AT_0,
        {**ZERO, **ACCELERATE_DEEPSPEED, "DIFFUSION_DEBUG_NO_HTML": "1"},
    ),
    # test_launch.py's: an Accelerate script, as `launch --cpu` runs it; its end_training keeps the group
    "launched_accelerate_nan0": (
        "launch_script.py",
        ("--steps", "1", "--nan-grad-at", "0"),
        {"DIFFUSION_DEBUG_NO_HTML": "1", "ACCELERATE_USE_CPU": "true"},
    ),
}
"""The scenarios run by :func:`run_launched` (test_launch_engines.py's, and one of test_launch.py's): a
script of tests/jobs, its arguments and what its ``diffusion-debug launch`` set in its environment (besides
``COLUMNS=160``); one named ``plain_*`` runs with no debugger, as a plain launch would run it."""


def run_launched(output_dir: str, scenario: str, script: Path, script_args: tuple, env: dict) -> None:
    """``script`` as a process of ``diffusion-debug launch --debug-output-dir <output_dir>/runs`` runs it
    (:func:`diffusion_debug.jobs.launched.main`: the launch's seams installed, the script run as
    ``__main__``, the run saved at its end), in this process: the imports and process start of a launch
    paid once for several. Its stdout and stderr (the debugger's log, the terminal report, launch's lines)
    go to ``<output_dir>/rank<r>.stdout`` and ``.stderr``, and the rank prints ``RANK r EXIT <code>`` (0: as
    a launched process that ended well). The script's ``init_process_group`` and ``destroy_process_group``
    find this launch's group and keep it (a process can make its default group once), and what it changes
    of ``sys.argv``, ``sys.path`` and the environment is undone, and ``torch.nn.functional.linear``: a ZeRO-3
    ``deepspeed.initialize`` leaves DeepSpeed's ``zero3_linear_wrap`` there for the process, not bitwise F.linear.
    A script under Accelerate's DeepSpeed plugin (``ACCELERATE_USE_DEEPSPEED`` in ``env``) makes its Accelerator
    from a state none of this process's earlier Accelerators made (:func:`_fresh_accelerate_state`)."""
    from diffusion_debug.jobs.launch import ENVIRONMENT
    from diffusion_debug.jobs.launched import main as launched

    rank = int(os.environ["RANK"])
    os.makedirs(output_dir, exist_ok=True)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    settings = {ENVIRONMENT: json.dumps({"output_dir": os.path.abspath(os.path.join(output_dir, "runs"))})}
    environ, argv, path = dict(os.environ), sys.argv, list(sys.path)
    group = dist.init_process_group, dist.destroy_process_group
    linear = torch.nn.functional.linear
    shared = _fresh_accelerate_state() if "ACCELERATE_USE_DEEPSPEED" in env else []
    os.environ.update({**settings, "COLUMNS": "160", **env})
    dist.init_process_group = dist.destroy_process_group = lambda *args, **kwargs: None
    code: object = 0
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with open(os.path.join(output_dir, f"rank{rank}.stdout"), "wb") as out:
            with open(os.path.join(output_dir, f"rank{rank}.stderr"), "wb") as err:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                try:
                    if scenario.startswith("plain_"):  # as `python SCRIPT ARGS` runs it
                        sys.argv, sys.path[0] = [str(script), *script_args], str(script.parent)
                        runpy.run_path(str(script), run_name="__main__")
                    else:
                        launched([str(script), *script_args])
                except SystemExit as exit:
                    code = exit.code
                except BaseException as error:  # as a launched process's traceback, then exit status 1
                    traceback.print_exc()
                    code = f"1 {type(error).__name__}"
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os.dup2(saved[0], 1)
                    os.dup2(saved[1], 2)
    finally:
        os.close(saved[0])
        os.close(saved[1])
        dist.init_process_group, dist.destroy_process_group = group
        torch.nn.functional.linear = linear
        for state, kept in shared:  # the earlier scenarios' Accelerate state, for the later ones
            state.clear()
            state.update(kept)
        sys.argv, sys.path[:] = argv, path
        os.environ.clear()
        os.environ.update(environ)
    gc.collect()  # the script's models and optimizers, held in cycles, gone before the next scenario
    dist.barrier()
    say(scenario, f"RANK {rank} EXIT {code if code is not None else 0}")


def _fresh_accelerate_state() -> list[tuple[dict, dict]]:
    """Empty Accelerate's shared states (``PartialState``'s, ``AcceleratorState``'s, ``GradientState``'s): the
    next Accelerator reads its plugin from the environment, as in a new process (an Accelerator made already
    fixes its distributed type, here MULTI_CPU, for the process). Returns each state's dict (kept itself: the
    earlier Accelerators share it) with a copy of what it held, to put back."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    shared = [
        (state._shared_state, dict(state._shared_state)) for state in (PartialState, AcceleratorState, GradientState)
    ]
    for state, _ in shared:
        state.clear()
    return shared


@contextlib.contextmanager
def group_kept():
    """A finetune job's ``accelerator.end_training()`` destroys the process group: kept for the next
    job of the launch (the last job's end_training destroys it)."""
    from accelerate.state import PartialState

    original = PartialState.destroy_process_group
    PartialState.destroy_process_group = lambda self, group=None: None
    try:
        yield
    finally:
        PartialState.destroy_process_group = original


def finish(accelerator: Accelerator, tdbg: TrainingDebugger, scenario: str) -> None:
    """The main process saves the run (no HTML), every rank closes its debugger and prints its step count."""
    if accelerator.is_main_process:
        say(scenario, f"RUN_DIR {tdbg.report().save(html=False)}")
    accelerator.wait_for_everyone()
    tdbg.close()
    say(scenario, f"RANK {accelerator.process_index} DONE {tdbg.get_summary()['total_steps']}")


def models_and_samples(accelerator: Accelerator, output_dir: str, scenario: str) -> None:
    rank, nan = accelerator.process_index, float("nan")
    torch.manual_seed(0)
    unet = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    text_encoder = torch.nn.Sequential(torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD([*unet.parameters(), *text_encoder.parameters()], lr=0.01)
    unet, text_encoder, optimizer = accelerator.prepare(unet, text_encoder, optimizer)
    models = {"unet": unet, "text_encoder": text_encoder}
    tdbg = TrainingDebugger(models, accelerator=accelerator, config=DebugConfig(output_dir=output_dir))
    generator = torch.Generator().manual_seed(100 + rank)
    timesteps = torch.tensor([10, 400, 700, 999])
    for step in range(6):
        x = torch.randn(4, 4, generator=generator)
        weights = torch.tensor([1.0, 1.0, 1.0, nan if (step, rank) == (2, 1) else 1.0])
        per_sample = ((unet(text_encoder(x)) - x.sum(1, keepdim=True)) ** 2).squeeze(1) * weights
        accelerator.backward(per_sample.mean())
        if (step, rank) == (4, 1):  # after DDP's all-reduce: rank 1's own
            accelerator.unwrap_model(text_encoder)[0].weight.grad[0, 0] = nan
        ids = [f"rank{rank}-sample{i}" for i in range(4)]
        kwargs = dict(timesteps=timesteps, per_sample_loss=per_sample, loss_weights=weights, sample_ids=ids)
        tdbg.monitor_training_step(per_sample.mean(), optimizer=optimizer, step=step, **kwargs)
        if step not in (2, 4):
            optimizer.step()
        optimizer.zero_grad()
    finish(accelerator, tdbg, scenario)


def closure_with_scaler(accelerator: Accelerator, output_dir: str, scenario: str) -> None:
    rank = accelerator.process_index
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    tdbg = TrainingDebugger(model, accelerator=accelerator, config=DebugConfig(output_dir=output_dir))
    generator = torch.Generator().manual_seed(100 + rank)
    for step in range(4):
        x = torch.randn(8, 4, generator=generator)
        if (step, rank) == (1, 1):
            x[0, 0] = float("inf")

        def closure():
            return model(x).pow(2).mean()

        loss = closure()
        scaler.scale(loss).backward()
        monitored(scenario, rank, tdbg, loss, optimizer=optimizer, step=step, scaler=scaler, closure=closure)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        if (step, rank) == (1, 0):  # the main process alone reports mid-run: step 1's skip, before step 2 reads it
            tdbg.report()
    finish(accelerator, tdbg, scenario)


SCALER_NAN_STEP = {
    "scaler_not_passed_ddp": 6,
    "scaler_not_passed_nan0_rank1": 0,
    "scaler_not_passed_nan0_record": 0,
    "scaler_not_passed_finite_ddp": None,
    "scaler_not_passed_fails0_record": -1,
}
"""scaler_not_passed_*: the step whose batch holds a NaN on rank 1 (its loss NaN); None: none (fp32, 3 steps); -1:
none in fp16 (``*_fails0_*``: rank 1's gradient norms raise at step 0 instead, a debugger failure on that rank)."""


def scaler_not_passed(output_dir: str, scenario: str) -> None:
    """A plain torch DDP loop (no Accelerate: ``DistributedDataParallel`` and a debugger given no accelerator) in fp16
    autocast, its GradScaler (65536) not passed, policy ``raise`` (``record`` for ``*_record``), 8 steps; rank 1's
    batch holds a NaN at :data:`SCALER_NAN_STEP`. Per monitored step each rank prints the norm measured and the
    naive unscaled reference (the all-reduced gradients over the scale) and the scale: ``RANK r NORMS step s:
    <json>``. Where no step holds a NaN: fp32 (the scaled gradients finite), the batch unscaled, 3 steps,
    ``max_grad_norm=100``."""
    rank = dist.get_rank()
    fp16 = SCALER_NAN_STEP[scenario] is not None
    gc.collect()  # the earlier scenarios' scalers gone (the search walks the heap)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0)
    policy = "record" if scenario.endswith("_record") else "raise"
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=output_dir, policy=policy))
    generator = torch.Generator().manual_seed(1 + rank)
    planted, step_box, replays = contextlib.ExitStack(), [None], []
    if "_fails0_" in scenario:  # rank 1's measurement fails at step 0, which rank 0 holds (it looks scaled)
        planted.enter_context(_fail_at(step_box, rank, gradients, "grad_norms", at=0))
    try:
        for step in range(8 if fp16 else 3):
            step_box[0] = step
            x = torch.randn(16, 8, generator=generator) * (4 if fp16 else 1)
            if (step, rank) == (SCALER_NAN_STEP[scenario], 1):
                x[2, 3] = float("nan")
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                loss = (model(x) - 3).square().mean()
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scale = float(scaler.get_scale())
            reference = sum(float((p.grad.double() / scale).square().sum()) for p in model.parameters()) ** 0.5
            try:
                clip = {} if fp16 else {"max_grad_norm": 100.0}
                if "_fails0_" in scenario:  # a step that looks scaled is no replay's: never called

                    def closure(x=x, step=step):
                        replays.append(step)
                        with torch.autocast("cpu", dtype=torch.float16):
                            return (model(x) - 3).square().mean()

                    clip["closure"] = closure
                info = monitored(scenario, rank, tdbg, loss, optimizer=optimizer, step=step, **clip)
            except DiffusionDebugError as error:
                kind, cause_rank = error.anomaly.kind, error.anomaly.rank
                say(scenario, f"RANK {rank} RAISED at step {step}: {kind} rank {cause_rank}")
                break
            norms = {"measured": info["grad_norm"], "reference": reference, "scale": scale}
            say(scenario, f"RANK {rank} NORMS step {step}: {json.dumps(norms)}")
            scaler.step(optimizer)
            scaler.update()
    finally:
        planted.close()
        if "_fails0_" in scenario:
            say(scenario, f"RANK {rank} REPLAYS {replays}")
        dist.barrier()
        if rank == 0:
            say(scenario, f"RUN_DIR {tdbg.report().save(html=False)}")
        dist.barrier()
        tdbg.close()
        summary = tdbg.get_summary()
        say(scenario, f"RANK {rank} SUMMARY {json.dumps({k: v for k, v in summary.items() if k != 'anomaly_counts'})}")


class _Branches(torch.nn.Module):
    """``b(tanh(a(x)))``, plus ``unused(tanh(a(x)))`` where ``use``: DDP finds ``unused`` unused elsewhere."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.unused = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1), torch.nn.Linear(8, 1)

    def forward(self, x, use=False):
        hidden = torch.tanh(self.a(x))
        return self.b(hidden) + (self.unused(hidden) if use else 0)


def accumulate_unused(accelerator: Accelerator, output_dir: str, scenario: str) -> None:
    from accelerate.utils import DistributedDataParallelKwargs

    rank, lr = accelerator.process_index, 0.1
    torch.manual_seed(0)
    model = _Branches()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    handler, accumulation = accelerator.ddp_handler, accelerator.gradient_accumulation_steps
    accelerator.ddp_handler = DistributedDataParallelKwargs(find_unused_parameters=True)
    accelerator.gradient_accumulation_steps, accelerator.step = 2, 0  # calls 1, 3, 5, 7 step
    try:
        model, optimizer = accelerator.prepare(model, optimizer)
    finally:
        accelerator.ddp_handler = handler  # the launch's next scenarios prepare as before
    tdbg = TrainingDebugger(model, accelerator=accelerator, config=DebugConfig(output_dir=output_dir))
    generator = torch.Generator().manual_seed(100 + rank)
    weights = [p.detach().clone() for p in model.parameters()]
    for call in range(8):
        with accelerator.accumulate(model):
            x = torch.randn(8, 4, generator=generator)
            loss = (model(x, use=call == 3) - x.sum(1, keepdim=True)).pow(2).mean()
            accelerator.backward(loss)
            info = tdbg.monitor_training_step(loss, optimizer=optimizer, step=call)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            now = [p.detach().clone() for p in model.parameters()]
            applied = sum(float((a - b).double().square().sum()) for a, b in zip(now, weights)) ** 0.5
            weights = now
            counted = tdbg.get_summary()["total_steps"]
            row = {"measured": info["grad_norm"], "lr_times": lr * info["grad_norm"], "applied": applied}
            say(scenario, f"RANK {rank} UPDATE call {call}: {json.dumps({**row, 'steps': counted})}")
    accelerator.gradient_accumulation_steps = accumulation
    finish(accelerator, tdbg, scenario)


ACCUMULATE_PLANT_CALL = 2
"""accumulate_nan_*: the call (a micro-step without the gradient all-reduce, the first of optimizer step 1) that
plants rank 1's NaN."""


def accumulate_nan(accelerator: Accelerator, output_dir: str, scenario: str) -> None:
    """DDP under ``accelerator.accumulate``, two micro-steps a step, 6 calls, ``step=`` the optimizer step (as
    the diffusers scripts count it, ``call // 2``); rank 1's NaN planted at call :data:`ACCUMULATE_PLANT_CALL`, a
    micro-step DDP does not all-reduce (``no_sync``): in its batch (``accumulate_nan_batch_rank1``, given as
    ``inputs=``) or made in its backward by a tensor hook on ``2.weight`` (``accumulate_nan_grad_rank1``)."""
    rank = accelerator.process_index
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    accumulation = accelerator.gradient_accumulation_steps
    accelerator.gradient_accumulation_steps, accelerator.step = 2, 0  # calls 1, 3, 5 step
    model, optimizer = accelerator.prepare(model, optimizer)
    tdbg = TrainingDebugger(model, accelerator=accelerator, config=DebugConfig(output_dir=output_dir))
    generator = torch.Generator().manual_seed(100 + rank)
    at = [None]
    if scenario == "accumulate_nan_grad_rank1":
        accelerator.unwrap_model(model)[2].weight.register_hook(
            lambda g: g * float("nan") if (rank, at[0]) == (1, ACCUMULATE_PLANT_CALL) else g
        )
    for call in range(6):
        at[0] = call
        with accelerator.accumulate(model):
            x = torch.randn(8, 4, generator=generator)
            if scenario == "accumulate_nan_batch_rank1" and (rank, call) == (1, ACCUMULATE_PLANT_CALL):
                x[3, 1] = float("nan")
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            accelerator.backward(loss)
            tdbg.monitor_training_step(loss, optimizer=optimizer, step=call // 2, inputs=x)
            optimizer.step()
            optimizer.zero_grad()
    accelerator.gradient_accumulation_steps = accumulation
    finish(accelerator, tdbg, scenario)


def run_scenario(accelerator: Accelerator, output_dir: str, scenario: str) -> None:
    if scenario.startswith("accumulate_nan_"):
        return accumulate_nan(accelerator, output_dir, scenario)
    if scenario == "accumulate_unused":
        return accumulate_unused(accelerator, output_dir, scenario)
    if scenario == "models_and_samples_rank1":
        return models_and_samples(accelerator, output_dir, scenario)
    if scenario == "closure_scaler_rank1":
        return closure_with_scaler(accelerator, output_dir, scenario)
    if scenario in SCALER_NAN_STEP:
        return scaler_not_passed(output_dir, scenario)
    rank = accelerator.process_index
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    if scenario == "fsdp2":
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch 2.5, the floor: FSDP2 is not yet public
            from torch.distributed._composable.fsdp import fully_shard

        for module in (model[0], model[2], model):
            fully_shard(module)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        model, optimizer = accelerator.prepare(model, optimizer)
    policy = "raise" if scenario in ("raise", "record_fails_rank1_raise") else "record"
    config = DebugConfig(
        output_dir=output_dir,
        policy=policy,
        rank_check_every=2 if scenario == "desync" else 100,
        history_size=10 if scenario == "clean_history10" else 1000,
    )
    if scenario == "fsdp2":  # its per-module norms are compared with the whole gradients'
        config = config.replace(per_module_grad_norms=True)
    tdbg = TrainingDebugger(model, accelerator=accelerator, config=config)
    step_box = [None]
    if scenario == "nan_grad_rank1":  # rank 1's own gradient, before the all-reduce
        accelerator.unwrap_model(model)[2].weight.register_hook(
            lambda g: g * float("nan") if rank == 1 and step_box[0] == 12 else g
        )
    with contextlib.ExitStack() as planted:
        if scenario == "measure_fails_rank1":
            planted.enter_context(_fail_at(step_box, rank, gradients, "grad_norms"))
        if scenario in ("judge_fails_rank1", "judge_fails_quietly_rank1"):
            planted.enter_context(_fail_at(step_box, rank, gradients.ModuleNormBook, "update"))
        if scenario in ("record_fails_rank1_raise", "record_fails_rank1"):
            planted.enter_context(_fail_at(step_box, rank, tdbg.record, "add_step"))
        try:
            train(accelerator, model, optimizer, tdbg, scenario, step_box)
        finally:
            tdbg.close()


def train(accelerator, model, optimizer, tdbg, scenario, step_box) -> None:
    rank = accelerator.process_index
    generator = torch.Generator().manual_seed(100 + rank)
    nan_rank = 5 if scenario == "nan_rank5" else 1
    for step in range({"clean_history10": 30, "nan_grad_rank1": 14}.get(scenario, 6)):
        step_box[0] = step
        x = torch.randn(8, 4, generator=generator)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        if (
            scenario in ("nan_rank1", "raise", "judge_fails_rank1", "record_fails_rank1_raise", "nan_rank5")
            and step == 3
            and rank == nan_rank
        ):
            loss = loss * float("nan")
        accelerator.backward(loss)
        try:
            info = monitored(scenario, rank, tdbg, loss, optimizer=optimizer, step=step)
            if scenario == "fsdp2":
                say(scenario, f"RANK {rank} NORMS step {step}: {json.dumps(_norms(model, info))}")
        except DiffusionDebugError as error:
            kind, cause_rank = error.anomaly.kind, error.anomaly.rank
            say(scenario, f"RANK {rank} RAISED at step {step}: {kind} rank {cause_rank} run_dir={error.run_dir}")
            accelerator.wait_for_everyone()
            return
        optimizer.step()
        optimizer.zero_grad()
        if scenario == "desync" and step == 2 and rank == 1:
            with torch.no_grad():
                accelerator.unwrap_model(model)[2].bias.add_(1.0)
    if accelerator.is_main_process:
        say(scenario, f"RUN_DIR {tdbg.report().save(html=scenario in _HTML)}")
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:  # after main: a non-main save must not overwrite main's summary
        say(scenario, f"RANK {rank} SAVED {tdbg.report().save()}")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:  # every rank's rows written: the live report's steps and rank_steps
        report = tdbg.report()
        live = [[[s["step"], s.get("rank")] for s in rows] for rows in (report.steps, report.rank_steps)]
        say(scenario, f"LIVE STEPS {json.dumps(live)}")
    summary = tdbg.get_summary()
    say(scenario, f"RANK {rank} DONE {summary['total_steps']}")
    say(scenario, f"RANK {rank} SUMMARY {json.dumps({k: v for k, v in summary.items() if k != 'anomaly_counts'})}")
    accelerator.wait_for_everyone()


def main() -> None:
    output_dir, scenarios = sys.argv[1], sys.argv[2:]
    # one start-up for all: the scenarios on one Accelerator, finetunes, launched scripts, then the plain runs: their
    # weights check that no launched script leaves what changes a later run (ZeRO-3's F.linear: run_launched's reset)
    own = [scenario for scenario in scenarios if scenario in _FINETUNES or scenario in LAUNCHED or scenario in PLAIN]
    others = [scenario for scenario in scenarios if scenario not in own]
    if others:
        accelerator = Accelerator(cpu=True)
        count_collectives()
        for scenario in others:
            run_scenario(accelerator, os.path.join(output_dir, scenario), scenario)
            accelerator.wait_for_everyone()
    for scenario in sorted(own, key=lambda s: (s in LAUNCHED) + 2 * (s in PLAIN)):
        directory = os.path.join(output_dir, scenario)
        if scenario in LAUNCHED:
            script, script_args, env = LAUNCHED[scenario]
            run_launched(directory, scenario, SCRIPT.parent / script, script_args, env)
        else:
            with group_kept():  # its end_training keeps the group for the next job
                (run_plain_script if scenario in PLAIN else finetune)(directory, scenario)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
