"""A hand-written denoising loop, watched with monitor_diffusion_step().

python examples/custom_denoising_loop.py --steps 20
"""

import argparse

import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import tiny_pipeline


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output-dir", default="debug_output")
    args = parser.parse_args(argv)

    pipe = tiny_pipeline("sd")
    unet, scheduler = pipe.unet, pipe.scheduler
    debugger = DiffusionModelDebugger(pipe, DebugConfig(level="basic", output_dir=args.output_dir))

    with torch.no_grad():
        prompt_embeds, negative_embeds = pipe.encode_prompt(
            "a photo of a cat", device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=True
        )
        context = torch.cat([negative_embeds, prompt_embeds])
        scheduler.set_timesteps(args.steps)
        size = unet.config.sample_size
        latents = torch.randn(1, unet.config.in_channels, size, size, generator=torch.Generator().manual_seed(0))
        latents = latents * scheduler.init_noise_sigma
        for step, t in enumerate(scheduler.timesteps):
            model_input = scheduler.scale_model_input(torch.cat([latents] * 2), t)
            uncond, cond = unet(model_input, t, encoder_hidden_states=context).sample.chunk(2)
            noise = uncond + 7.5 * (cond - uncond)
            latents = scheduler.step(noise, t, latents).prev_sample
            debugger.monitor_diffusion_step(step, latents, timestep=t)

    report = debugger.report()
    print(f"{len(report.steps)} steps monitored; final latent std {report.steps[-1]['latents']['std']:.3f}")
    print(f"report: {report.save() / 'report.html'}")
    return report


if __name__ == "__main__":
    main()
