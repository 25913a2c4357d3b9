"""The exceptions diffusion-debug raises."""

from __future__ import annotations

from typing import Any


class DiffusionDebugError(Exception):
    """Raised by diffusion-debug: bad input, or policy ``"raise"`` on an anomaly.

    When raised by policy, ``anomaly`` is the anomaly that triggered it and ``run_dir`` the
    run directory that was saved before raising (``None`` for input errors).
    """

    def __init__(self, message: str, *, anomaly: Any = None, run_dir: Any = None):
        super().__init__(message)
        self.anomaly = anomaly
        self.run_dir = run_dir


class ConfigError(DiffusionDebugError, ValueError):
    """A configuration key or value that cannot be used."""


class UnbalancedRelease(RuntimeWarning):
    """A release of something diffusion-debug holds by count (``probes.copies``' patch) with no hold
    left: a bug of ours, warned and not raised so that a user's run goes on (our test suite makes it
    an error)."""
