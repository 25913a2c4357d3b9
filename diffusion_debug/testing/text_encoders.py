"""The text side of the tiny pipelines, built offline: a CLIP byte-level BPE tokenizer, a T5 unigram
tokenizer, a Qwen2 byte-level one (QwenImage), and the configs of the text encoders that read their ids.

>>> tok = clip_tokenizer()
>>> tok.convert_ids_to_tokens(tok("a photo of a zebra").input_ids)[1:-1]
['a</w>', 'photo</w>', 'of</w>', 'a</w>', 'z', 'e', 'br', 'a</w>']

Limits:

* Both tokenizers know only the few whole words of :data:`WORDS`; every other word is split into
  byte-level pieces (CLIP) or single characters (T5), never into unknown tokens (CLIP) -- T5 maps
  characters outside its small alphabet to ``<unk>``.
* The CLIP tokenizer is loaded from vocab.json + merges.txt written to a temporary directory (the
  loaded tokenizer keeps everything in memory); the T5 one is a ``tokenizers`` unigram model built
  in memory (no sentencepiece file). ``model_max_length`` is 77 for CLIP, like the real one, so long
  prompts are truncated as with a real checkpoint; 32 for T5 by default.
"""

from __future__ import annotations

import json
import os
import tempfile

__all__ = [
    "WORDS",
    "clip_text_config",
    "clip_tokenizer",
    "gemma2_config",
    "qwen_tokenizer",
    "t5_encoder_config",
    "t5_tokenizer",
]

# The real CLIP limit; prompts longer than this are truncated by the pipelines.
_MODEL_MAX_LENGTH = 77
_BOS = "<|startoftext|>"
_EOS = "<|endoftext|>"

#: Words that get a single whole-word token. Anything else is split into byte-level pieces.
WORDS = (
    "a an the of in on at with and or to for by from is it this that "
    "photo picture painting drawing image portrait landscape render sketch "
    "cat dog horse bird fish person man woman child astronaut robot car house tree flower "
    "sky sea mountain city street forest river beach snow sun moon night day "
    "red blue green yellow black white orange purple pink brown "
    "big small old new beautiful cute dark bright high quality detailed realistic "
    "riding sitting standing running style art digital oil watercolor blurry ugly bad"
).split()


# --------------------------------------------------------------------------------------------------
# CLIP: byte-level BPE
# --------------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP byte-level mapping from each of the 256 bytes to a printable character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _vocab_and_merges() -> tuple[dict[str, int], list[str]]:
    """A small CLIP-style BPE vocabulary: every byte (alone and word-final), the whole words of
    ``WORDS`` and the pieces leading to them, then ``<|startoftext|>`` and ``<|endoftext|>`` as the
    two highest ids (as in real CLIP).

    The merges are learnt as BPE learns them (repeatedly merge the most frequent adjacent pair), so
    encoding one of ``WORDS`` with them gives a single whole-word token.
    """
    chars = list(_bytes_to_unicode().values())
    tokens: list[str] = chars + [c + "</w>" for c in chars]
    seen = set(tokens)
    words = [list(w[:-1]) + [w[-1] + "</w>"] for w in dict.fromkeys(WORDS)]
    merges: list[str] = []
    while True:
        counts: dict[tuple[str, str], int] = {}
        for pieces in words:
            for pair in zip(pieces, pieces[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        best = min(counts, key=lambda pair: (-counts[pair], pair))  # deterministic tie-break
        merged = best[0] + best[1]
        merges.append(f"{best[0]} {best[1]}")
        if merged not in seen:  # ("ab", "c") and ("a", "bc") give the same token
            tokens.append(merged)
            seen.add(merged)
        for pieces in words:
            i = 0
            while i < len(pieces) - 1:
                if (pieces[i], pieces[i + 1]) == best:
                    pieces[i : i + 2] = [merged]
                i += 1
    tokens += [_BOS, _EOS]
    return {tok: i for i, tok in enumerate(tokens)}, merges


_VOCAB, _MERGES = _vocab_and_merges()


def clip_tokenizer(pad_token: str = _EOS):
    """A ``CLIPTokenizer`` loaded from vocab.json + merges.txt written to a temporary directory
    (the real SDXL ``tokenizer_2`` pads with ``"!"``, the others with ``<|endoftext|>``)."""
    from transformers import CLIPTokenizer

    with tempfile.TemporaryDirectory(prefix="diffusion_debug_tok_") as tmp:
        with open(os.path.join(tmp, "vocab.json"), "w", encoding="utf-8") as f:
            json.dump(_VOCAB, f, ensure_ascii=False)
        with open(os.path.join(tmp, "merges.txt"), "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n" + "\n".join(_MERGES) + "\n")
        tok = CLIPTokenizer.from_pretrained(
            tmp,
            model_max_length=_MODEL_MAX_LENGTH,
            bos_token=_BOS,
            eos_token=_EOS,
            unk_token=_EOS,
            pad_token=pad_token,
        )
    # The loaded tokenizer keeps everything in memory; don't point at the deleted directory.
    tok.name_or_path = "diffusion_debug/tiny-clip-tokenizer"
    return tok


def clip_text_config(*, projection_dim: int = 32, hidden_act: str = "quick_gelu"):
    """The tiny CLIP text encoder's config (two layers, hidden size 32) for :func:`clip_tokenizer`'s
    vocabulary and special tokens."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(_VOCAB),
        hidden_size=32,
        intermediate_size=64,
        projection_dim=projection_dim,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=_MODEL_MAX_LENGTH,
        hidden_act=hidden_act,
        layer_norm_eps=1e-5,
        bos_token_id=_VOCAB[_BOS],
        eos_token_id=_VOCAB[_EOS],
        pad_token_id=_VOCAB[_EOS],
    )


# --------------------------------------------------------------------------------------------------
# Qwen2: byte-level BPE, no merges
# --------------------------------------------------------------------------------------------------

_QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def qwen_tokenizer():
    """A ``Qwen2Tokenizer`` built in memory: byte-level BPE over the 256 byte characters (no merges)
    and the special tokens of the chat template the pipeline wraps each prompt in. A transformers whose
    ``Qwen2Tokenizer`` reads its vocabulary from files (before 5: the floor's 4.47) is handed vocab.json and
    an empty merges.txt written to a temporary directory, as :func:`clip_tokenizer` is: the same tokens.

    >>> tok = qwen_tokenizer()
    >>> tok.convert_ids_to_tokens(tok("<|im_start|>a cat<|im_end|>").input_ids)
    ['<|im_start|>', 'a', 'Ġ', 'c', 'a', 't', '<|im_end|>']
    """
    import inspect

    from transformers import Qwen2Tokenizer

    vocab = {char: i for i, char in enumerate(_bytes_to_unicode().values())}
    vocab.update({token: len(vocab) + i for i, token in enumerate(_QWEN_SPECIAL)})
    if "vocab" in inspect.signature(Qwen2Tokenizer).parameters:
        tok = Qwen2Tokenizer(vocab=vocab, merges=[])
    else:
        with tempfile.TemporaryDirectory(prefix="diffusion_debug_tok_") as tmp:
            vocab_file, merges_file = os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt")
            with open(vocab_file, "w", encoding="utf-8") as f:
                json.dump(vocab, f, ensure_ascii=False)
            with open(merges_file, "w", encoding="utf-8") as f:
                f.write("#version: 0.2\n")
            tok = Qwen2Tokenizer(vocab_file, merges_file)  # read whole in __init__: the folder may go
    tok.add_special_tokens({"additional_special_tokens": list(_QWEN_SPECIAL[1:])})
    tok.name_or_path = "diffusion_debug/tiny-qwen-tokenizer"
    return tok


def gemma2_config(tokenizer, **overrides):
    """A tiny Gemma 2 config (``hidden_size`` 8, two heads) for ``tokenizer``'s vocabulary (Sana and
    Lumina 2 read :func:`qwen_tokenizer`'s ids: byte-level BPE, as Gemma's); ``overrides`` change it."""
    from transformers import Gemma2Config

    kwargs = dict(
        hidden_size=8,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        attn_implementation="eager",
    )
    return Gemma2Config(**{**kwargs, **overrides})


# --------------------------------------------------------------------------------------------------
# T5: unigram
# --------------------------------------------------------------------------------------------------


def t5_tokenizer(words: tuple[str, ...] | list[str], model_max_length: int = 32):
    """A T5 tokenizer (fast, ``tokenizers`` unigram model) over ``words`` and single characters;
    built in memory, no sentencepiece file and no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    chars = sorted({c for w in words for c in w} | set("abcdefghijklmnopqrstuvwxyz0123456789.,!?'-"))
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -1.0) for w in dict.fromkeys(words)]
    vocab += [(c, -5.0) for c in chars] + [("\u2581" + c, -4.0) for c in chars]
    backend = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    tok = T5TokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_ids=0,
        additional_special_tokens=[],
        model_max_length=model_max_length,
    )
    tok.name_or_path = "diffusion_debug/tiny-t5-tokenizer"
    return tok


def t5_encoder_config(tokenizer):
    """The tiny T5 encoder's config (one layer, ``d_model`` 32) for ``tokenizer``'s vocabulary."""
    from transformers import T5Config

    return T5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=37, num_layers=1, num_heads=4, decoder_start_token_id=0
    )
