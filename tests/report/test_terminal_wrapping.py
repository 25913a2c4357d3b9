"""Terminal tables at 80 columns: a module name breaks after its dots, never mid-word."""

from __future__ import annotations

from diffusion_debug.record import Anomaly
from diffusion_debug.report.terminal import anomaly_table, wrap_names

LORA = "up_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.default"


def test_a_lora_module_name_breaks_only_after_its_dots():
    lines = wrap_names(f"unet {LORA}, step 3 (t=761)", 40)
    assert lines == [
        "unet up_blocks.1.attentions.0.",
        "transformer_blocks.0.attn1.to_q.lora_A.",
        "default, step 3 (t=761)",
    ]
    assert all(len(line) <= 40 for line in lines)


def test_a_word_longer_than_the_width_without_a_dot_is_still_cut_to_the_width():
    assert wrap_names("a " + "x" * 50, 20) == ["a", "x" * 20, "x" * 20, "x" * 10]


def test_the_anomaly_table_at_80_columns_keeps_every_name_part_whole():
    message = f"unet.{LORA} produced NaN/Inf from finite inputs."
    anomaly = Anomaly("nonfinite", "error", message, "unet", LORA, step=3, timestep=761)
    assert anomaly_table([anomaly], width=80).splitlines() == [
        "severity  kind       where                 message",
        "--------  ---------  --------------------  ----------------------------",
        "error     nonfinite  unet up_blocks.1.     unet.up_blocks.1.attentions.",
        "                     attentions.0.         0.transformer_blocks.0.",
        "                     transformer_blocks.   attn1.to_q.lora_A.default",
        "                     0.attn1.to_q.lora_A.  produced NaN/Inf from finite",
        "                     default, step 3       inputs.",
        "                     (t=761)",
    ]
