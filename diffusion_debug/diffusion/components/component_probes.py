"""Which probe each component gets at an attach (:func:`probe_levels`), and
:class:`ComponentProbes`, the per-module probes inside each component, whose queued values are
taken per step or per call. The blocks a sentinel reads are :mod:`.sentinel_blocks`'; the call sites'
own hooks are :mod:`.call_sites`'."""

from __future__ import annotations

from itertools import chain
from typing import Callable, Collection

import torch
from torch import nn

from ...config import DebugConfig
from ...probes import (
    OVERFLOW_DTYPES,
    Probe,
    ProbeConfig,
    ProbeHandle,
    apply_probes,
    probed_modules,
    probes_holding,
    reset_probes,
)
from ...probes.handles import ForwardHooks
from ...probes.tracing import compile_wrapper
from ...stats import dtype_name
from .autocast import ANY_AUTOCAST, AutocastState, autocast_dtype, autocast_state, execution_device_type
from .compiled import ORIG, compile_state
from .inventory import Component, is_loop_role
from .roles import role
from .sentinel_blocks import (
    _LAYER_STACKS,
    _unet,
    block_projections,
    denoiser_blocks,
    inner_blocks,
    overflow_blocks,
    residual_projections,
    stack_ends,
    unclipped_float16,
)
from .sentinel_pace import SentinelPace, run_group
from .structure import TreeMemo


def unread_modules(component: Component) -> tuple[str, ...]:
    """Modules of a text encoder whose outputs no pipeline reads: a language model's vocabulary head
    (transformers' ``get_output_embeddings()``; QwenImage's encoder returns 1 x 52 x 152,064 logits)."""
    if component.role != "text_encoder":
        return ()
    try:
        head = component.module.get_output_embeddings()
    except Exception:  # not a transformers model, or one without a head
        return ()
    if not isinstance(head, nn.Module):
        return ()
    return tuple(name for name, module in component.module.named_modules() if module is head and name)[:1]


_OVERFLOW_NAMES = frozenset(dtype_name(d) for d in OVERFLOW_DTYPES)
"""The names of the dtypes that can overflow, as :func:`~.inventory.component_dtypes` gives them."""


def probe_levels(
    components: list[Component],
    level: str,
    dtypes: dict[str, str | None] | None = None,
    first_calls: Collection[str] = (),
    autocast: Collection[str] = (),
) -> dict[str, str]:
    """The probe level of each component: ``level``, except at the default (``sentinel``), which
    watches what can overflow: a component whose parameters (``dtypes``) are fp16 or fp8, or any
    while autocast to one is on for its device (``autocast``: those components, :func:`autocast_now` as the run
    begins: CUDA autocast leaves a text encoder kept on the CPU in float32). No component
    gets full probes on every call.

    - One that can overflow keeps the ``sentinel``: its block outputs in fp16 or fp8, taken
      together in one op a call (a UNet's down, mid and up blocks; a transformer denoiser's block
      lists at their last block, :func:`stack_ends`; the VAE decoder's mid and
      up blocks; a text encoder's layer stack at its last layer: :func:`inner_blocks`, with the single
      modules after a call site's last block of a component called once per image, not those before its first).
      A NaN/Inf or a near-overflow at a block is named by a replay of the kept call with full probes; at a single
      module after the last block, by the sentinel's reading itself (a leaf); one made before the first block
      reaches that block's output. On a run the sentinel does not read, the call's output, whose abs-max the
      output check measures anyway and flags on every call
      (:meth:`~diffusion_debug.diffusion.call_events.CallEvents.check_call`), is named by a replay.
    - A component called once per image (VAE, text and image encoders) that can overflow gets
      ``full`` probes on its first call (``first_calls``: the components not read so yet), which
      also see a near-overflow that a normalisation hides inside a block; the sentinel after that,
      read at some runs (a debugger's first two, then every 4th, and while warm: :mod:`.sentinel_pace`).
    - One that cannot (fp32, bf16: an activation never comes near their largest value) gets
      ``output``: no probe. Its output is checked at its call site (every step measures the
      denoiser's), and a NaN/Inf there is named by a replay of the kept call with full probes.
      A sentinel or a full probe there would cost a hook per block or module on every call to
      find what the replay finds on a failing one.
    - ControlNets and adapters keep the whole sentinel, whatever their dtype: their outputs are
      nested residuals that the step does not measure.

    Under float16 autocast a float32 component is probed as a float16 one (its matmuls compute in float16);
    its float32 block outputs are not read against float16's largest value (:meth:`ComponentProbes._config`),
    its sublayers' float16 projections are: a text encoder's (:func:`~.sentinel_blocks.residual_projections`),
    a transformer denoiser's blocks' (:func:`~.sentinel_blocks.block_projections`, whose adaLN gates shrink
    them before the block's end), that one paced by step (steps 0, 1, every 8th: :mod:`.sentinel_pace`).
    Autocast entered or left after attach is followed as the next
    run begins (:meth:`ComponentProbes.autocast_changed`); limit: one entered inside a pipeline call (around a
    component's call in the pipeline's own code) is not."""
    if level != "sentinel":
        return dict.fromkeys([c.name for c in components], level)
    overflow = _OVERFLOW_NAMES
    known = dtypes is not None
    levels: dict[str, str] = {}
    for c in components:  # (a loop: no Python call a component, at every attach)
        dtype = dtypes.get(c.name) if known else None
        can_overflow = not known or dtype is None or dtype in overflow or (autocast and c.name in autocast)
        if not role(c.role).in_loop:  # (is_loop_role)
            levels[c.name] = ("full" if c.name in first_calls else "sentinel") if can_overflow else "output"
        elif c.role == "denoiser" and not can_overflow:
            levels[c.name] = "output"
        else:
            levels[c.name] = "sentinel"
    return levels


def autocast_now() -> AutocastState:
    """The fp16 or fp8 autocast regions open now (:func:`~.autocast.autocast_state`; bf16's cannot overflow)."""
    return tuple((device, dtype) for device, dtype in autocast_state() if dtype in OVERFLOW_DTYPES)


def under_autocast(components: list[Component], autocast: AutocastState) -> dict[str, torch.dtype]:
    """The components that compute under one of the ``autocast`` regions, each with its dtype: the region of the
    device type it computes on (:func:`~.autocast.execution_device_type`)."""
    found = {}
    for c in components:
        dtype = autocast_dtype(autocast, execution_device_type(c.module))
        if dtype is not None:
            found[c.name] = dtype
    return found


def with_projections(
    module: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    unread: tuple[str, ...] = (),
    projections: list[tuple[str, nn.Module]] | None = None,
) -> list[tuple[str, nn.Module]]:
    """``blocks`` and ``projections`` (``module``'s :func:`~.sentinel_blocks.residual_projections` none under
    ``unread`` where not given), in module order: one abs-max a call for them all (the sentinel's fused reduction),
    a hook each."""
    if projections is None:
        projections = residual_projections(module, unread)
    if not projections:
        return blocks
    order = {id(m): i for i, (_, m) in enumerate(module.named_modules())}
    return sorted(blocks + projections, key=lambda pair: order.get(id(pair[1]), len(order)))


class ComponentProbes:
    """One :class:`~diffusion_debug.probes.Probe` per component (see :func:`probe_levels`); their queued
    values are taken per step or per call; paced by step or run (:attr:`pace`, :mod:`.sentinel_pace`)."""

    def __init__(self, config: DebugConfig, *, on_error: Callable[[str, Exception], None]):
        self.level = config.probes
        self.levels: dict[str, str] = {}
        """Each component's probe level at the current attach (:func:`probe_levels`)."""
        self.strict = config.strict
        self.on_error = on_error
        """``on_error(where, error)``: a module the probe could not measure (``strict``: ``Probe.on_raise``)."""
        self.probes: dict[str, Probe] = {}
        self._kept: dict[str, tuple[list, str, Probe, bool, str | None]] = {}
        """Per component: the probe of its last attach, the modules it watches (the memo's list, the same
        object while the tree is unchanged), its level, whether armed, what :attr:`pace` reads of it."""
        self.compiled: list[str] = []
        """Compiled components, left unprobed (measured at their call site, localised by an eager replay)."""
        self.pace = SentinelPace(config.overflow_fraction)
        """The steps the UNet denoisers' sentinels read (the steps' pipeline asks it at every step)."""
        self._reads: dict[str, tuple[set[str | None], str | None]] = {}
        """Per component at this attach: the dtypes in which its module tree was read with full probes
        (:func:`probe_levels`, a set kept in the pipeline's :class:`TreeMemo`, ``shared_memo``, while the
        tree is unchanged) and its dtype now: a component called once per image is read fully once per
        pipeline, by whichever debugger calls it first, again after a change to its tree or dtype or
        :meth:`forget_reads`."""
        self.reading_fully: list[str] = []  # the components this attach reads with full probes (:meth:`fully_read`)
        self.autocast: AutocastState = ()
        """The float16 or fp8 autocast the levels of the last attach were decided under (:func:`autocast_now`)."""
        self._under: tuple[list[Component], dict[str, torch.dtype]] = ([], {})
        """The last attach's components and those of them it found computing under :attr:`autocast`
        (:func:`under_autocast`: a component moved to another device type since is read again)."""

    def attach(
        self, components: list[Component], memo: TreeMemo | None = None, dtypes: dict[str, str | None] | None = None
    ) -> ProbeHandle:
        """Probe every component (none at level ``off``); returns the one handle that removes every probe.
        ``memo``: the modules to probe reused while a tree is unchanged; ``dtypes``: :func:`probe_levels`'."""
        self.levels.clear()  # updated in place: the localiser reads the same dict
        if self.pace.paced:  # (an attach whose handle was not removed)
            self.pace.forget()
        self.autocast = autocast = autocast_now() if ANY_AUTOCAST() else ()  # (no Python call without one)
        self._under = (components, {})
        if self.level == "off":  # (below: the memo's values spelled out, loops: no Python call a component when kept)
            return ProbeHandle()
        memo = memo or TreeMemo()
        current, dtypes = memo.current, dtypes or {}
        under = under_autocast(components, autocast) if autocast else {}  # read fully again under one
        self._under = (components, under)
        first, self._reads = [], {}
        for c in components:
            values = current.get(id(c.module), {})
            done = values["read_fully"] if "read_fully" in values else values.setdefault("read_fully", set())
            dtype = dtypes.get(c.name)
            read = (done, f"{dtype} under {under[c.name]} autocast" if c.name in under else dtype)
            self._reads[c.name] = read
            if read[1] not in done:
                first.append(c.name)
        self.levels.update(probe_levels(components, self.level, dtypes, first, under))
        self.reading_fully = [name for name in first if self.levels[name] == "full"] if first else []
        self.compiled, handles = [], []  # (compiled: as found at this attach; a component may be compiled between)
        paced: dict = {  # by pace group (a literal: no comprehension's frame an attach)
            "steps": ([], []),
            "projected": ([], []),
            "encoders": ([], []),
            "decoders": ([], []),
            None: ([], []),
        }
        outputs = []  # every reused sentinel's hooks, put in by one ForwardHooks (a 1-step call: at every call)
        late = self.pace.left_out() if self._kept else {None: None}  # (fp32, bf16: nothing kept, no call)
        try:
            for component in components:
                name, module = component.name, component.module
                level, values = self.levels[name], current.get(id(module), {})
                if "compile_state" in values:
                    state = values["compile_state"]
                else:
                    state = values["compile_state"] = compile_state(module)
                if state is not None:
                    self.compiled.append(name)  # no hook inside compiled code: see compiled.py
                    continue
                if level == "output":  # checked at its call site; a NaN/Inf is localised by a replay
                    continue
                if ORIG in module._modules and compile_wrapper(module):  # torch.compile(vae): its decode is eager
                    module = module._modules[ORIG]  # probed as itself, names without the "_orig_mod." prefix
                # a float32 stream under float16 autocast: its sublayers' float16 outputs read too (a text encoder's;
                # a float32 transformer denoiser's, whose adaLN gates shrink them before its blocks' outputs)
                # (not one whose first call showed float16 streams its blocks may clip: Flux's, read as on main;
                # _StreamDtype; nor one whose blocks hold no projection block_projections reads)
                projected = name in under and (
                    component.role in _LAYER_STACKS
                    or (
                        component.role == "denoiser"
                        and dtypes.get(name) == "float32"
                        and not _unet(module)
                        and not values.get("clipped_streams")
                        and bool(memo.get(component.module, "block_projections", lambda: block_projections(module)))
                    )
                )
                watched = values.get(("probed", level, component.role, projected))  # the modules to probe
                if watched is None:
                    once = not is_loop_role(component.role)  # called once per image
                    if level == "sentinel" and once and projected:
                        unread = memo.get(component.module, "unread", lambda: unread_modules(component))
                        watched = with_projections(module, inner_blocks(component, overflow_blocks(module)), unread)
                    elif level == "sentinel" and once:
                        watched = inner_blocks(component, overflow_blocks(module))
                    elif level == "sentinel" and component.role == "denoiser":
                        watched = denoiser_blocks(overflow_blocks(module))
                        watched = watched if _unet(module) else stack_ends(module, watched, repeated=True)
                        if projected:  # paced by step, as a UNet's sentinel (below), if its streams are float32
                            # its block lists' ends (a layer of a list), not its patch embedding's float16 output
                            values["stack_ends"] = [m for n, m in watched if n.rsplit(".", 1)[-1].isdigit()]
                            projections = memo.get(
                                component.module, "block_projections", lambda: block_projections(module)
                            )
                            values["projections"] = [m for _, m in projections]
                            watched = with_projections(module, watched, projections=projections)
                    else:
                        watched = probed_modules(module, level)
                    values[("probed", level, component.role, projected)] = watched
                # the probe of the last attach, while the tree (the memo's list) and its level are the same
                kept = self._kept.get(name)
                if kept is not None and kept[0] is watched and kept[1] == level and kept[2]._model() is module:
                    probe, pace = kept[2], kept[4]
                    hooks = None if kept[3] else probe.output_hooks()
                    if hooks is not None:
                        (outputs if late.get(pace) is None else late[pace]).append(hooks)
                    else:
                        handles.append(probe.attach(armed=kept[3]))
                else:
                    hooks = None
                    once = not is_loop_role(component.role)
                    config = self._config(component, level, once, memo)
                    handle = apply_probes(module, config, modules=watched)
                    handles.append(handle)
                    probe = handle.state
                    if self.strict:  # a hook's own error goes through the sink (attributes: no call)
                        probe.on_raise, probe.label = self.on_error, f"probe {name}."
                    # a UNet's sentinel reads some steps (no UNet block clips: an Inf one makes reaches the output),
                    # and a float32 transformer's under float16 autocast with its projections (its blocks clip no
                    # stream: PixArt's, SD3's; _StreamDtype); a component's called once per image some runs, encoders
                    # and decoders apart (its output checked at every call)
                    # (a projected one paced on its own, its step 0 at every call: never left out, late has no list)
                    stepped = component.role == "denoiser" and (projected or _unet(module))
                    pace = (
                        run_group(component.role)
                        if once
                        else ("projected" if projected else "steps")
                        if stepped
                        else None
                    )
                    pace = pace if level == "sentinel" else None
                    self._kept[name] = (watched, level, probe, config.armed, pace)
                if hooks is None and late.get(pace) is not None:  # its hooks in: its group's too (all or none out)
                    outputs += late.pop(pace)
                self.probes[name] = probe
                if pace == "projected" and "clipped_streams" not in values:  # told once a tree (then remembered)
                    handles.append(_StreamDtype(values, probe, self.pace, name))
                paced[pace][0].append(name)
                paced[pace][1].append(probe)
            if outputs:
                handles.append(ForwardHooks(chain.from_iterable(outputs)))
        except BaseException:  # what was added goes before the error does
            ProbeHandle(handles).remove()
            raise
        if not self.probes:  # (fp32, bf16)
            return ProbeHandle(handles)
        # the runs begun with a probe counted; the paced sentinels' hooks found at their first step or run not read
        self.pace.watch(paced, late)
        return ProbeHandle(handles, on_remove=self.pace.forget)

    def _config(self, component: Component, level: str, once: bool, memo: TreeMemo) -> ProbeConfig:
        module = component.module
        # a text encoder's vocabulary head: its logits are discarded, so never measured
        unread = memo.get(module, "unread", lambda: unread_modules(component))
        if level == "sentinel" and (component.role == "denoiser" or once):
            # overflow-prone block outputs only, their abs-maxes one op a call. Not a float32 block output under
            # float16 autocast (ProbeConfig.autocast): a pre-norm block's float32 residual stream goes to a norm,
            # which autocast runs in float32, never to a float16 op, and T5's position_bias carries float32's min
            # (transformers 4.x): read against float16's max, both warned falsely on clean runs
            return ProbeConfig(
                level,
                measure_inputs=False,
                dtypes=OVERFLOW_DTYPES,
                strict=self.strict,
                unread=unread,
                fused=True,
            )
        # every module: one hook armed per call rather than hundreds at each attach; the fp16/bf16
        # abs-maxes taken together, a few ops a call rather than one a tensor
        return ProbeConfig(level, strict=self.strict, unread=unread, armed=level == "full", fused=True)

    def take(self, name: str) -> tuple[str, list[torch.Tensor], Callable] | None:
        """The component's queued values and how to read them (None when not probed); the
        probe starts afresh."""
        probe = self.probes.get(name)
        if probe is None:
            return None
        if self.level == "sentinel" and self.levels.get(name) == "full" and probe.pending:  # a first call, read
            done, dtype = self._reads[name]
            done.add(dtype)
        for module, error in probe.errors:
            self.on_error(f"probe {name}.{module}", RuntimeError(error))
        probe.errors.clear()
        return (name, *probe.take())

    def autocast_changed(self) -> bool:
        """Whether an fp16 or fp8 autocast region was entered or left since the last attach decided the levels (a
        debugger attached before the user's ``with torch.autocast(...)``): asked as a run begins, whose probes are
        then decided again; under the same one, whether a component moved to or from a device type it covers (its
        ``.to("cuda")``, an accelerate hook's execution device: one Python pass a component, under fp16 autocast only).
        Callers ask only where :data:`ANY_AUTOCAST` or :attr:`autocast` (no call otherwise)."""
        now = autocast_now()
        if now != self.autocast:
            return True
        return bool(now) and self.level != "off" and under_autocast(self._under[0], now) != self._under[1]

    def fully_read(self) -> bool:
        """Whether a component read with full probes at this attach has had its (first) call read: the debugger
        then probes again as a later attach would (at a pipeline call's end), its sentinel from the next call on
        (one attach around a serving loop read every call fully); paced by run (:mod:`.sentinel_pace`)."""
        return any(self._reads[name][1] in self._reads[name][0] for name in self.reading_fully)

    def take_all(self) -> list[tuple[str, list[torch.Tensor], Callable]]:
        """:meth:`take` of each probe that holds anything (a step's: the denoiser's alone, or none
        where its sentinel did not read the step)."""
        parts = []
        for name in probes_holding(self.probes):
            part = self.take(name)
            if part is not None:
                parts.append(part)
        return parts

    def reset(self, name: str | None = None, *, but: str | None = None) -> None:
        """Forget what ``name``'s probe (every probe for None, but ``but``'s) has queued."""
        probes = self.probes
        if name is None:
            reset_probes(probes.values(), probes.get(but))
        elif name in probes:
            reset_probes((probes[name],))

    def forget_reads(self) -> None:
        """Read the next call of every component called once per image with full probes again."""
        for done, _ in self._reads.values():
            done.clear()

    def drop_probes(self) -> None:
        """Forget the probes (their hooks go with the handles :meth:`attach` returned); each one is
        kept empty for the next attach, which reuses it while its component's tree and level are
        the same (a 1-step pipeline call attaches at every call)."""
        if self.probes:  # (none in fp32 and bf16)
            reset_probes(self.probes.values())
        for probe in self.probes.values():
            probe.errors.clear()
        self.probes = {}


class _StreamDtype:
    """Whether a projected transformer's streams may be clipped, told by its stack-end blocks' outputs at its first
    call (step 0, read at every call: :attr:`~.sentinel_pace.SentinelPace.projected`), then its hooks go and the tree
    memo's ``values`` remembers the answer either way (a later attach adds no check). PixArt's streams are float32
    (its adaLN gate, a float32 parameter, makes them so) and SD3's float16 but not clipped by its blocks
    (:func:`~.sentinel_blocks.unclipped_float16`, a list of block classes): an Inf a projection makes at a step not
    read reaches the step's output, so their sentinels read their projections at steps 0, 1 and every
    :data:`~.sentinel_pace.SENTINEL_EVERY_PROJECTED`-th of every call. Any other block list ending in float16 (Flux's:
    its x_embedder and gates run in float16, and its blocks clip to +-65504) may hide such an Inf: its projections'
    hooks go at once (the first call's readings kept) and its sentinel leaves the pace, read at every step of every
    call from then on (:meth:`~.sentinel_pace.SentinelPace.read_every_step`), and from the next attach it is read as
    on main (its block lists' ends every step, no projection: hooks and ops a step as main's). Every list's end is
    told (Flux's dual-stream and single-stream lists)."""

    def __init__(self, values: dict, probe: Probe, pace: SentinelPace, name: str):
        self.values, self.probe, self.pace, self.name = values, probe, pace, name
        self.waiting = {id(m) for m in values["stack_ends"]}
        self.handles = [m.register_forward_hook(self._seen) for m in values["stack_ends"]]

    def _seen(self, module: nn.Module, args: object, output: object) -> None:
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        float16 = any(isinstance(o, torch.Tensor) and o.dtype == torch.float16 for o in outputs)
        if float16 and not unclipped_float16(module):
            self.values["clipped_streams"] = True
            self.pace.read_every_step(self.name)  # this call's later steps and calls, as main's
            projections = {id(m) for m in self.values["projections"]}
            for m, hook in self.probe.output_hooks() or ():  # the projections' hooks out, as they went in
                if m is not None and id(m) in projections:
                    for key in [k for k, h in m._forward_hooks.items() if h is hook]:
                        del m._forward_hooks[key]
            self.remove()
            return
        self.waiting.discard(id(module))
        if not self.waiting:  # every list's end told: none clips
            self.values["clipped_streams"] = False
            self.remove()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
