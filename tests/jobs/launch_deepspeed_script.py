"""A diffusers-style UNet fine-tune under Accelerate's DeepSpeed plugin (ZeRO-2, from `accelerate
launch --use_deepspeed --deepspeed_config_file`) that knows nothing of diffusion-debug: what
`diffusion-debug launch` must watch without an edit (test_launch_deepspeed.py, 2 CPU processes).
Two lines are there only because it runs on CPU: the process group's backend, gloo, said to
Accelerate (else it starts DeepSpeed's group without knowing its size, and each process believes
it trains alone), and DeepSpeed's compiled CPU collectives left out (building them takes minutes).
--steps N; --nan-grad-at S: at optimizer step S a tensor hook makes rank 1's own gradient of one
parameter NaN during backward, before ZeRO reduces it (a parameter in rank 1's half of ZeRO's flat
partition, so that rank 1 also holds the reduced NaN). Each rank prints ``RANK r STEP s LOSS l
GRAD_NORM x`` for every step: its loss, and DeepSpeed's own norm of the step's gradients (what
clip_grad_norm_ returns under DeepSpeed). --oom-at S: from step S on the UNet's ``conv_in`` raises
``torch.OutOfMemoryError`` on every rank as its forward begins (``plant_oom``), which the script lets go up.
"""

import argparse
import math
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from diffusers import DDPMScheduler

from diffusion_debug.testing.training_unets import launch_unet

try:
    import deepspeed
except Exception as error:  # the test skips, saying why
    print(f"NO_DEEPSPEED {error!r}".replace("\n", " "), flush=True)
    sys.exit(0)


def say(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write: the ranks share the launcher's stdout
    sys.stdout.flush()


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--nan-grad-at", type=int)
parser.add_argument("--oom-at", type=int)
args = parser.parse_args()

deepspeed.ops.__compatible_ops__ = {}  # CPU only: gloo's collectives, not DeepSpeed's compiled ones
accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])  # CPU only: gloo
torch.manual_seed(0)
unet = launch_unet()
noise_scheduler = DDPMScheduler(num_train_timesteps=1000)
optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
unet, optimizer = accelerator.prepare(unet, optimizer)
rank = accelerator.process_index
generator = torch.Generator().manual_seed(1 + rank)
at = [None]
if rank == 1:  # the user's bug: rank 1's own gradient goes bad in backward (an fp16 overflow, a bad sample)
    weight = accelerator.unwrap_model(unet).up_blocks[1].resnets[0].conv2.weight
    weight.register_hook(lambda grad: grad * math.nan if at[0] == args.nan_grad_at else grad)
if args.oom_at is not None:  # the user's failure: step S's forward runs out of memory on every rank
    from diffusion_debug.testing import plant_oom

    plant_oom(accelerator.unwrap_model(unet).conv_in, from_call=args.oom_at)

for step in range(args.steps):
    at[0] = step
    latents = torch.randn(2, 4, 8, 8, generator=generator)
    noise = torch.randn(latents.shape, generator=generator)
    timesteps = torch.randint(0, 1000, (2,), generator=generator)
    text = torch.randn(2, 4, 16, generator=generator)
    noisy = noise_scheduler.add_noise(latents, noise, timesteps)
    prediction = unet(noisy, timesteps, text).sample
    loss = F.mse_loss(prediction.float(), noise.float())
    accelerator.backward(loss)  # DeepSpeed's engine steps in here
    norm = accelerator.clip_grad_norm_(unet.parameters(), 1.0)
    say(f"RANK {rank} STEP {step} LOSS {loss.item()!r} GRAD_NORM {norm!r}")
    optimizer.step()  # a no-op under DeepSpeed
    optimizer.zero_grad()

accelerator.wait_for_everyone()
say(f"RANK {rank} DONE skipped={unet.skipped_steps}")
accelerator.end_training()
