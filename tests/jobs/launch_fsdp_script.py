"""A tiny diffusers UNet fine-tune sharded with FSDP2 (``fully_shard`` on each block and the root), a
plain torch AdamW, gloo: a script that knows nothing of diffusion-debug nor of Accelerate, started by
``accelerate launch`` as a plain process launcher (RANK, WORLD_SIZE, MASTER_ADDR set by it; run by
test_launch_engines.py, 2 CPU processes). --nan-grad-at S: at step S a backward pre-hook on
``conv_in`` makes rank 1's own gradient NaN during backward, before FSDP2's reduce-scatter gives it
to rank 0 (a tensor hook on the sharded parameter never fires).
"""

import argparse
import sys

import torch
import torch.distributed as dist

from diffusion_debug.testing.training_unets import sharded_unet

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch 2.5, the floor: FSDP2 is not yet public
    from torch.distributed._composable.fsdp import fully_shard

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--nan-grad-at", type=int)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
unet = sharded_unet()
for block in (*unet.down_blocks, unet.mid_block, *unet.up_blocks):
    fully_shard(block)
fully_shard(unet)
optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
at = [None]
if args.nan_grad_at is not None and rank == 1:
    unet.conv_in.register_full_backward_pre_hook(
        lambda module, grad_output: (grad_output[0] * float("nan"),) if at[0] == args.nan_grad_at else None
    )
generator = torch.Generator().manual_seed(100 + rank)
for step in range(args.steps):
    at[0] = step
    latents = torch.randn(2, 4, 8, 8, generator=generator)
    noise = torch.randn(2, 4, 8, 8, generator=generator)
    text = torch.randn(2, 3, 32, generator=generator)
    timesteps = torch.randint(0, 1000, (2,), generator=generator)
    prediction = unet(latents + noise, timesteps, encoder_hidden_states=text).sample
    loss = torch.nn.functional.mse_loss(prediction, noise)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
dist.barrier()
sys.stdout.write(f"RANK {rank} DONE\n")  # one write: the ranks share the stdout
sys.stdout.flush()
dist.destroy_process_group()
