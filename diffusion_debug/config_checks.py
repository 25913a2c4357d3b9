"""How a config value is checked, and how a bad one is told: each check raises one ConfigError
sentence naming the key; a hostile value (a YAML alias bomb) is shown short, never in full.

>>> _check_number("overflow_fraction", "half")
Traceback (most recent call last):
...
diffusion_debug.errors.ConfigError: Config key 'overflow_fraction' must be a number, not 'half'.
"""

from __future__ import annotations

import difflib
import numbers
import os
import reprlib
from typing import Any

from .errors import ConfigError

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 2, 4, 4, 4


def _short(value: Any) -> str:
    """A short repr for messages: a hostile value (a YAML alias bomb) is never expanded in full."""
    text = _REPR.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _choice_message(key: str, value: Any, choices: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(value, choices, n=1, cutoff=0.5) if isinstance(value, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"Config key {key!r} must be one of {', '.join(map(repr, choices))}, not {_short(value)}{hint}."


def _check_type(key: str, value: Any, kind: type) -> None:
    if not isinstance(value, kind):
        raise ConfigError(f"Config key {key!r} must be a {kind.__name__}, not {type(value).__name__} {_short(value)}.")


def _check_plain_name(key: str, value: str) -> None:
    """A name used as one directory below ``output_dir``: no separator, no NUL, not . or .."""
    bad = not value or value in (".", "..") or "\x00" in value or any(sep in value for sep in ("/", "\\", os.sep))
    if bad:
        raise ConfigError(f"Config key {key!r} must be a plain directory name, not {_short(value)}.")


def _check_number(key: str, value: Any) -> float:
    """``value`` as a plain int or float: any real number (numpy's too), not a bool or NaN."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value:
        raise ConfigError(f"Config key {key!r} must be a number, not {_short(value)}.")
    return value if type(value) in (int, float) else float(value)


def _check_stability(config: Any) -> None:
    """The stability actions' keys (each off by its default)."""
    clip = config.clip_grad_on_explosion
    if clip is not None and not _check_number("clip_grad_on_explosion", clip) > 0:
        raise ConfigError(f"Config key 'clip_grad_on_explosion' must be positive or None, not {_short(clip)}.")
    config.__dict__["lr_reduce_after_spikes"] = _check_int("lr_reduce_after_spikes", config.lr_reduce_after_spikes, 0)
    if not 0 < _check_number("lr_reduce_factor", config.lr_reduce_factor) < 1:
        raise ConfigError(f"Config key 'lr_reduce_factor' must be in (0, 1), not {_short(config.lr_reduce_factor)}.")
    if _check_number("restore_finite_weights_mb", config.restore_finite_weights_mb) < 0:
        raise ConfigError("Config key 'restore_finite_weights_mb' must be >= 0 (0: off).")


def _check_int(key: str, value: Any, least: int, most: int | None = None) -> int:
    """``value`` as a plain int: any integer (numpy's too), not a bool; ``most``: the largest
    accepted (a size the debugger allocates, or a number a table must hold)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ConfigError(f"Config key {key!r} must be an integer >= {least}, not {_short(value)}.")
    if most is not None and value > most:
        raise ConfigError(f"Config key {key!r} must be at most {most}, not {_short(value)}.")
    return int(value)
