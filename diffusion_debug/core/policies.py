"""The policy table: one row per policy, acting through :class:`PolicyTarget`, the small
interface each debugger implements (see the package docstring for what each policy means)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from ..config import DebugConfig
from ..errors import ConfigError, DiffusionDebugError
from ..record import Anomaly


class PolicyTarget(Protocol):
    """What a debugger does for the policies, on a private object of its own (training's
    ``StepPolicy``, the pipeline debugger's ``_PipelinePolicy``): the rows of :data:`POLICY_TABLE`
    call these. A target leaves out the actions it cannot take (a pipeline has no ``skip_step``),
    and a policy that needs one is refused up front (:func:`check_policy`)."""

    def save_run(self) -> Path:
        """Save the run directory (the one process that writes it) and return it."""

    def agree(self) -> None:
        """Every process leaves the decision together (one process: nothing to wait for)."""

    def skip_step(self, errors: list[Anomaly]) -> None:
        """Make this step's update add nothing (training)."""

    def stop(self, anomaly: Anomaly) -> str | None:
        """End the loop after this step: None, or why it cannot (the policy raises instead)."""


@dataclass(frozen=True)
class Policy:
    """One row of the policy table: what it does with a step's errors (returns the action taken,
    for the step's record), and the :class:`PolicyTarget` method a debugger needs for it."""

    name: str
    act: Callable[[PolicyTarget, list[Anomaly]], str | None]
    needs: str | None = None
    refusal: str = ""
    """Why a debugger without ``needs`` cannot follow it (completes "cannot be used with X: ...")."""


def _nothing(target: PolicyTarget, errors: list[Anomaly]) -> None:
    return None  # record: the sink recorded it; warn: the sink warned as it emitted


def _skip(target: PolicyTarget, errors: list[Anomaly]) -> str:
    target.skip_step(errors)
    return "skip"


def _raise(target: PolicyTarget, errors: list[Anomaly], reason: str = "") -> None:
    """Save the run directory, then raise :func:`policy_error`; a save that fails still raises a
    DiffusionDebugError for the anomaly, saying why nothing was saved."""
    anomaly, failed = errors[0], None
    try:
        run_dir = target.save_run()
    except Exception as save_error:  # the user gets a DiffusionDebugError either way
        failed = save_error
    finally:
        target.agree()  # every process raises together: nobody waits in a collective
    if failed is not None:
        raise DiffusionDebugError(
            f"{anomaly.kind} at {anomaly.where()}: {anomaly.message} The report could not be saved "
            f"({type(failed).__name__}: {str(failed)[:200]}){reason}.",
            anomaly=anomaly,
            run_dir=None,
        ) from failed
    raise policy_error(anomaly, run_dir, reason)


def _stop(target: PolicyTarget, errors: list[Anomaly]) -> str:
    reason = target.stop(errors[0])
    if reason is not None:
        _raise(target, errors, reason)
    return "stop"


POLICY_TABLE: dict[str, Policy] = {
    policy.name: policy
    for policy in (
        Policy("record", _nothing),
        Policy("warn", _nothing),
        Policy(
            "skip",
            _skip,
            needs="skip_step",
            refusal="it skips an optimizer step, and a pipeline has none; use 'stop' or 'raise'",
        ),
        Policy("raise", _raise),
        Policy("stop", _stop, needs="stop"),
    )
}
"""The policies, by the name ``DebugConfig.policy`` takes (``config.POLICIES`` lists the same
names, for validation below this layer; a test keeps the two equal)."""


def check_policy(config: DebugConfig, target: type, who: str) -> None:
    """Reject, before any work starts, a policy whose action ``target`` (a debugger's policy-target
    class) lacks."""
    policy = POLICY_TABLE[config.policy]
    if policy.needs is not None and not callable(getattr(target, policy.needs, None)):
        raise ConfigError(f"Policy {config.policy!r} cannot be used with {who}: {policy.refusal}.")


def apply_policy(config: DebugConfig, target: PolicyTarget, errors: list[Anomaly]) -> str | None:
    """Act on a step's errors as ``config.policy`` says; returns the action taken (or None)."""
    return POLICY_TABLE[config.policy].act(target, errors) if errors else None


def policy_error(anomaly: Anomaly, run_dir: Any, reason: str = "") -> DiffusionDebugError:
    """The error policy ``raise`` raises for ``anomaly`` (the run directory already saved)."""
    return DiffusionDebugError(
        f"{anomaly.kind} at {anomaly.where() or 'the run'}: {anomaly.message}{reason} (run directory: {run_dir})",
        anomaly=anomaly,
        run_dir=run_dir,
    )
