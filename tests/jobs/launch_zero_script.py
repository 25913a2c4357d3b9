"""A tiny diffusers UNet fine-tune on a raw DeepSpeed engine (``deepspeed.initialize``, ZeRO stage
--stage, 3 by default; ``engine.backward(loss); engine.step()``), a script that knows nothing of
diffusion-debug nor of Accelerate, started by ``accelerate launch`` as a plain process launcher
(RANK, WORLD_SIZE, MASTER_ADDR set by it; run by test_launch_engines.py, 2 CPU processes, with
DS_ACCELERATOR=cpu); each rank prints its losses at the end. --nan-grad-at S: at step S a backward
pre-hook on ``conv_in`` makes rank 1's own gradient NaN during backward, before ZeRO reduces it.
Prints NO_DEEPSPEED and exits 0 where DeepSpeed does not import.
"""

import argparse
import sys

import torch

from diffusion_debug.testing.training_unets import sharded_unet

try:
    import deepspeed
except Exception as error:  # the test skips, saying why
    print(f"NO_DEEPSPEED {error!r}".replace("\n", " "), flush=True)
    sys.exit(0)

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--stage", type=int, default=3)
parser.add_argument("--nan-grad-at", type=int)
args = parser.parse_args()

deepspeed.ops.__compatible_ops__ = {}  # DeepSpeed's CPU collectives compile on first use (minutes): gloo's serve
deepspeed.init_distributed(dist_backend="gloo")
rank = torch.distributed.get_rank()
torch.manual_seed(0)
unet = sharded_unet()
optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
config = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": args.stage},
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 10**6,
}
engine, optimizer, _, _ = deepspeed.initialize(model=unet, optimizer=optimizer, config=config)
at = [None]
if args.nan_grad_at is not None and rank == 1:
    engine.module.conv_in.register_full_backward_pre_hook(
        lambda module, grad_output: (grad_output[0] * float("nan"),) if at[0] == args.nan_grad_at else None
    )
generator = torch.Generator().manual_seed(100 + rank)
losses = []  # each step's, printed at the end (exact, as float.hex)
for step in range(args.steps):
    at[0] = step
    latents = torch.randn(2, 4, 8, 8, generator=generator)
    noise = torch.randn(2, 4, 8, 8, generator=generator)
    text = torch.randn(2, 3, 32, generator=generator)
    timesteps = torch.randint(0, 1000, (2,), generator=generator)
    prediction = engine(latents + noise, timesteps, encoder_hidden_states=text).sample
    loss = torch.nn.functional.mse_loss(prediction, noise)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item().hex())
torch.distributed.barrier()
# one write each: the ranks share the stdout
sys.stdout.write(f"RANK {rank} LOSSES {','.join(losses)}\nRANK {rank} DONE skipped={engine.skipped_steps}\n")
sys.stdout.flush()
