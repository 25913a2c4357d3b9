"""A GradScaler the script uses but did not pass (``monitor_training_step(scaler=...)``, no Accelerate): found,
put on trial, and once confirmed read as if passed, with one ``scaler_not_passed`` warning.

Without it the scaled gradients read as they are: a 65536x norm is a ``gradient_explosion`` (and an
``lr_spike`` of SGD's foretold update), each overflow the scaler skips a ``nonfinite`` error, which policy
``raise`` stops a healthy run at. So, where an optimizer's first monitored step looks scaled (its norm above
``grad_explosion_threshold``, or non-finite: a scaler scales from its first step) with no scaler known, one
walk of the garbage collector's list finds the enabled ``torch.amp.GradScaler``\\ s alive (none on trial for
another optimizer). Each goes on trial, with the per-optimizer state it holds then (``scaler.step`` writes
this optimizer's stage into it; ``update()`` replaces it). A clean step costs a comparison and a set look-up;
an optimizer is searched once, never after a step of it read clean (a later NaN, with a stale scaler alive, is
read at its own step) (keyed by a weak reference: a later optimizer at a reused id is searched again). Under
``launch`` nothing is walked (it notes what the script makes, and its patched ``GradScaler.scale`` passes the
scaler of every loss it scaled).

The suspicious step's verdict waits until the trial can be decided: at a later monitored step once the held
state shows the scaler stepped this optimizer (a GAN's next step, of the other optimizer), else at this
optimizer's next step or once the scaler updated without stepping it, or at close. Held, nothing of it is
emitted, counted or acted on. A scaler whose held state says ``scaler.step`` stepped this optimizer is
confirmed: the held step's anomalies are read unscaled (an explosion still named where its norm over the scale
passes the threshold, a non-finite gradient an info), its skip counted (``found_inf`` of that state), and from
then on its gradients are measured under that scaler. A trial not confirmed (a stale scaler nobody steps, or
another optimizer's) is dropped: the held anomalies are emitted as read, with their own step, and the policy
acts on them then, a monitored step late. Nothing is divided by an unconfirmed scale. So a real NaN at a run's
first step that looks scaled, with an enabled GradScaler alive that does not step it, is raised by policy
``raise`` at the optimizer's next step, after ``optimizer.step()`` applied it (the trade for never stopping a
healthy scaled run at its first overflow). Several processes (DDP without Accelerate): the ranks hold together (the
all-reduced gradients give every rank one norm; the same script, the same scalers), a holder asks for the step's
detail exchange, and where the step's reduce says some rank held none (its NaN loss, a failure, a norm below the
threshold) the holders release the step in place (``StepMonitor._held_alone``): every rank judges the same
anomalies in the same step, and a release at a later step goes through that step's exchange; an optimizer whose
step was released in place is searched once more at its next step that looks scaled, so the ranks that held and
the one that did not (a NaN loss at the first step) hold together there. Limits: a rank that alone finds no scaler
on its heap is not told apart (it reads the step as scaled; the policy still acts alike on every rank, from the
exchange); once confirmed, the held step's recorded row is read unscaled (``RunRecord.amend_step``: the kept row
and the stream, every rank's norm in it too) on its own rank, and the main process's copy of that one row (from its
detail exchange) at the main's next report (``amend_rank_step``); each is the row taken at the held step's
monitored step (``joined``), not another row of its step number (a later one the loop repeated, or the other
optimizer's of a GAN monitored twice a step); at close a pending trial is decided the same way, with no policy
after it, except where the optimizer has not stepped since (the script failed between the monitor and
``scaler.step``, maybe for the NaN itself): undecided, its anomalies go out as read (a real NaN stays an error)
with one ``scaler_not_passed`` warning saying they may be scaled; a report before the trial can be decided leaves
it pending (the report lacks that one step) unless ``optimizer.step()`` ran with no scaler stepping it (then the
step was unscaled: read as it is). A scaler whose state says it stepped the optimizer already at the suspicious
step (a stale one's, stopped before ``update()``, at a reused id) is not tried.

A GAN's other optimizer (one GradScaler stepping a generator's and a discriminator's): its scaled norm may read
clean (684.9 under 1024: never searched), yet the confirmed scaler steps it too. Each per-optimizer state a confirmed
scaler held is looked at once ``update()`` replaced it (:meth:`FoundScalers.scaler_for`, only where a scaler was
confirmed): every optimizer it says was stepped there is that scaler's from its next step on, and its last row in
that state, read with no scaler, is read unscaled by the monitor (:attr:`FoundScalers.learnt`). Limits: only that
last row (an optimizer monitored twice in one state keeps its earlier row as read); anomalies its scaled rows raised
before (an explosion of a norm over the threshold while another optimizer's trial was pending) stay as emitted.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import weakref
from typing import Any

import torch

from ...record import Anomaly, make_anomaly
from ...record.anomaly import rebuilt
from ..judges.live_objects import noting
from ..measure.optimizer_state import raw_optimizer, scale_tensor


@dataclasses.dataclass
class Trial:
    """A suspicious step's verdict held while its scalers are tried (see the module docstring)."""

    optimizer: weakref.ref
    key: int
    candidates: list[tuple[weakref.ref, Any, float]]
    """Each scaler, the per-optimizer state it held at the step and its scale then."""
    step: Any
    held: list[Anomaly]
    ran: list = dataclasses.field(default_factory=list)
    """Not empty once ``optimizer.step()`` ran after the held step (its step hook): a loop that went on."""
    hook: Any = None
    max_grad_norm: float | None = None
    """The held step's ``max_grad_norm``: its row's ``grad_norm_clipped`` read anew from the unscaled norm."""
    joined: int | None = None
    """The held step's monitored step (``History.joined``): what names its row's copy on the main process."""

    def end(self) -> None:
        if self.hook is not None:
            self.hook.remove()


class FoundScalers:
    """The scalers found for optimizers the script monitored without ``scaler=`` (see the module docstring)."""

    def __init__(self, explosion: float, update_ratio: float) -> None:
        self.explosion = explosion
        self.update_ratio = update_ratio
        self.trial: Trial | None = None
        self.any_confirmed = False
        """Whether any is confirmed: a step that asks for its optimizer's reads no dictionary before."""
        self._searched: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        """The optimizers searched, and those whose step read clean before any looked scaled (not searched: a
        scaler scales from its first step; a later NaN with a stale scaler alive is read at its own step)."""
        self.clean_ids: set[int] = set()
        """The ids of the optimizers marked clean: each marked once (a GAN's alternate; the weak keys above, not
        these ids, say what was searched: a later optimizer at a reused id is not taken for a dead one)."""
        self._confirmed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._warned = False
        self._skip_read: Any = None
        """The per-optimizer state whose skip was counted: one ``update()`` skips every optimizer it found Inf in
        (a GAN's two), counted once, as the scale's fall counts it for a scaler passed."""
        self.confirmed_at: tuple[Any, float, float | None, int | None] | None = None
        """The held step just confirmed, its scale, its ``max_grad_norm`` and its monitored step (``joined``): its
        recorded row to unscale (:func:`unscaled_values`)."""
        self._following: list[list] = []
        """Each confirmed scaler (weakly), the per-optimizer state it held when last looked at, its scale then and
        the first monitored step (``joined``) since: once ``update()`` replaced that state, the optimizers it
        stepped in it are known (:meth:`_look_back`)."""
        self._stepped_by: dict[int, weakref.ref] = {}
        """``id`` of an optimizer a confirmed scaler stepped (a GAN's other one, whose own norm read clean) -> that
        scaler: confirmed for it at its next step (:meth:`scaler_for`)."""
        self._confirmed_ids: set[int] = set()
        self.learnt: list[tuple[int, float, int]] = []
        """Optimizers just found stepped by a confirmed scaler: ``id``, the scale and the first monitored step of
        the state it stepped them in; their row in it, read with no scaler, is to unscale (the monitor takes them)."""

    def scaler_for(self, optimizer: Any, joined: int | None = None) -> Any:
        """The scaler confirmed for ``optimizer``, or None; ``joined``: this monitored step's (a state the scaler
        holds from here on is followed from it)."""
        if self._following:
            self._look_back(joined)
        raw = raw_optimizer(optimizer)
        try:
            ref = self._confirmed.get(raw)
        except TypeError:  # not weakly referable: never searched, never confirmed
            return None
        if ref is None and self._stepped_by:  # stepped by a confirmed one (a GAN's other optimizer)
            ref = self._stepped_by.pop(id(raw), None)
            if ref is not None:
                self._confirmed[raw] = ref
                self._confirmed_ids.add(id(raw))
        scaler = None if ref is None else ref()
        return scaler if scaler is not None and scaler.is_enabled() else None

    def clean(self, optimizer: Any) -> None:
        """``optimizer``'s step read clean (not searched from now on)."""
        raw = raw_optimizer(optimizer)
        self.clean_ids.add(id(optimizer))
        if raw is not None:
            try:
                self._searched.setdefault(raw, True)
            except TypeError:  # not weakly referable (``__slots__`` without ``__weakref__``): never searched
                pass

    def search_again(self, trial: Trial) -> None:
        """``trial``'s optimizer searched once more at its next step that looks scaled: its held step was
        released in place because another rank held nothing (a NaN loss there, a failed rank), so the ranks
        that searched and those that did not would otherwise read every later step apart. Once only."""
        raw = trial.optimizer()
        if raw is not None and raw in self._searched and self._searched[raw] is True:
            self._searched[raw] = False

    def hold(
        self,
        optimizer: Any,
        step: Any,
        anomalies: list[Anomaly],
        max_grad_norm: float | None = None,
        joined: int | None = None,
    ) -> bool:
        """At a step that looks scaled with no scaler known: search once for ``optimizer``; True when scalers
        went on trial (``anomalies``, the step's verdict as read, are then held; ``max_grad_norm`` and ``joined``,
        its monitored step, the step's)."""
        raw = raw_optimizer(optimizer)
        if raw is None or self.trial is not None or noting() or (raw in self._searched and self._searched[raw]):
            return False  # (launch walks no heap: its patched GradScaler.scale passes every scaler it saw)
        try:
            self._searched[raw] = True if raw not in self._searched else "again"
        except TypeError:  # not weakly referable: not searched (read as it is)
            return False
        candidates = []
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.amp.GradScaler) and obj.is_enabled() and scale_tensor(obj) is not None:
                if _stepped(obj._per_optimizer_states.get(id(raw))):
                    continue  # stepped already before this step (a stale one's, at a reused id): proves nothing
                candidates.append((weakref.ref(obj), obj._per_optimizer_states, float(obj.get_scale())))
        if not candidates:
            return False
        held = list(anomalies)
        trial = Trial(weakref.ref(raw), id(raw), candidates, step, held, max_grad_norm=max_grad_norm, joined=joined)
        if hasattr(raw, "register_step_post_hook"):  # (the list alone in its closure: no cycle to the optimizer;
            ran = trial.ran  # one entry at most, should a debugger never closed leave the hook on)
            trial.hook = raw.register_step_post_hook(lambda *_: ran or ran.append(True))
        self.trial = trial  # (after the hook: a hook that failed to register leaves nothing held)
        return True

    def resolve(self, optimizer: Any, at: Any) -> tuple[list[Anomaly], list[Anomaly]] | None:
        """Decide the trial at a monitored step ``at`` of ``optimizer`` (None: close): the held step's
        anomalies to emit and its ``skipped_step`` (one or none); None while it still waits (another
        optimizer's step before the held one's ``scaler.step``: a loop that monitors both, then steps both)."""
        trial = self.trial
        raw = trial.optimizer()
        now = None if optimizer is None else raw_optimizer(optimizer)
        waiting = False
        for ref, states, scale in trial.candidates:
            scaler = ref()
            entry = states.get(trial.key) if raw is not None and scaler is not None else None
            if not _stepped(entry):
                # not stepped by it yet: dropped once updated since, or at the held optimizer's next step
                waiting = waiting or (scaler is not None and scaler._per_optimizer_states is states)
                continue
            self.trial = None
            trial.end()
            self._confirmed[raw], self.any_confirmed = ref, True
            self._confirmed_ids.add(trial.key)
            if trial.joined is not None and not any(f[0] is ref for f in self._following):
                self._following.append([ref, states, scale, trial.joined + 1])  # the held row's own: unscaled apart
            self.confirmed_at = (trial.step, scale, trial.max_grad_norm, trial.joined)
            updated = scaler._per_optimizer_states is not states  # (update() summed them into the first)
            found_inf = found_inf_by_optimizer(states, updated).get(trial.key, 0.0)
            skipped = [] if states is self._skip_read else self._skip(trial, scale, scaler, found_inf, at)
            if skipped:
                self._skip_read = states
            return self._unscaled(trial, scale, scaler), skipped
        if waiting and raw is not None and now is not raw and at != "close" and not trial.ran:
            return None  # another optimizer's step, or a report's (the report lacks the held step until decided)
        self.trial = None  # (ran with no scaler stepping it: optimizer.step() ran alone, the step was unscaled)
        trial.end()
        if waiting and raw is not None and now is None and not trial.ran and trial.hook is not None:
            return [*trial.held, self._undecided(trial)], []  # close with no step since: a crash (maybe the NaN's)
        return trial.held, []

    def _look_back(self, joined: int | None) -> None:
        """Each followed scaler whose ``update()`` replaced the state last looked at: the optimizers that state says
        it stepped are its own (a GAN's two, one ``GradScaler``; the other's norm, scaled, may read clean and never
        be searched), confirmed for it at their next step, their rows since that state began listed in
        :attr:`learnt` (read with no scaler: to unscale by its scale then), once (one never monitored is not listed
        at every update). Then the new state is followed."""
        for entry in self._following:
            ref, states, scale, since = entry
            scaler = ref()
            if scaler is None or scaler._per_optimizer_states is states:
                continue
            for key, state in list(states.items()):
                if key not in self._confirmed_ids and key not in self._stepped_by and _stepped(state):
                    self._stepped_by[key] = ref
                    self.learnt.append((key, scale, since))
            entry[1], entry[2] = scaler._per_optimizer_states, float(scaler.get_scale())
            entry[3] = since if joined is None else joined

    def _undecided(self, trial: Trial) -> Anomaly:
        """At close, a trial never decided: the held step's anomalies go out as read (a real NaN stays an error,
        the error that may have stopped the script) with one ``scaler_not_passed`` warning saying they may be
        scaled (their kinds in its details)."""
        live = [(ref(), scale) for ref, _, scale in trial.candidates if ref() is not None]
        scaler, scale = live[0] if live else (None, trial.candidates[0][2])
        return _not_passed(trial, scale, scaler, undecided=sorted({a.kind for a in trial.held}))

    def _unscaled(self, trial: Trial, scale: float, scaler: Any) -> list[Anomaly]:
        out = []
        for a in trial.held:
            if a.kind == "nonfinite":
                a = rebuilt(a, severity="info", details={**a.details, "grad_scale": scale})
            elif a.kind == "gradient_explosion":
                norm = a.details["grad_norm"] / scale
                if not norm > self.explosion:
                    continue
                a = rebuilt(a, details={**a.details, "grad_norm": norm, "grad_scale": scale})
            elif a.kind == "lr_spike" and a.details.get("reason") == "update_ratio":
                ratio = a.details["update_to_weight_ratio"] / scale
                if not ratio > self.update_ratio:
                    continue
                a = rebuilt(a, details={**a.details, "update_to_weight_ratio": ratio, "grad_scale": scale})
            out.append(a)
        if not self._warned:
            self._warned = True
            out.insert(0, _not_passed(trial, scale, scaler))
        return out

    @staticmethod
    def _skip(trial: Trial, scale: float, scaler: Any, found_inf: float, at: Any) -> list[Anomaly]:
        if not found_inf > 0:
            return []
        after = float(scaler.get_scale())
        details = {
            "scale_before": scale,
            "scale_after": after if math.isfinite(after) else None,
            "detected_at_step": at,
            "reason": "grad_scaler",
        }
        return [
            make_anomaly(kind="skipped_step", severity="info", component="model", step=trial.step, details=details)
        ]


_SCALED = ("grad_norm", "max_update_to_weight_ratio")
_SCALED_MODULES = ("top_module_grad_norms", "bottom_module_grad_norms")


def unscaled_values(row: dict[str, Any], scale: float, max_grad_norm: float | None = None) -> dict[str, Any]:
    """The fields of a held step's recorded ``row`` that its confirmed scaler's ``scale`` multiplied, over it, and
    the scale (a non-finite value, kept as its string, stays; the modules' order is the same): under several
    processes every rank's norm too (``grad_norms_by_rank``, the extremes in ``ranks``: DDP's ranks share one
    scale). ``grad_norm_clipped`` (whether ``clip_grad_norm_(max_grad_norm)`` clips) is read anew from the
    unscaled norm where the step's ``max_grad_norm`` is given (else it was None: unknown).

    >>> unscaled_values({"grad_norm": 131072.0, "grad_norm_clipped": True, "top_module_grad_norms": {"0": 65536.0},
    ...                  "grad_norms_by_rank": [131072.0, "inf"], "ranks": {"grad_norm": {"min": 131072.0,
    ...                  "min_rank": 0, "max": "inf", "max_rank": 1}}}, 65536.0, max_grad_norm=100.0)
    ... # doctest: +NORMALIZE_WHITESPACE
    {'grad_scale': 65536.0, 'grad_norm': 2.0, 'grad_norm_clipped': False, 'top_module_grad_norms': {'0': 1.0},
     'grad_norms_by_rank': [2.0, 'inf'], 'ranks': {'grad_norm': {'min': 2.0, 'min_rank': 0, 'max': 'inf',
     'max_rank': 1}}}
    """
    values: dict[str, Any] = {"grad_scale": scale}
    for name in _SCALED:
        if _number(row.get(name)):
            values[name] = row[name] / scale
    if max_grad_norm is not None and "grad_norm" in values and not math.isnan(values["grad_norm"]):
        values["grad_norm_clipped"] = bool(values["grad_norm"] > max_grad_norm)  # as StepRow.clipped reads it
    for name in _SCALED_MODULES:
        if isinstance(row.get(name), dict):
            values[name] = {k: v / scale if _number(v) else v for k, v in row[name].items()}
    if isinstance(row.get("grad_norms_by_rank"), list):
        values["grad_norms_by_rank"] = [v / scale if _number(v) else v for v in row["grad_norms_by_rank"]]
    ranks = row.get("ranks")
    if isinstance(ranks, dict) and isinstance(ranks.get("grad_norm"), dict):
        norm = {k: v / scale if k in ("min", "max") and _number(v) else v for k, v in ranks["grad_norm"].items()}
        values["ranks"] = {**ranks, "grad_norm": norm}
    return values


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def found_inf_by_optimizer(states: Any, updated: bool) -> dict[int, float]:
    """Each optimizer's own Inf/NaN count in a GradScaler's per-optimizer state (keyed by ``id`` of the optimizer
    ``scaler.step`` was given), ``updated``: the state ``update()`` read. ``update()`` sums every optimizer's count
    into the first one's tensor in place (``found_inf_combined += ...``: on the scale's device ``.to`` is that
    tensor itself), so there the first holds the sum: its own is that less the others'.

    >>> import torch
    >>> states = {1: {"found_inf_per_device": {"cpu": torch.tensor(1.0)}},
    ...           2: {"found_inf_per_device": {"cpu": torch.tensor(1.0)}}}
    >>> found_inf_by_optimizer(states, updated=True), found_inf_by_optimizer(states, updated=False)
    ({1: 0.0, 2: 1.0}, {1: 1.0, 2: 1.0})
    """
    counts = [
        (key, float(t.sum()))
        for key, state in list(states.items())
        if isinstance(state, dict)
        for t in state.get("found_inf_per_device", {}).values()
    ]
    if updated and len(counts) > 1:
        counts[0] = (counts[0][0], counts[0][1] - sum(c for _, c in counts[1:]))
    out: dict[int, float] = {}
    for key, count in counts:
        out[key] = out.get(key, 0.0) + count
    return out


def _stepped(entry: Any) -> bool:
    """Whether a GradScaler's per-optimizer state says ``scaler.step`` stepped that optimizer."""
    return entry is not None and getattr(entry.get("stage"), "name", "") == "STEPPED"


def _not_passed(trial: Trial, scale: float, scaler: Any, undecided: list[str] | None = None) -> Anomaly:
    rank = trial.held[0].rank if trial.held else 0
    details: dict[str, Any] = {
        "grad_scale": scale,
        "scaler": type(scaler).__name__ if scaler is not None else "GradScaler",
    }
    if undecided is not None:  # never seen stepping it: the kinds held, neither confirmed nor ruled out
        details["undecided"] = undecided
    return make_anomaly(
        kind="scaler_not_passed",
        severity="warning",
        component="optimizer",
        step=trial.step,
        rank=rank,
        details=details,
    )
