"""A diffusers-style UNet fine-tune that knows nothing of diffusion-debug, nor of running on a CPU
(a plain ``Accelerator()``): what `diffusion-debug launch` must watch without an edit (run by
test_launch.py under `accelerate launch`, 2 CPU processes, which need ACCELERATE_USE_CPU=true).
Its flags plant a user's bug: --nan-grad-at S (a tensor hook makes rank 1's own gradient of one
parameter NaN during backward at optimizer step S, before DDP's all-reduce gives it to rank 0, as an
fp16 overflow or a bad sample on one rank does), --lr-jump-at S (the learning rate x1e4
from optimizer step S on). --weights FILE: the main process saves the final weights there.
--accumulate N: gradient accumulation over N micro-steps (--steps counts optimizer steps).
"""

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from diffusers import DDPMScheduler

from diffusion_debug.testing.training_unets import launch_unet

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--nan-grad-at", type=int)
parser.add_argument("--lr-jump-at", type=int)
parser.add_argument("--weights")
parser.add_argument("--accumulate", type=int, default=1)
args = parser.parse_args()

accelerator = Accelerator(gradient_accumulation_steps=args.accumulate)  # as on a GPU: CPU processes are the launcher's
torch.manual_seed(0)
unet = launch_unet()
noise_scheduler = DDPMScheduler(num_train_timesteps=1000)
optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
unet, optimizer = accelerator.prepare(unet, optimizer)
generator = torch.Generator().manual_seed(1 + accelerator.process_index)
at = [None]  # the micro-step backward is in
if args.nan_grad_at is not None and accelerator.process_index == 1 and args.accumulate == 1:
    accelerator.unwrap_model(unet).up_blocks[0].resnets[0].conv1.weight.register_hook(
        lambda grad: grad * float("nan") if at[0] == args.nan_grad_at else grad
    )

for step in range(args.steps * args.accumulate):  # micro-steps; an optimizer step is every --accumulate
    at[0] = step
    if step == args.lr_jump_at and args.accumulate == 1:
        for group in optimizer.param_groups:
            group["lr"] *= 1e4
    latents = torch.randn(2, 4, 8, 8, generator=generator)
    noise = torch.randn(latents.shape, generator=generator)
    timesteps = torch.randint(0, 1000, (2,), generator=generator)
    text = torch.randn(2, 4, 16, generator=generator)
    with accelerator.accumulate(unet):
        noisy = noise_scheduler.add_noise(latents, noise, timesteps)
        prediction = unet(noisy, timesteps, text).sample
        loss = F.mse_loss(prediction.float(), noise.float())
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(unet.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

accelerator.wait_for_everyone()
if args.weights and accelerator.is_main_process:
    torch.save(accelerator.unwrap_model(unet).state_dict(), args.weights)
accelerator.end_training()
