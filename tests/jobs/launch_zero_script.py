"""A tiny diffusers UNet fine-tune on a raw DeepSpeed engine (``deepspeed.initialize``, ZeRO stage
--stage, 3 by default; ``engine.backward(loss); engine.step()`` at every micro-step, --accumulation
micro-steps a step, 1 by default), a script that knows nothing of diffusion-debug nor of Accelerate,
started by ``accelerate launch`` as a plain process launcher (RANK, WORLD_SIZE, MASTER_ADDR set by it;
run by test_launch_engines.py, 2 CPU processes, with DS_ACCELERATOR=cpu); each rank prints its
losses and the engine's step count at the end. --nan-grad-at M: at micro-step M rank 1's own
gradient of ``conv_in`` turns NaN during backward, before ZeRO reduces it (launch_unet_loop.py).
Prints NO_DEEPSPEED and exits 0 where DeepSpeed does not import.
"""

import argparse
import sys

import torch
from launch_unet_loop import arguments, train

from diffusion_debug.testing.training_unets import sharded_unet

try:
    import deepspeed
except Exception as error:  # the test skips, saying why
    print(f"NO_DEEPSPEED {error!r}".replace("\n", " "), flush=True)
    sys.exit(0)

parser = argparse.ArgumentParser()
parser.add_argument("--stage", type=int, default=3)
parser.add_argument("--accumulation", type=int, default=1)
args = arguments(parser)

deepspeed.ops.__compatible_ops__ = {}  # DeepSpeed's CPU collectives compile on first use (minutes): gloo's serve
deepspeed.init_distributed(dist_backend="gloo")
rank = torch.distributed.get_rank()
torch.manual_seed(0)
unet = sharded_unet()
optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
config = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": args.accumulation,
    "zero_optimization": {"stage": args.stage},
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 10**6,
}
engine, optimizer, _, _ = deepspeed.initialize(model=unet, optimizer=optimizer, config=config)


def backward_and_step(loss):
    engine.backward(loss)
    engine.step()


losses = train(engine, engine.module.conv_in, rank, args, backward_and_step, args.accumulation)
torch.distributed.barrier()
# one write each: the ranks share the stdout; each micro-step's loss, exact (float.hex)
sys.stdout.write(
    f"RANK {rank} LOSSES {','.join(loss.item().hex() for loss in losses)}\n"
    f"RANK {rank} DONE skipped={engine.skipped_steps} steps={engine.global_steps}\n"
)
sys.stdout.flush()
