"""Which blocks of a component the overflow sentinel reads (:func:`~.component_probes.probe_levels`'s
``sentinel``): a UNet's or VAE's blocks, a mid block as one (:func:`overflow_blocks`), a denoiser's without
the single modules at its ends (:func:`denoiser_blocks`), a component called once per image without those
before a call site's first block (:func:`inner_blocks`), and a residual stream's layer list at its last layer
(:func:`stack_ends`); under float16 autocast, the float16 projections that end a float32 stream's sublayers
(:func:`residual_projections`, :func:`block_projections`). Each leaves out what another check already reads,
and a replay with full probes names the module inside a block."""

from __future__ import annotations

from torch import nn

from ...probes import probed_modules
from .compiled import ORIG
from .inventory import Component, call_sites


def overflow_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The sentinel blocks of ``module`` whose output can be fp16 or fp8, which the overflow sentinel
    (:func:`probe_levels`) reads: all of them but diffusers' ``Timesteps`` (a UNet's ``time_proj``),
    whose sinusoidal embedding is made in float32 whatever the model's dtype and has no parameter: a
    hook there (one a step) would never read anything. A diffusers ``mid_block`` is one block, as
    each down and up block is (:func:`~diffusion_debug.probes.watched.sentinel_modules` would
    watch each of its resnets and attentions, the ``ModuleList`` elements it holds): a residual
    chain, whose output carries what any of them makes (a NaN/Inf, a near-overflow), which the
    replay with full probes then names at its module; two hooks and two reductions fewer a UNet
    or VAE decoder call.

    >>> inner = lambda: nn.Sequential(nn.Linear(1, 1))
    >>> mid = nn.Module()
    >>> mid.resnets, mid.attentions = nn.ModuleList([inner(), inner()]), nn.ModuleList([inner()])
    >>> model = nn.Module()
    >>> model.down_blocks, model.mid_block = nn.ModuleList([inner()]), mid
    >>> [name for name, _ in overflow_blocks(model)]
    ['down_blocks.0', 'mid_block']
    """
    blocks: list[tuple[str, nn.Module]] = []
    mids: set[str] = set()
    for name, block in probed_modules(module, "sentinel"):
        if _float32_made(block):
            continue
        mid = _mid_block(name)
        if mid is None:
            blocks.append((name, block))
        elif mid not in mids:  # the mid block in place of its first element
            mids.add(mid)
            blocks.append((mid, module.get_submodule(mid)))
    return blocks


def _mid_block(name: str) -> str | None:
    """The name of the diffusers ``mid_block`` that the sentinel block ``name`` lies in, if any."""
    if name.startswith("mid_block."):
        return "mid_block"
    at = name.find(".mid_block.")
    return name[: at + len(".mid_block")] if at >= 0 else None


def denoiser_blocks(blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The overflow ``blocks`` of a denoiser less the single modules (blocks that hold no module)
    before its first block that holds modules (a UNet's ``conv_in``), and those after its last one
    but the very last (a UNet's ``conv_norm_out``; its ``conv_out`` stays: its output is the
    call's, whose near-overflow no other check reads). Such a module's output is bounded by its
    weights and its input; what it makes reaches the next block's output (each block adds to what
    it is given) or the call's output, both read, and the replay with full probes names it.

    >>> single, block = nn.Linear(1, 1), nn.Sequential(nn.Linear(1, 1))
    >>> names = ["conv_in", "time_embedding", "down_blocks.0", "conv_norm_out", "conv_out"]
    >>> blocks = list(zip(names, [single, block, block, single, single]))
    >>> [name for name, _ in denoiser_blocks(blocks)]
    ['time_embedding', 'down_blocks.0', 'conv_out']
    """
    held = [i for i, (_, block) in enumerate(blocks) if block._modules]
    if not held:
        return blocks
    first, last = held[0], held[-1]
    return blocks[first : last + 1] + blocks[-1:] if last + 1 < len(blocks) else blocks[first:]


def _float32_made(block: nn.Module) -> bool:
    try:
        from diffusers.models.embeddings import Timesteps
    except ImportError:  # pragma: no cover - diffusers is what this package watches
        return False
    return type(block) is Timesteps and not block._parameters and not block._modules


def inner_blocks(component: Component, blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The sentinel ``blocks`` of a component called once per image (VAE, text and image encoders),
    less the single modules (blocks that hold no module) before each call site's first block that holds
    modules: the VAE decoder's ``conv_in``; and a block of lookups only at the start (a text encoder's
    ``embeddings``, token and position ``nn.Embedding``: two hooks and reductions fewer a CFG call, whose
    prompt is encoded twice). Such a module's output is bounded by its weights (read with full probes on the
    first call) and by the call's input; a near-overflow it makes reaches the first block's output (a residual
    stream), read, and a replay with full probes names it. Kept: the blocks from a site's first block that
    holds modules on (residual blocks, attentions, layers: where an fp16 activation grows), the single modules
    after its last one too (the site's end, on its output path: the SD VAE decoder's ``conv_norm_out`` and
    ``conv_out``, Wan's ``norm_out`` and ``conv_out``, a CLIP text encoder's ``final_layer_norm``, SDXL's
    second encoder's ``text_projection``, T5's ``final_layer_norm``; no activation: ``probes.probed_modules``),
    whose near-max or NaN/Inf the sentinel then names at its module as read (a leaf: no replay; before vae36,
    the call's output check named it by a replay of the kept call), and every block outside the call sites
    (the VAE's ``post_quant_conv``, called by ``decode`` ahead of the ``decoder``: no output check sees it on
    its own). A site none of whose blocks holds a module keeps them all. A text or image encoder's layers are
    then read at the last layer of their stack (:func:`stack_ends`).

    >>> block = lambda: nn.Sequential(nn.Linear(1, 1))
    >>> lookup = nn.Sequential(nn.Embedding(2, 1), nn.Embedding(2, 1))
    >>> encoder = nn.Sequential(nn.Linear(1, 1), lookup, block(), nn.Linear(1, 1), block(), nn.LayerNorm(1))
    >>> text_encoder = Component("text_encoder", "text_encoder", encoder)
    >>> [name for name, _ in inner_blocks(text_encoder, list(encoder.named_children()))]
    ['2', '3', '4', '5']
    """
    prefixes = [site.prefix for site in call_sites(component)]

    def site_of(name: str) -> str | None:
        return next((p for p in prefixes if p == "" or name == p or name.startswith(p + ".")), None)

    sites = [site_of(name) for name, _ in blocks]
    keep = [site is None for site in sites]
    for prefix in set(sites) - {None}:
        mine = [i for i, site in enumerate(sites) if site == prefix]
        held = [i for i in mine if blocks[i][1]._modules and not _lookup(blocks[i][1])] or mine
        for i in mine:
            keep[i] = keep[i] or held[0] <= i
    kept = [block for block, kept in zip(blocks, keep) if kept]
    return stack_ends(component.module, kept) if component.role in _LAYER_STACKS else kept


_LAYER_STACKS = frozenset({"text_encoder", "image_encoder"})
"""The roles whose ``nn.ModuleList`` of blocks is a residual stream (transformers' text and image
encoders: CLIP, T5, Llama-style decoders), which :func:`stack_ends` reads at its last layer."""


def stack_ends(
    root: nn.Module, blocks: list[tuple[str, nn.Module]], *, repeated: bool = False
) -> list[tuple[str, nn.Module]]:
    """``blocks`` less every layer of an ``nn.ModuleList`` of ``root`` that the next block of the
    same list follows: a text or image encoder's layers (``encoder.layers.0`` ... ``.11``) are read
    at the last one. Each layer adds what it makes to the stream it is given (``h + attn(norm(h))``,
    then ``h + mlp(norm(h))``), so the last layer's output carries what any layer before it made: a
    NaN/Inf, or a near-overflow, that the final norm would hide from the call's output check. The
    replay with full probes then names the module that made it, as for a mid block's resnets
    (:func:`overflow_blocks`). One hook and one abs-max a stack, where there were one a layer:
    a CFG call encodes twice (SD1.5's 12 CLIP layers: 22 hooks fewer a call). Limits: a near-overflow
    a later layer takes back out of the stream (adding its negative) is not read, nor one made in a
    call that stops before the stack's last layer (a NaN/Inf still reaches the call's output check).

    ``repeated`` (a denoiser's blocks): a layer is left out only where the next one is the same
    layer again, of its type with parameters of the same shapes (:func:`_repeats`): a transformer
    denoiser's ``transformer_blocks``, ``single_transformer_blocks`` or ``blocks`` (PixArt, SD3,
    Flux, Wan, HunyuanVideo, QwenImage: each block adds its gated attention and MLP outputs to the
    streams it is given; Flux's and SD3's dual-stream blocks return both streams, both read at the
    list's last block), not a UNet's ``down_blocks`` or ``up_blocks``, whose widths change from one
    block to the next and whose resnets go through norms (no stream carries a value through them).
    SD3's last block, which keeps no text stream (``context_pre_only``), is no repeat of the one
    before: that one is read too, with the text stream it passes on. Sentinel blocks a step at real
    size (built on the meta device): Flux.1-dev 62 -> 7, SD3 medium 29 -> 7, PixArt-alpha 33 -> 6,
    Wan 2.1 14B 42 -> 3, HunyuanVideo 69 -> 10, QwenImage 66 -> 7.

    >>> layers = nn.ModuleList([nn.Sequential(nn.Linear(1, 1)) for _ in range(3)])
    >>> encoder = nn.Module()
    >>> encoder.layers, encoder.norm = layers, nn.LayerNorm(1)
    >>> [name for name, _ in stack_ends(encoder, [(f"layers.{i}", layers[i]) for i in range(3)])]
    ['layers.2']
    """
    if ORIG in root._modules and not any(name.startswith(ORIG + ".") for name, _ in blocks):
        root = root._modules[ORIG]  # torch.compile's wrapper: its blocks named as its original's
    ends = []
    for (name, block), following in zip(blocks, [*blocks[1:], ("", None)]):
        parent, _, index = name.rpartition(".")
        after, _, next_index = following[0].rpartition(".")
        if parent and parent == after and index.isdigit() and next_index.isdigit():
            try:
                in_list = isinstance(root.get_submodule(parent), nn.ModuleList)
            except AttributeError:  # not a module of root's (a caller's own list of blocks)
                in_list = False
            if in_list and (not repeated or _repeats(block, following[1])):
                continue  # its stack's next layer follows: read at the stack's last
        ends.append((name, block))
    return ends


def _repeats(block: nn.Module, following: nn.Module | None) -> bool:
    """Whether ``following`` is ``block`` again: its type, and parameters of the same names and shapes
    (a stack's repeated layer, whose input and output are the same stream), neither of them one that
    changes the resolution (a down or up block's ``downsamplers`` or ``upsamplers``: a UNet's, whose
    up blocks of one width repeat; their outputs are no stream, each block's resnets start with a norm).

    >>> _repeats(nn.Linear(2, 2), nn.Linear(2, 2)), _repeats(nn.Linear(2, 2), nn.Linear(2, 3))
    (True, False)
    """
    if following is None or type(following) is not type(block):
        return False
    if any(getattr(b, name, None) is not None for b in (block, following) for name in _RESAMPLERS):
        return False
    mine, theirs = dict(block.named_parameters()), dict(following.named_parameters())
    return mine.keys() == theirs.keys() and all(p.shape == theirs[n].shape for n, p in mine.items())


_RESAMPLERS = ("downsamplers", "upsamplers")
"""diffusers' down and up blocks' attributes that change the resolution (:func:`_repeats`)."""


RESIDUAL_PROJECTIONS = frozenset({"out_proj", "fc2", "o", "wo", "o_proj", "down_proj"})
"""The names of the ``nn.Linear`` that ends a sublayer of transformers' text and image encoders, whose output is
added to the residual stream: CLIP's ``self_attn.out_proj`` and ``mlp.fc2``, T5's attention ``o`` and
``DenseReluDense.wo``, a Llama-style decoder's ``o_proj`` and ``down_proj``; and diffusers' ``to_out.0`` and a
``FeedForward``'s last Linear (:func:`residual_projections`)."""


def residual_projections(module: nn.Module, unread: tuple[str, ...] = ()) -> list[tuple[str, nn.Module]]:
    """The ``nn.Linear`` of ``module`` whose outputs each sublayer adds to its residual stream
    (:data:`RESIDUAL_PROJECTIONS`), in module order, none under ``unread`` (a vocabulary head). Under float16
    autocast a text encoder's stream stays float32 (float32 embeddings plus float16 sublayer outputs), which the
    sentinel does not read against float16's max (only norms take it); what a sublayer makes near that max is
    its projection's float16 output, read here (:meth:`~.component_probes.ComponentProbes.attach`). Not its
    attention's or its block's: T5's ``position_bias`` carries float32's min.

    >>> layer = nn.Module()
    >>> layer.mlp = nn.Sequential()
    >>> layer.mlp.fc1, layer.mlp.fc2, layer.to_out = nn.Linear(1, 1), nn.Linear(1, 1), nn.ModuleList([nn.Linear(1, 1)])
    >>> [name for name, _ in residual_projections(layer)]
    ['mlp.fc2', 'to_out.0']
    """
    found = []
    for name, child in module.named_modules():
        if not isinstance(child, nn.Linear) or any(name == u or name.startswith(u + ".") for u in unread):
            continue
        parent, _, last = name.rpartition(".")
        if last in RESIDUAL_PROJECTIONS or (last == "0" and parent.rpartition(".")[2] == "to_out"):
            found.append((name, child))
        elif parent.endswith(".net") or parent == "net":  # diffusers' FeedForward: net[-1] the Linear out
            owner = module.get_submodule(parent.rpartition(".")[0]) if "." in parent else module
            if type(owner).__name__ == "FeedForward" and owner.net[-1] is child:
                found.append((name, child))
    return found


def _unet(module: nn.Module) -> bool:
    """Whether ``module`` is one of diffusers' UNets (``diffusers.models.unets``), whose down and up
    blocks are no residual stream: its sentinel reads each (:func:`stack_ends` is for a transformer's
    block lists)."""
    return ".unets." in type(module).__module__ or type(module).__name__.startswith("UNet")


def _lookup(block: nn.Module) -> bool:
    """Whether every module under ``block`` is an ``nn.Embedding`` (a text encoder's token and
    position embeddings): its output is rows of its weights, as a single module's is bounded by them."""
    inside = [m for m in block.modules() if m is not block]
    return bool(inside) and all(isinstance(m, nn.Embedding) for m in inside)


def block_projections(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The ``nn.Linear`` that end the sublayers of the blocks of ``module``'s block lists (each ``nn.ModuleList`` it
    holds), in module order: an attention's output projections (``to_out.0``; ``to_add_out``, the text stream's of
    SD3's and Flux's dual-stream blocks) and a ``FeedForward``'s last Linear, nothing else (a block's own
    ``proj_out``, a ``GLUMBConv``'s convolution). A float32 transformer denoiser under float16 autocast (PixArt, SD3,
    Flux run so) computes them in float16, and its blocks scale each by its adaLN gate before adding it to a float32
    stream: what one makes near float16's max reaches no float16 block output the sentinel reads (PixArt's gate is a
    float32 parameter plus the timestep's: the product is float32). Read here, paced by step
    (:mod:`.sentinel_pace`; :meth:`~.component_probes.ComponentProbes.attach`). At real size PixArt-alpha's 28
    blocks hold 84 (two attentions and a FeedForward each). A Linear a LoRA adapter wraps (peft's ``lora.Linear``:
    its ``base_layer`` an ``nn.Linear``) is read as the wrapper, whose output is the projection's with the adapter's.

    >>> from diffusers.models.attention import FeedForward
    >>> from diffusers.models.attention_processor import Attention
    >>> block = nn.Module()
    >>> block.attn1, block.ff, block.proj_out = Attention(8, heads=1, dim_head=8), FeedForward(8), nn.Linear(8, 8)
    >>> model = nn.Module()
    >>> model.transformer_blocks, model.proj_out = nn.ModuleList([block]), nn.Linear(8, 8)
    >>> [name for name, _ in block_projections(model)]
    ['transformer_blocks.0.attn1.to_out.0', 'transformer_blocks.0.ff.net.2']
    """
    attentions, feed_forwards = _sublayer_types()
    found = []
    for list_name, blocks in module.named_children():
        if not isinstance(blocks, nn.ModuleList):
            continue
        for name, child in blocks.named_modules(prefix=list_name):
            if isinstance(child, attentions):
                out = child._modules.get("to_out")
                first = out[0] if isinstance(out, nn.ModuleList) and len(out) else None
                if _linear(first):
                    found.append((f"{name}.to_out.0", first))
                if _linear(child._modules.get("to_add_out")):
                    found.append((f"{name}.to_add_out", child._modules["to_add_out"]))
            elif isinstance(child, feed_forwards):
                net = child._modules.get("net")
                last = [i for i, m in enumerate(net or ()) if _linear(m)]
                if last:
                    found.append((f"{name}.net.{last[-1]}", net[last[-1]]))
    return found


def _linear(module: nn.Module | None) -> bool:
    """``module`` is an ``nn.Linear``, or wraps one as its ``base_layer`` (peft's LoRA layers)."""
    return isinstance(module, nn.Linear) or (
        module is not None and isinstance(module._modules.get("base_layer"), nn.Linear)
    )


def unclipped_float16(block: nn.Module) -> bool:
    """Whether ``block`` is of a class known to add its sublayers' outputs to its float16 streams unclipped, so that an
    Inf one of its projections makes reaches the step's output and a sentinel that reads some steps still finds it:
    diffusers' ``JointTransformerBlock`` (SD3's; neither its ``forward`` nor ``JointAttnProcessor2_0`` clips or clamps,
    diffusers 0.32 to 0.42), exactly that class, not a subclass (its ``forward`` may clip). Any other block with a
    float16 output counts as clipping: Flux's, QwenImage's, Chroma's blocks ``.clip(-65504, 65504)`` their streams,
    NucleusMoE's to ``torch.finfo(torch.float16).max``, Sana's attention processor inside; a list, not a guess.

    >>> from diffusers.models.attention import JointTransformerBlock
    >>> from diffusers.models.transformers.transformer_flux import FluxTransformerBlock
    >>> unclipped_float16(JointTransformerBlock(8, 1, 8, False)), unclipped_float16(FluxTransformerBlock(8, 1, 8))
    (True, False)
    """
    return type(block) in _unclipped_classes()


def _unclipped_classes() -> tuple[type, ...]:
    """The installed diffusers' block classes of :func:`unclipped_float16`."""
    try:
        from diffusers.models.attention import JointTransformerBlock
    except ImportError:  # pragma: no cover - diffusers is what this package watches
        return ()
    return (JointTransformerBlock,)


def _sublayer_types() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """diffusers' attention classes (``Attention``; ``AttentionModuleMixin``'s, Flux's since 0.35) and
    ``FeedForward``, as the installed diffusers has them."""
    attentions: list[type] = []
    feed_forwards: list[type] = []
    try:
        from diffusers.models.attention_processor import Attention

        attentions.append(Attention)
    except ImportError:  # pragma: no cover - diffusers is what this package watches
        pass
    try:
        from diffusers.models.attention import AttentionModuleMixin  # diffusers >= 0.35

        attentions.append(AttentionModuleMixin)
    except ImportError:
        pass
    try:
        from diffusers.models.attention import FeedForward

        feed_forwards.append(FeedForward)
    except ImportError:  # pragma: no cover
        pass
    return tuple(attentions), tuple(feed_forwards)
