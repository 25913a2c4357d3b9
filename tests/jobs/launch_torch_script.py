"""A tiny diffusers UNet fine-tune with a plain torch AdamW, gloo, on either engine of torch's own:
FSDP2 (``fully_shard`` on each block and the root; the default) or, with --ddp, DDP: a script that
knows nothing of diffusion-debug nor of Accelerate, started by ``accelerate launch`` as a plain
process launcher (RANK, WORLD_SIZE, MASTER_ADDR set by it; run by test_launch_engines.py, 2 CPU
processes). --nan-grad-at S: at step S rank 1's own gradient of ``conv_in`` turns NaN during
backward, before the reduction gives it to rank 0 (launch_unet_loop.py). --autograd-backward:
step 0's backward is ``torch.autograd.backward([loss])``, the later ones ``loss.backward()``.
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

parser = argparse.ArgumentParser()
parser.add_argument("--ddp", action="store_true")
parser.add_argument("--autograd-backward", action="store_true")
args = arguments(parser)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
unet = sharded_unet()
if args.ddp:
    model = torch.nn.parallel.DistributedDataParallel(unet)
else:
    for block in (*unet.down_blocks, unet.mid_block, *unet.up_blocks):
        fully_shard(block)
    fully_shard(unet)
    model = unet
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
backwards = [0]


def backward_and_step(loss):
    if args.autograd_backward and backwards[0] == 0:
        torch.autograd.backward([loss])
    else:
        loss.backward()
    backwards[0] += 1
    optimizer.step()
    optimizer.zero_grad()


train(model, unet.conv_in, rank, args, backward_and_step)
dist.barrier()
sys.stdout.write(f"RANK {rank} DONE\n")  # one write: the ranks share the stdout
sys.stdout.flush()
dist.destroy_process_group()
