"""Terminal tables at 80 columns: a module name breaks after its dots, never mid-word."""

from __future__ import annotations

import io

from diffusion_debug.record import Anomaly
from diffusion_debug.report.terminal import PIPED_WIDTH, anomaly_table, table_width, wrap_names

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


NAN_MESSAGE = (
    "1 gradient(s) hold NaN/Inf, first registered 2.weight in module 2: lower the learning rate, check the "
    "loss for NaN/Inf, or use closure= to name the backward op."
)


def test_a_table_printed_to_no_terminal_is_160_wide_and_columns_still_wins(monkeypatch):
    """Piped, in a CI log or a test worker, stdout is no terminal: the table is laid out 160 wide (80,
    the usual fallback, left the message 28 wide); COLUMNS, when set, is the width wherever it goes."""
    anomaly = Anomaly("nonfinite", "error", NAN_MESSAGE, "model", parameter="2.weight", step=3)
    monkeypatch.delenv("COLUMNS", raising=False)
    assert table_width(io.StringIO()) == PIPED_WIDTH == 160
    assert anomaly_table([anomaly]).splitlines() == [  # stdout is pytest's capture: no terminal
        "severity  kind       where                   message",
        "--------  ---------  ----------------------  " + "-" * 106,  # 160 - 32 beside kind - 22 where
        "error     nonfinite  model 2.weight, step 3  1 gradient(s) hold NaN/Inf, first registered 2.weight in "
        "module 2: lower the learning rate, check the loss",
        "                                             for NaN/Inf, or use closure= to name the backward op.",
    ]
    monkeypatch.setenv("COLUMNS", "80")
    assert table_width(io.StringIO()) == 80
    lines = anomaly_table([anomaly]).splitlines()
    column = lines[0].index("message")
    assert [line[column:] for line in lines[2:4]] == ["1 gradient(s) hold NaN/Inf,", "first registered 2.weight in"]
