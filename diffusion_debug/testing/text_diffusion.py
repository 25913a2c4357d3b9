"""A tiny, offline LLaDA2-style text diffusion pipeline: diffusers' ``LLaDA2Pipeline`` denoises token
ids, not Gaussian latents. Its loop is unlike the image pipelines': a sequence of ``mask`` tokens is
refined block by block, the model (``model``, a causal LM that returns logits) runs once per
refinement step, and ``BlockRefinementScheduler.step`` commits the most confident tokens. The
scheduler's ``timestep`` restarts at 0 in every block (and stays put in a block's editing steps), so
only the loop itself counts the steps.

>>> from diffusion_debug.testing import tiny_pipeline
>>> pipe = tiny_pipeline("llada2")
>>> type(pipe).__name__, type(pipe.model).__name__
('LLaDA2Pipeline', 'LlamaForCausalLM')
>>> tokens = pipe.tokenizer("a cat").input_ids
>>> pipe.tokenizer.convert_ids_to_tokens(tokens)
['a', 'cat']

:data:`LLADA2_CALL` gives the keyword arguments of a call (without ``generator`` and
``num_inference_steps``): 2 blocks of 4 tokens after a prompt of 4, so with 2 steps a block, 4
refinement steps in all (greedy, no editing steps).

Limits: random tiny weights (see :mod:`~diffusion_debug.testing.pipelines`). The real LLaDA2 model
(``inclusionAI/LLaDA2.0-mini``) is a mixture of experts loaded with ``trust_remote_code`` and attends
both ways inside a block; here a 2-layer Llama (causal attention) stands in for it, with the same
call (``input_ids``, a 2-D ``attention_mask``, ``position_ids``) and output (``.logits``). diffusers'
own test of the pipeline uses a hand-written logits function; a real transformers model is used
here so that there are modules to watch. The tokenizer is a word-level one over
:data:`~diffusion_debug.testing.text_encoders.WORDS` and a small chat template, built in memory.
``save_pretrained`` leaves the tokenizer out (``LLaDA2Pipeline`` takes it as an optional argument):
pass it back to ``from_pretrained``.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["BUILDERS", "KINDS", "LLADA2_CALL", "llada2_tokenizer"]

#: The kinds of this module that :func:`~diffusion_debug.testing.tiny_pipeline` builds.
KINDS = ("llada2",)

_SPECIAL = ("<|pad|>", "<|unk|>", "<|endoftext|>", "<|mask|>", "<role>", "</role>")
# A chat template in the manner of LLaDA2's (role markers around each message), kept tiny.
_CHAT_TEMPLATE = (
    "{% for m in messages %}<role> {{ m['role'] }} </role> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<role> assistant </role>{% endif %}"
)


def LLADA2_CALL() -> dict[str, Any]:  # noqa: N802 (a constant's name, as WAN22_CALL)
    """The keyword arguments of a tiny LLaDA2 call: a prompt of 4 tokens (``use_chat_template=False``),
    8 tokens generated in blocks of 4, greedy, every token committed by top-k (``threshold`` above 1)
    and no editing steps, so each block takes exactly ``num_inference_steps`` steps."""
    return {
        "prompt": "a photo of cat",
        "use_chat_template": False,
        "gen_length": 8,
        "block_length": 4,
        "temperature": 0.0,
        "threshold": 2.0,
        "editing_threshold": None,
        "eos_early_stop": False,
        "output_type": "seq",
    }


def llada2_tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` with LLaDA2's special tokens (``<|mask|>``,
    ``<|endoftext|>`` as EOS) and a small chat template; built in memory, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from .text_encoders import WORDS

    vocab = {token: i for i, token in enumerate((*_SPECIAL, *dict.fromkeys(WORDS)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        eos_token="<|endoftext|>",
        mask_token="<|mask|>",
        additional_special_tokens=["<role>", "</role>"],
        model_max_length=64,
    )
    tok.chat_template = _CHAT_TEMPLATE
    tok.name_or_path = "diffusion_debug/tiny-llada2-tokenizer"
    return tok


def build_llada2(make) -> dict[str, Any]:
    """A 2-layer Llama (hidden size 32) over :func:`llada2_tokenizer`'s vocabulary, and diffusers'
    ``BlockRefinementScheduler`` (blocks of 4 tokens)."""
    from diffusers import BlockRefinementScheduler
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = llada2_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = make("model", lambda: LlamaForCausalLM(config))
    return dict(model=model, scheduler=BlockRefinementScheduler(block_length=4), tokenizer=tokenizer)


#: kind -> (diffusers pipeline class name, builder of its components from ``make``).
BUILDERS: dict[str, tuple[str, Callable[..., dict[str, Any]]]] = {"llada2": ("LLaDA2Pipeline", build_llada2)}
