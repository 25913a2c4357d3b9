"""Fine-tune a UNet the way the diffusers training examples do, with TrainingDebugger watching.

python examples/finetune_with_accelerate.py --max-train-steps 20
accelerate launch --multi_gpu --num_processes 2 examples/finetune_with_accelerate.py --cpu
"""

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from diffusers import DDPMScheduler
from diffusers.optimization import get_scheduler

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.testing import tiny_pipeline


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-train-steps", type=int, default=50)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--mixed-precision", default="no", choices=["no", "fp16", "bf16"])
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--cpu", action="store_true", help="force CPU (two CPU processes under accelerate launch)")
    parser.add_argument("--output-dir", default="debug_output")
    args = parser.parse_args(argv)

    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        cpu=args.cpu,
    )
    pipe = tiny_pipeline("sd", seed=0)
    vae, text_encoder, tokenizer, unet = pipe.vae, pipe.text_encoder, pipe.tokenizer, pipe.unet
    noise_scheduler = DDPMScheduler.from_config(pipe.scheduler.config)
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    unet.train()

    # A small synthetic dataset: images in [-1, 1] and their captions.
    size = unet.config.sample_size * pipe.vae_scale_factor
    g = torch.Generator().manual_seed(accelerator.process_index)
    images = torch.rand(16, 3, size, size, generator=g) * 2 - 1
    captions = ["a red square", "a photo of a cat", "a blue circle", "a dog on grass"] * 4
    ids = tokenizer(
        captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt"
    ).input_ids
    loader = torch.utils.data.DataLoader(list(zip(images, ids)), batch_size=4, shuffle=True, generator=g)

    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.learning_rate)
    lr_scheduler = get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=2)
    unet, optimizer, loader, lr_scheduler = accelerator.prepare(unet, optimizer, loader, lr_scheduler)
    vae.to(accelerator.device)
    text_encoder.to(accelerator.device)

    debugger = TrainingDebugger(unet, accelerator=accelerator, config=DebugConfig(output_dir=args.output_dir))
    global_step = 0
    while global_step < args.max_train_steps:
        for batch in loader:
            pixels, input_ids = batch
            with accelerator.accumulate(unet):
                with torch.no_grad():
                    latents = vae.encode(pixels).latent_dist.sample() * vae.config.scaling_factor
                    encoder_hidden_states = text_encoder(input_ids)[0]
                noise = torch.randn_like(latents)
                timesteps = torch.randint(
                    0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device
                )
                noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
                model_pred = unet(noisy_latents, timesteps, encoder_hidden_states).sample
                loss = F.mse_loss(model_pred.float(), noise.float())
                accelerator.backward(loss)
                debugger.monitor_training_step(
                    loss, optimizer=optimizer, step=global_step, timesteps=timesteps, inputs=batch
                )
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(unet.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                global_step += 1
                if global_step >= args.max_train_steps:
                    break

    summary = debugger.get_summary()
    accelerator.wait_for_everyone()
    report = debugger.report()
    if accelerator.is_main_process:
        print({k: summary[k] for k in ("total_steps", "anomaly_steps", "gradient_explosions", "skipped_steps")})
        print(f"debug report: {report.save() / 'report.html'}")
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()
