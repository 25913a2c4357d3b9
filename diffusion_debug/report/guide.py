"""What each anomaly kind means and what to do about it, in one place: the HTML report shows
it next to each group of anomalies and the README's table is made from it.

>>> ANOMALY_GUIDE["nonfinite"].meaning.split(":")[0]
'NaN or Inf appeared'
>>> print(guide_markdown(["loss_spike"]).splitlines()[0])
| kind | what it means | what to do |
"""

from __future__ import annotations

from typing import Iterable, NamedTuple


class KindGuide(NamedTuple):
    meaning: str
    action: str


ANOMALY_GUIDE: dict[str, KindGuide] = {
    "nonfinite": KindGuide(
        "NaN or Inf appeared: in inference, the module named first produced it from finite inputs; "
        "in training, a gradient holds it.",
        "Check that module's dtype and weights (fp16 overflow is the usual cause: try float32 or "
        "bfloat16, or an fp16-fix VAE); in training lower the learning rate or check the loss.",
    ),
    "overflow_risk": KindGuide(
        "An activation came close to the largest value its dtype can hold; one more step up and it becomes Inf.",
        "Run that component in float32 or bfloat16 (SDXL VAE: force_upcast or the fp16-fix VAE).",
    ),
    "latent_divergence": KindGuide(
        "The latents' spread left the range the scheduler expects, so the image is drifting to noise or saturation.",
        "Check the scheduler's prediction_type and timestep_spacing against the model, the guidance "
        "scale, and the initial noise sigma.",
    ),
    "vae_saturation": KindGuide(
        "Many decoded pixels sit at the edge of the output range: the image is clipped, black or white.",
        "Decode in float32 (force_upcast) or use a VAE fixed for fp16; check the latents' scaling factor.",
    ),
    "prompt_truncated": KindGuide(
        "The prompt was longer than the text encoder's limit (77 tokens for CLIP); the tail was dropped "
        "without a word.",
        "Shorten the prompt, or use prompt embeddings built from several chunks.",
    ),
    "scheduler_config": KindGuide(
        "The scheduler's settings do not fit the model or the number of steps (prediction_type, "
        "timestep_spacing, zero-terminal-SNR with epsilon).",
        "Load the scheduler config that ships with the model, or follow the fix in the message.",
    ),
    "dtype_mismatch": KindGuide(
        "Components or inputs run in different dtypes, so values are cast back and forth (or an fp16 "
        "component runs where it overflows).",
        "Put the pipeline in one dtype (pipe.to(dtype)) and keep the VAE in float32 where it needs it.",
    ),
    "nonfinite_loss": KindGuide(
        "The training loss was NaN or Inf at this step.",
        "Look at the batch and the forward pass of that step; lower the learning rate; with fp16 use a "
        "GradScaler (Accelerate does) or switch to bfloat16.",
    ),
    "loss_spike": KindGuide(
        "The loss jumped far above its recent average.",
        "Check the learning rate schedule and the batch of that step; clip gradients.",
    ),
    "gradient_explosion": KindGuide(
        "The gradient norm (before clipping) passed the configured threshold.",
        "Lower the learning rate, clip gradients (accelerator.clip_grad_norm_), or check the module "
        "with the largest gradient.",
    ),
    "gradient_vanishing": KindGuide(
        "The gradient norm fell below the configured threshold: the model is barely learning.",
        "Check that the parameters you train require grad and receive a loss, and the loss scale.",
    ),
    "skipped_step": KindGuide(
        "The optimizer step was skipped (fp16 loss scaler found Inf/NaN gradients, or the policy skipped it).",
        "A few skips while the scale settles are normal; many in a row mean the model overflows in fp16.",
    ),
    "memory_growth": KindGuide(
        "Memory kept growing across steps beyond the configured allowance.",
        "Look for tensors kept across steps (losses appended without .item() or .detach(), caches).",
    ),
    "rank_desync": KindGuide(
        "Processes disagree (different step, loss or parameters); a collective may hang.",
        "Check that every rank runs the same steps and that random seeds and data sharding are set up.",
    ),
    "debugger_error": KindGuide(
        "A measurement of the debugger itself failed; the run went on without it.",
        "The rest of the report still holds; please report the message with the versions shown above.",
    ),
}

_UNKNOWN = KindGuide("A finding of this debugger.", "See the message.")


def guide_for(kind: str) -> KindGuide:
    """The guide for ``kind``; a generic line for a kind this table does not know yet."""
    return ANOMALY_GUIDE.get(kind, _UNKNOWN)


def guide_markdown(kinds: Iterable[str] | None = None) -> str:
    """The guide as a Markdown table (for the README)."""
    rows = ["| kind | what it means | what to do |", "| --- | --- | --- |"]
    for kind in ANOMALY_GUIDE if kinds is None else kinds:
        g = guide_for(kind)
        rows.append(f"| `{kind}` | {g.meaning} | {g.action} |")
    return "\n".join(rows)
