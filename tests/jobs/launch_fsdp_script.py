"""A tiny diffusers UNet fine-tune sharded with FSDP2 (``fully_shard`` on each block and the root), a
plain torch AdamW, gloo: a script that knows nothing of diffusion-debug nor of Accelerate, started by
``accelerate launch`` as a plain process launcher (RANK, WORLD_SIZE, MASTER_ADDR set by it; run by
test_launch_engines.py, 2 CPU processes). --nan-grad-at S: at step S rank 1's own gradient of
``conv_in`` turns NaN during backward, before FSDP2's reduce-scatter gives it to rank 0
(launch_unet_loop.py).
"""

import argparse
import sys

import torch
import torch.distributed as dist
from launch_unet_loop import arguments, train

from diffusion_debug.testing.training_unets import sharded_unet

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch 2.5, the floor: FSDP2 is not yet public
    from torch.distributed._composable.fsdp import fully_shard

args = arguments(argparse.ArgumentParser())
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
unet = sharded_unet()
for block in (*unet.down_blocks, unet.mid_block, *unet.up_blocks):
    fully_shard(block)
fully_shard(unet)
optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)


def backward_and_step(loss):
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


train(unet, unet.conv_in, rank, args, backward_and_step)
dist.barrier()
sys.stdout.write(f"RANK {rank} DONE\n")  # one write: the ranks share the stdout
sys.stdout.flush()
dist.destroy_process_group()
