"""Cost where it is spent: a language-model text encoder's vocabulary logits, which pipelines
discard (QwenImage reads ``hidden_states[-1]``), are never measured: no op of the debugger reads
them (counted with a dispatch mode, not timed), and the call is judged on the hidden states."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from diffusion_debug.config import DebugConfig
from diffusion_debug.diffusion.components.call_sites import ComponentProbes, read_output, unread_modules
from diffusion_debug.diffusion.components.inventory import Component, role_of
from diffusion_debug.probes import ProbeConfig, apply_probes
from diffusion_debug.stats import tensors_in, to_host

VOCAB = 4099  # a size no activation has: an op reading a tensor of this last size reads the logits


class OpsOnLogits(TorchDispatchMode):
    """Counts the aten ops that read a tensor whose last dimension is the vocabulary (views included)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t.dim() and t.shape[-1] == VOCAB for t in tensors_in((args, kwargs or {}))):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def language_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    return Qwen2ForCausalLM(config).eval()


def encode(model):
    """As QwenImage calls its text encoder: the hidden states are read, the logits are not."""
    with torch.no_grad():
        return model(input_ids=torch.arange(12).reshape(1, 12), output_hidden_states=True)


def ops_on_logits(model, probe_config=None):
    handle = apply_probes(model, probe_config) if probe_config is not None else None
    with OpsOnLogits() as ops:
        output = encode(model)
    readings = handle.state.collect() if handle is not None else []
    if handle is not None:
        handle.remove()
    assert output.logits.shape[-1] == VOCAB
    return ops.count, readings


def test_the_vocabulary_head_is_found_and_its_logits_are_never_measured(language_model):
    component = Component("text_encoder", role_of("text_encoder", language_model), language_model)
    assert component.role == "text_encoder" and unread_modules(component) == ("lm_head",)
    plain, _ = ops_on_logits(language_model)
    before, _ = ops_on_logits(language_model, ProbeConfig("full"))  # every output measured, logits too
    after, readings = ops_on_logits(language_model, ProbeConfig("full", unread=("lm_head",)))
    # beyond the model's own ops on its logits, full probes add 1 without `unread` (the reduction;
    # no detach under no_grad), none with it
    assert (before - plain, after - plain) == (1, 0)
    assert "lm_head" not in {r.module for r in readings} and "" in {r.module for r in readings}


def test_the_debugger_probes_a_text_encoder_without_its_head_and_judges_the_hidden_states(language_model):
    component = Component("text_encoder", "text_encoder", language_model)
    plain, _ = ops_on_logits(language_model)
    probes = ComponentProbes(DebugConfig(level="basic"), on_error=lambda where, error: None)
    handle = probes.attach([component])
    try:
        with OpsOnLogits() as ops:
            output = encode(language_model)
        _, values, read = probes.take("text_encoder")
        readings = read(to_host(values))
    finally:
        handle.remove()
    assert ops.count == plain  # the model's own ops on its logits, none of the debugger's
    assert "lm_head" not in {r.module for r in readings}
    assert read_output(output) is output.hidden_states[-1]
