"""Out of memory inside a watched pipeline call or training step: recorded, then re-raised unchanged.

An ``always_call`` forward hook on each watched model (:mod:`~diffusion_debug.probes.call_errors`)
sees ``torch.OutOfMemoryError`` on its way out; the innermost of its blocks on the error's traceback
names the module (hooks on every block would cost each attach and each call). A debugger whose
own hooks already run around each watched call (the diffusion debugger's call sites, with
``CallArgsConfig.on_error``) makes the watch with no ``targets`` and reports through
:meth:`OutOfMemoryWatch.reporter`: two hooks a call, not four. The
anomaly (kind ``out_of_memory``) says the component, module and step, what CUDA had allocated and
reserved, the snapshot file written (on CUDA), and the remedies for that component; events.jsonl
is flushed at once, since the process is likely to end. ``@debugger.watch`` and ``with debugger:``
record an OOM raised outside any hooked module (a backward pass, the pipeline's own code). Given
``other``, the same hooks hand it any other error leaving a hooked call (the training debugger
records the step's error): no hook more.

Limits: the policy does not act on it (the error itself goes on, unchanged, to the caller); the
figures are read after the failed allocation (what was allocated is still held while the error
propagates); a second OOM object for the same failure (re-raised by user code) is recorded again;
the last OOM is held until the next watched call begins or the ``with`` / ``watch`` block ends.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..memory import memory_sample
from ..probes import CallErrorsConfig, ProbeHandle, apply_call_errors, in_backward, register_all
from ..record import make_anomaly
from .memory_files import cuda_in_use, write_memory_snapshot
from .sink import AnomalySink, raised_by_debugger

REMEDIES: dict[str, tuple[str, ...]] = {
    "vae": (
        "pipe.vae.enable_tiling() (decode large images tile by tile)",
        "pipe.vae.enable_slicing() (decode a batch one image at a time)",
        "pipe.enable_model_cpu_offload()",
    ),
    "denoiser": (
        "pipe.enable_attention_slicing() (or memory-efficient SDPA / xformers attention)",
        "pipe.enable_model_cpu_offload() (pipe.enable_sequential_cpu_offload() for the least memory)",
        "a smaller batch (num_images_per_prompt) or a lower height / width",
        "load the model in float16 or bfloat16",
    ),
    "text_encoder": (
        "pipe.enable_model_cpu_offload()",
        "encode the prompt once and pass prompt_embeds",
        "load the text encoder in float16 / bfloat16, or in 8 bits",
    ),
    "pipeline": (
        "pipe.enable_model_cpu_offload()",
        "pipe.enable_attention_slicing(), pipe.vae.enable_tiling() and pipe.vae.enable_slicing()",
        "a smaller batch (num_images_per_prompt) or a lower height / width",
    ),
    "training": (
        "a smaller batch (with gradient accumulation to keep the effective batch)",
        "model.enable_gradient_checkpointing()",
        "mixed precision (Accelerator(mixed_precision='bf16' or 'fp16'))",
        "an 8-bit optimizer (bitsandbytes AdamW8bit) or set_to_none=True in zero_grad()",
    ),
}
FRAGMENTATION = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (reserved is far above allocated: fragmentation)"


def remedies_for(role: str, reserved_mb: float | None = None, allocated_mb: float | None = None) -> list[str]:
    """The concrete remedies for a component of ``role`` (``training`` for a training step)."""
    found = list(REMEDIES.get(role, REMEDIES["denoiser"] if role in ("control", "adapter") else REMEDIES["pipeline"]))
    if reserved_mb is not None and allocated_mb is not None and reserved_mb > 1.5 * allocated_mb + 512:
        found.append(FRAGMENTATION)
    return found


@dataclass(frozen=True)
class Watched:
    """A model whose calls are watched for OOM: its component name, its role (the remedies), the
    modules to hook (qualified name inside the component, module), the phase of its calls and
    whether they happen in the loop (so that the step in progress is theirs)."""

    component: str
    role: str
    modules: list[tuple[str, nn.Module]] = field(default_factory=list)
    phase: str = ""
    in_loop: bool = True


class OutOfMemoryWatch:
    """Records each ``torch.OutOfMemoryError`` once, in the run of ``sink``. ``targets()`` lists the
    models to hook at each attach (None: the caller's hooks report, through :meth:`reporter`),
    ``step()`` is the step in progress; ``fallback`` describes an OOM seen outside every hooked
    module; ``own()`` (optional) is true while the debugger runs a call of its own (a VAE preview, a
    localising replay): an OOM raised then is not the user's and is left to the guard around that
    call, which records it as the debugger's (``debugger_error``); so is one that guard re-raised
    (``strict=True``), which reaches the hooks and the ``with`` block after that call is over."""

    def __init__(
        self,
        sink: AnomalySink,
        targets: Callable[[], list[Watched]] | None,
        step: Callable[[], Any],
        fallback: Watched,
        rank: int = 0,
        own: Callable[[], bool] | None = None,
        other: "Callable[[BaseException, Watched, str], None] | None" = None,
    ):
        self.sink = sink
        self.own = own
        self.other = other
        """``other(error, target, module)``: any other ``Exception`` leaving a hooked call, the same hook
        seeing it (training: the step's error); None: out of memory only."""
        self.other_seen: tuple[Any, ...] = ()
        """The last other error handed to ``other`` in this call, as :func:`raised_at` tells it (not the error:
        its frames hold the call's tensors)."""
        self.targets = targets
        self.step = step
        self.fallback = fallback
        self.rank = rank
        self.count = 0
        self.last: BaseException | None = None
        """The last error recorded, so that the hooks it passes on its way out record it once. It
        holds the failed call's frames: let go when the next watched call begins (:meth:`forget_done`)
        or the ``with`` / ``watch`` block it leaves ends (:meth:`release`)."""

    def attach(self) -> ProbeHandle:
        """Hook each watched model's calls (the first of its modules); the handle removes them
        (none without ``targets``). The blocks are not hooked: the error's traceback names the
        innermost one it passed through."""

        def register():
            for target in self.targets() if self.targets is not None else ():
                if target.modules:
                    errors = (Exception,) if self.other is not None else (torch.OutOfMemoryError,)
                    config = CallErrorsConfig(self.reporter(target), errors=errors, on_start=self.forget_done)
                    yield apply_call_errors(target.modules[0][1], config)

        return register_all(register)

    def reporter(self, target: Watched) -> Callable[[nn.Module, BaseException], None]:
        """``on_error(module, error)`` for an error raised in a call of ``target`` (a hook on its
        first module sees it): recorded, named at the innermost of its modules on the traceback."""
        names: dict[int, str] = {}
        for name, module in target.modules:
            names.setdefault(id(module), name)

        def on_error(module: nn.Module, error: BaseException) -> None:
            self.record(error, target, innermost_module(error, names) or target.modules[0][0])

        return on_error

    def forget_done(self) -> None:
        """A watched call begins: let go of the last error unless it is still in flight (a retry
        made inside the ``except`` block that caught it)."""
        if self.last is not None and sys.exc_info()[1] is not self.last:
            self.last = None
        self.other_seen = ()

    def release(self) -> None:
        """Let go of the last error (its propagation is over as far as we watch)."""
        self.last = None

    def record(self, error: BaseException, target: Watched | None = None, module: str = "") -> None:
        """Record ``error`` (once; ``target``: the watched model it came from, else the fallback),
        never raising: the caller re-raises the user's error. Nothing while the debugger's own
        call runs, nor for its error re-raised with ``strict`` (not held either: its frames are the
        debugger's call's)."""
        if error is self.last or (self.own is not None and self.own()) or raised_by_debugger(error):
            return
        try:
            if not isinstance(error, torch.OutOfMemoryError):  # another error: its frames are not held
                if self.other is not None and target is not None and not in_backward(error):
                    where = raised_at(error)
                    if where != self.other_seen:  # (its hook on an enclosing watched model: once)
                        self.other_seen = where
                        self.other(error, target, module)
                return
            self.last = error
            self._record(error, target or self.fallback, module)
        except Exception as failure:  # the user's OOM must reach them, not ours
            try:
                self.sink.debugger_error("out_of_memory", failure)
            except Exception:  # pragma: no cover
                pass

    def _record(self, error: BaseException, target: Watched, module: str) -> None:
        component, role, phase = target.component, target.role, target.phase
        step = self.step() if target.in_loop else None
        self.count += 1
        sample = memory_sample()
        allocated, reserved = sample.get("cuda_allocated_mb"), sample.get("cuda_reserved_mb")
        snapshot = None
        if cuda_in_use():
            snapshot = write_memory_snapshot(self.sink.record, f"oom-{self.count}")["cuda_snapshot"]
        remedies = remedies_for(role, reserved, allocated)
        anomaly = make_anomaly(
            "out_of_memory",
            component=component,
            module=module,
            step=step,
            rank=self.rank,
            details={
                "error": f"{type(error).__name__}: {str(error)[:500]}",
                "phase": phase,
                "cuda_allocated_mb": allocated,
                "cuda_reserved_mb": reserved,
                "cuda_peak_mb": sample.get("cuda_peak_mb"),
                "rss_mb": sample["rss_mb"],
                "snapshot": snapshot,
                "remedies": remedies,
            },
        )
        self.sink.emit(anomaly)
        # the error itself goes on to the caller: no policy acts on it (a repeat folds into the first)
        self.sink.errors = [e for e in self.sink.errors if e.kind != "out_of_memory"]
        self.sink.record.flush_to_disk()


def raised_at(error: BaseException) -> tuple[Any, ...]:
    """``error`` told from a later one at its freed address: its type and where it was raised (the last entry of
    its traceback, the same in each hook it passes on its way out: the first grows with each frame it leaves),
    never the error itself."""
    raised = error.__traceback__
    while raised is not None and raised.tb_next is not None:
        raised = raised.tb_next
    return (id(error), type(error), raised and raised.tb_frame.f_code, raised and raised.tb_lineno)


def innermost_module(error: BaseException, names: dict[int, str]) -> str | None:
    """The name (in ``names``, by module id) of the innermost module whose call ``error`` passed
    through: the last frame of its traceback whose ``self`` is one of them (``Module.__call__`` and
    ``forward`` frames hold the module as ``self``)."""
    found, frame = None, error.__traceback__
    while frame is not None:
        owner = frame.tb_frame.f_locals.get("self")
        if owner is not None and (name := names.get(id(owner))) is not None:
            found = name
        frame = frame.tb_next
    return found
