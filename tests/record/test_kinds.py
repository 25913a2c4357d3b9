"""A kind is one registration: a typo raises, a new kind is a few lines and reaches the record."""

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionDebugError, TrainingDebugger
from diffusion_debug.record import KINDS, Anomaly, kind_info, make_anomaly, register_kind


def test_a_misspelt_kind_raises_with_the_near_name():
    with pytest.raises(DiffusionDebugError) as raised:
        make_anomaly("nonfinte", message="NaN in the gradients.")
    assert str(raised.value) == (
        "Unknown anomaly kind 'nonfinte' (did you mean 'nonfinite'?); register it with register_kind() first."
    )


def test_emitting_a_misspelt_kind_raises(tmp_path):
    tdbg = TrainingDebugger(torch.nn.Linear(2, 1), config=DebugConfig(output_dir=str(tmp_path)))
    try:
        with pytest.raises(DiffusionDebugError, match="Unknown anomaly kind 'nonfinte'"):
            tdbg.sink.emit(Anomaly("nonfinte", "error", "NaN in the gradients."))
    finally:
        tdbg.close()


def test_a_saved_run_of_a_newer_version_still_reads_an_unknown_kind():
    anomaly = Anomaly.from_dict({"kind": "from_the_future", "severity": "warning", "message": "new"})
    assert (anomaly.kind, kind_info("from_the_future").meaning) == ("from_the_future", "A finding of this debugger.")


def test_a_new_kind_is_one_registration_and_reaches_the_record(tmp_path):
    register_kind(
        "ema_drift",
        severity="warning",
        colour="#123456",
        meaning="The EMA weights drifted from the trained ones.",
        action="Check the EMA decay.",
        message=lambda a: f"The EMA weights drifted by {a.details['drift']:.2g} at step {a.step}.",
        fold_key=lambda a: (a.kind, a.rank),
    )
    tdbg = TrainingDebugger(torch.nn.Linear(2, 1), config=DebugConfig(output_dir=str(tmp_path)))
    try:
        assert tdbg.sink.emit(make_anomaly("ema_drift", component="model", module="0", step=3, details={"drift": 0.5}))
        # the kind's fold key ignores the module: the same drift elsewhere folds into the first
        assert not tdbg.sink.emit(
            make_anomaly("ema_drift", component="model", module="1", step=3, details={"drift": 1})
        )
        (found,) = [a for a in tdbg.report().anomalies if a.kind == "ema_drift"]
        assert (found.message, found.severity, found.details["count"]) == (
            "The EMA weights drifted by 0.5 at step 3.",
            "warning",
            2,
        )
    finally:
        tdbg.close()
        del KINDS["ema_drift"]


def test_inference_builders_write_the_messages_checks_wrote():
    std = make_anomaly("latent_divergence", details={"std": 3.14159, "expected_std": 1.2, "tolerance": 2.0})
    assert std.message == (
        "Latent std 3.14 is 2.6x what the noise level implies (1.2); check prediction_type, the scheduler and "
        "guidance_scale."
    )
    nan = make_anomaly("latent_divergence", severity="warning", details={"nan": 2, "posinf": 1, "neginf": 0})
    assert nan.message == (
        "Latents became non-finite (3 values); the denoiser output was already non-finite (see the nonfinite anomaly)."
    )
    details = {"tokenizer": "tokenizer", "prompt_role": "prompt", "dropped_tokens": 5, "max_length": 77}
    cut = make_anomaly("prompt_truncated", details={**details, "dropped_text": "x" * 100})
    assert cut.message == (
        f'tokenizer keeps 77 tokens, so 5 token(s) of the prompt were dropped ("{"x" * 77}..."); shorten it, or use '
        "prompt embeddings built from chunks."
    )


def test_every_built_in_kind_builds_its_message_and_no_check_writes_one():
    """One way to word an anomaly: the kind's builder; the code that finds one passes details."""
    import ast
    import pathlib

    import diffusion_debug

    assert [name for name, kind in KINDS.items() if kind.message is None] == []
    package = pathlib.Path(diffusion_debug.__file__).parent
    inline = []
    for path in package.rglob("*.py"):
        if path.parent.name == "record":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not any(k.arg == "message" for k in node.keywords):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("make_anomaly", "debugger_failure", "debugger_error"):
                inline.append(f"{path.relative_to(package)}:{node.lineno}")
    assert inline == []


def test_a_consequence_names_its_cause_in_one_wording_in_both_debuggers():
    origin = make_anomaly(
        "nonfinite",
        component="input",
        module="latents",
        step=0,
        details={"localized_by": "pipeline inputs", "inputs": ["latents"], "seen_in": "unet", "phase": "denoise"},
    )
    nan = make_anomaly(
        "latent_divergence",
        severity="warning",
        step=2,
        details={"nan": 3, "posinf": 0, "neginf": 0, "origin": origin.where()},
    )
    assert (
        nan.message
        == "Latents became non-finite (3 values); it follows the first NaN/Inf at input latents, step 0: fix that "
        "first."
    )
    loss = make_anomaly(
        "nonfinite_loss",
        component="model",
        step=6,
        details={"loss": "nan", "cause": {"kind": "lr_spike", "where": "optimizer, step 5", "rank": 0}},
    )
    assert (
        loss.message
        == "The loss is nan at step 6 on rank 0; it follows the lr_spike at optimizer, step 5: fix that first."
    )
