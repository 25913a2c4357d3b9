"""A small Accelerate training loop that knows nothing of diffusion-debug, for `launch`'s single-process
tests (test_launch_safety.py, test_launch_signals.py). Flags: --steps N; --optimizers gan (a generator and a
discriminator, each with its optimizer and its own backward), text (a UNet-like model and a text encoder, two
optimizers stepping on one backward); --nan-at S (a NaN in the second model's gradient at round S); --raise-at S
(RuntimeError after round S); --forever (trains until stopped, printing "round S" with its pid after each);
--out FILE (the final weights); --no-accelerate (plain torch: loss.backward(), nothing prepared);
--late-second (one optimizer, then from round 2 a second model prepared and trained too); --own-debugger DIR
(one optimizer, the script's own TrainingDebugger writing to DIR, as README's lines add it; --nan-at S
then plants a NaN in the model's gradient at round S); --pipeline-debugger DIR (after round 2, a validation
call of a tiny SD pipeline whose UNet makes an Inf at its second step, watched by the script's own
DiffusionModelDebugger writing to DIR); --cleanup-s S (interrupted, the script's own cleanup sleeps S seconds, then
prints "cleaned up"); --count-signals FILE (the script's own graceful stop, as a checkpointing script has it:
its SIGTERM, SIGINT, SIGQUIT, SIGUSR1 and SIGUSR2 handler counts its calls and stops the loop at the first but
SIGUSR1, a checkpoint-and-continue;
each round waits 0.2 s for its data (where a signal finds it, the handler runs at once: one that came twice is
counted twice); the script then saves for --cleanup-s seconds and writes the names of the signals its handler
had to FILE, one a line); --setpgrp (the script calls os.setpgrp() first, as one that signals its own
subprocesses as a group does)."""

import argparse
import os
import signal
import time

import torch
from accelerate import Accelerator
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--optimizers", choices=("one", "gan", "text"), default="one")
parser.add_argument("--nan-at", type=int)
parser.add_argument("--raise-at", type=int)
parser.add_argument("--forever", action="store_true")
parser.add_argument("--out")
parser.add_argument("--no-accelerate", action="store_true")
parser.add_argument("--late-second", action="store_true")
parser.add_argument("--own-debugger")
parser.add_argument("--pipeline-debugger")
parser.add_argument("--cleanup-s", type=float)
parser.add_argument("--count-signals")
parser.add_argument("--setpgrp", action="store_true")
args = parser.parse_args()
if args.setpgrp:
    os.setpgrp()


class Generator(nn.Sequential):
    pass


class Discriminator(nn.Sequential):
    pass


accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
first = Generator(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
second = Discriminator(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
opt_first = torch.optim.AdamW(first.parameters(), lr=1e-3)
opt_second = torch.optim.AdamW(second.parameters(), lr=1e-3)
if args.no_accelerate:
    accelerator.backward = lambda loss: loss.backward()
elif args.optimizers == "one":
    first, opt_first = accelerator.prepare(first, opt_first)
else:
    first, second, opt_first, opt_second = accelerator.prepare(first, second, opt_first, opt_second)
generator = torch.Generator().manual_seed(1)
debugger = None
if args.own_debugger:
    from diffusion_debug import DebugConfig, TrainingDebugger

    debugger = TrainingDebugger(first, accelerator=accelerator, config=DebugConfig(output_dir=args.own_debugger))

handled: list[int] = []
if args.count_signals:
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, lambda signum, frame: handled.append(signum))

step = 0
try:
    while not (set(handled) - {signal.SIGUSR1}) and (args.forever or step < args.steps):
        x = torch.randn(4, 8, generator=generator)
        if args.optimizers == "gan":  # the discriminator's step, then the generator's, each on its own backward
            fake = first(x)
            loss_d = nn.functional.softplus(second(fake.detach())).mean() + nn.functional.softplus(-second(x)).mean()
            accelerator.backward(loss_d)
            if step == args.nan_at:
                second[2].weight.grad[0, 0] = float("nan")
            opt_second.step()
            opt_second.zero_grad()
            loss_g = nn.functional.softplus(-second(first(x))).mean()
            accelerator.backward(loss_g)
            opt_first.step()
            opt_first.zero_grad()
            second.zero_grad()
        elif args.optimizers == "text":  # one backward through both models, two optimizers step on it
            loss = nn.functional.mse_loss(second(first(x)), x[:, :1])
            accelerator.backward(loss)
            if step == args.nan_at:
                second[2].weight.grad[0, 0] = float("nan")
            opt_first.step()
            opt_second.step()
            opt_first.zero_grad()
            opt_second.zero_grad()
        else:
            loss = nn.functional.mse_loss(first(x), x)
            accelerator.backward(loss)
            if debugger is not None:
                if step == args.nan_at:
                    first[2].weight.grad[0, 0] = float("nan")
                debugger.monitor_training_step(loss, optimizer=opt_first, step=step)
            opt_first.step()
            opt_first.zero_grad()
            if args.late_second and step == 2:
                second, opt_second = accelerator.prepare(second, opt_second)
            if args.late_second and step >= 2:
                accelerator.backward(second(x).pow(2).mean())
                opt_second.step()
                opt_second.zero_grad()
        if args.pipeline_debugger and step == 2:  # validation images, the pipeline watched by the script
            from diffusion_debug import DebugConfig, DiffusionModelDebugger
            from diffusion_debug.testing import plant_nonfinite, tiny_pipeline

            pipe = tiny_pipeline("sd")
            plant_nonfinite(pipe.unet.conv_out, from_call=1)
            with DiffusionModelDebugger(pipe, DebugConfig(output_dir=args.pipeline_debugger)) as validation:
                pipe("a prompt", num_inference_steps=2, output_type="latent")
            print("validation run:", validation.report().save(html=False), flush=True)
        if args.forever:
            print(f"round {step} pid {os.getpid()}", flush=True)
        if args.count_signals:  # waiting for its data: a signal runs the handler at once, as it does mostly
            time.sleep(0.2)
        if step == args.raise_at:
            raise RuntimeError(f"the data ran out after round {step}")
        step += 1
except BaseException:  # the script's own cleanup (a checkpoint saved on SIGTERM) takes --cleanup-s seconds
    if args.cleanup_s:
        time.sleep(args.cleanup_s)
        print("cleaned up", flush=True)
    raise
if args.count_signals:  # the graceful stop's save, during which a signal sent twice would come again
    time.sleep(args.cleanup_s or 0)
    with open(args.count_signals, "w") as counted:
        counted.writelines(f"{signal.Signals(signum).name}\n" for signum in handled)
if debugger is not None:
    print("debug run:", debugger.report().save(html=False), flush=True)
if args.out:
    torch.save({**first.state_dict(), **{f"second.{k}": v for k, v in second.state_dict().items()}}, args.out)
print("trained", step, flush=True)
