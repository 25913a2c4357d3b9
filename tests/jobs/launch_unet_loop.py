"""What launch_torch_script.py and launch_zero_script.py share: their arguments, the NaN planted on
rank 1 and the data loop of a tiny UNet fine-tune (imported from the script's folder, the first
entry of ``sys.path`` under ``python SCRIPT``, ``accelerate launch`` and ``diffusion-debug launch``).
--nan-grad-at M: at micro-step M (the step itself with no accumulation) a backward pre-hook on
``conv_in`` makes rank 1's own gradient NaN during backward, before the engine reduces it (a tensor
hook on a sharded parameter never fires). --oom-at M: at micro-step M ``conv_in`` raises
``torch.OutOfMemoryError`` on every rank as its forward begins (``plant_oom``), which the script lets go up."""

import argparse

import torch


def arguments(parser: argparse.ArgumentParser) -> argparse.Namespace:
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--nan-grad-at", type=int)
    parser.add_argument("--oom-at", type=int)
    return parser.parse_args()


def train(model, conv_in, rank, args, backward_and_step, accumulation=1):
    """``args.steps`` optimizer steps of ``accumulation`` micro-steps each (``backward_and_step(loss)``
    at every micro-step); the losses, detached."""
    micro = [None]
    if args.nan_grad_at is not None and rank == 1:
        conv_in.register_full_backward_pre_hook(
            lambda module, grad_output: (grad_output[0] * float("nan"),) if micro[0] == args.nan_grad_at else None
        )
    if args.oom_at is not None:
        from diffusion_debug.testing import plant_oom

        plant_oom(conv_in, from_call=args.oom_at)
    generator = torch.Generator().manual_seed(100 + rank)
    losses = []
    for index in range(args.steps * accumulation):
        micro[0] = index
        latents = torch.randn(2, 4, 8, 8, generator=generator)
        noise = torch.randn(2, 4, 8, 8, generator=generator)
        text = torch.randn(2, 3, 32, generator=generator)
        timesteps = torch.randint(0, 1000, (2,), generator=generator)
        prediction = model(latents + noise, timesteps, encoder_hidden_states=text).sample
        loss = torch.nn.functional.mse_loss(prediction, noise)
        backward_and_step(loss)
        losses.append(loss.detach())
    return losses
