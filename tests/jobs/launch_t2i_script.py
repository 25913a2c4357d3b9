"""A text-to-image fine-tune shaped like diffusers' official train_text_to_image.py, that knows
nothing of diffusion-debug: a DataLoader of {pixel_values, input_ids} prepared with the UNet and
its optimizer, a frozen CLIP text encoder and a frozen VAE moved to the device after prepare,
latents from ``vae.encode``, the text embedding from ``text_encoder(input_ids)``. Run by
test_launch.py under `diffusion-debug launch` (one CPU process), and plainly for the reference.

Its flags plant a user's bug: --nan-pixels-at S (one pixel of the batch of optimizer step S is NaN:
a broken image), --nan-token-embedding-at S (before step S the text encoder's embedding of one of
that batch's tokens becomes NaN: a broken checkpoint). --weights FILE: the final trained weights.
--textual-inversion: textual_inversion.py's shape instead: the text encoder's token embeddings are
trained (the text encoder prepared with the optimizer), the UNet frozen; --nan-forward-at S then
makes the output of its first layer's ``mlp.fc1`` NaN in step S's forward (a layer's own fault).
"""

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from diffusers import AutoencoderKL, DDPMScheduler
from transformers import CLIPTextConfig, CLIPTextModel

from diffusion_debug.testing.features import clip_name
from diffusion_debug.testing.training_unets import launch_unet

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--nan-pixels-at", type=int)
parser.add_argument("--nan-token-embedding-at", type=int)
parser.add_argument("--weights")
parser.add_argument("--textual-inversion", action="store_true")
parser.add_argument("--nan-forward-at", type=int)
args = parser.parse_args()


def main():
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=8,
        )
    )
    vae = AutoencoderKL(
        block_out_channels=(8,),
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        latent_channels=4,
        norm_num_groups=4,
        layers_per_block=1,
        sample_size=8,
    )
    unet = launch_unet()
    noise_scheduler = DDPMScheduler(num_train_timesteps=1000)
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    step_now = [None]
    if args.textual_inversion:
        unet.requires_grad_(False)
        text_encoder.get_input_embeddings().requires_grad_(True)
        fc1 = text_encoder.get_submodule(clip_name("encoder.layers.0.mlp.fc1"))
        fc1.register_forward_hook(
            lambda module, inputs, output: output * float("nan") if step_now[0] == args.nan_forward_at else None
        )

    data = torch.Generator().manual_seed(2)
    examples = [
        {
            "pixel_values": torch.rand(3, 8, 8, generator=data) * 2 - 1,
            "input_ids": torch.randint(0, 64, (8,), generator=data),
        }
        for _ in range(2 * args.steps)
    ]
    if args.nan_pixels_at is not None:
        examples[2 * args.nan_pixels_at + 1]["pixel_values"][1, 4, 5] = float("nan")
    train_dataloader = torch.utils.data.DataLoader(examples, batch_size=2, shuffle=False)
    if args.textual_inversion:
        optimizer = torch.optim.AdamW(text_encoder.get_input_embeddings().parameters(), lr=1e-4)
        text_encoder, optimizer, train_dataloader = accelerator.prepare(text_encoder, optimizer, train_dataloader)
        unet.to(accelerator.device)
    else:
        optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
        unet, optimizer, train_dataloader = accelerator.prepare(unet, optimizer, train_dataloader)
        text_encoder.to(accelerator.device)
    vae.to(accelerator.device)
    trained = text_encoder if args.textual_inversion else unet

    generator = torch.Generator().manual_seed(1)
    for step, batch in enumerate(train_dataloader):
        step_now[0] = step
        if step == args.nan_token_embedding_at:
            with torch.no_grad():
                text_encoder.get_input_embeddings().weight[batch["input_ids"][0, 3]] = float("nan")
        with accelerator.accumulate(trained):
            latents = vae.encode(batch["pixel_values"]).latent_dist.sample(generator) * vae.config.scaling_factor
            noise = torch.randn(latents.shape, generator=generator)
            timesteps = torch.randint(0, 1000, (latents.shape[0],), generator=generator)
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
            encoder_hidden_states = text_encoder(batch["input_ids"], return_dict=False)[0]
            model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
            loss = F.mse_loss(model_pred.float(), noise.float(), reduction="mean")
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(trained.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()

    accelerator.wait_for_everyone()
    if args.weights and accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(trained).state_dict(), args.weights)
    accelerator.end_training()
    print("done")


if __name__ == "__main__":
    main()
