"""Test helpers, fully offline: tiny diffusers pipelines and planted faults.

* :mod:`~diffusion_debug.testing.pipelines` -- :func:`tiny_pipeline` (kinds in :data:`TINY_KINDS`
  and the zoo's), which builds each kind from its family's module:
  :mod:`~diffusion_debug.testing.stable_diffusion` (real SD / SDXL / SD3 pipelines with tiny random
  weights), :mod:`~diffusion_debug.testing.zoo` (img2img, inpaint, ControlNet, AnimateDiff,
  Kandinsky 2.2 prior / decoder, PixArt-α and DiT), :mod:`~diffusion_debug.testing.zoo_more`
  (InstructPix2Pix, x4 upscaler, T2I-Adapter, Depth2Img, LCM, DeepFloyd IF, PixArt-Σ, Sana,
  Lumina 2, AuraFlow, CogVideoX), :mod:`~diffusion_debug.testing.zoo_newer` (Flux Kontext, Fill
  and Control, Chroma, HunyuanVideo, Mochi, Wan image-to-video, the SDXL refiner),
  :mod:`~diffusion_debug.testing.zoo_latest` (Stable Cascade prior and decoder, SkyReels-V2 diffusion forcing,
  Kandinsky 5, CogView4, Sana-Sprint, Z-Image, Allegro), :mod:`~diffusion_debug.testing.zoo_extra` (Kandinsky 3,
  HunyuanVideo 1.5, Latte, a consistency model, VisualCloze),
  :mod:`~diffusion_debug.testing.zoo_recent` (SDXL PAG and ControlNet-Union, FLUX.2 [klein], Bria, Marigold,
  Z-Image img2img, HiDream-I1, Lumina-Next, HunyuanImage 2.1),
  :mod:`~diffusion_debug.testing.zoo_recent_video` (LTX-Video, Wan VACE, ChronoEdit, SANA-Video, Stable Audio),
  :mod:`~diffusion_debug.testing.flux` and
  :mod:`~diffusion_debug.testing.zoo_video_audio` (Stable Video Diffusion, Dance Diffusion, Wan 2.2,
  LTX-2 with audio), :mod:`~diffusion_debug.testing.qwenimage` (QwenImage) and
  :mod:`~diffusion_debug.testing.text_diffusion` (LLaDA2: text diffusion over token ids); their
  tokenizers and text encoder configs in :mod:`~diffusion_debug.testing.text_encoders`. Not kinds:
  :mod:`~diffusion_debug.testing.zoo_no_text_encoder` (the newest families, given the prompt's features).
* :mod:`~diffusion_debug.testing.faults` -- :func:`plant_nonfinite` and :func:`plant_overflow`,
  forward hooks that make a module misbehave on purpose.
"""

from __future__ import annotations

from .faults import plant_leak, plant_nonfinite, plant_oom, plant_overflow
from .pipelines import TINY_KINDS, tiny_pipeline

__all__ = ["TINY_KINDS", "plant_leak", "plant_nonfinite", "plant_oom", "plant_overflow", "tiny_pipeline"]
