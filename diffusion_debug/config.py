"""DebugConfig: what the debuggers watch, how they react, and where they write.

>>> DebugConfig(level="extreme").probes
'full'
>>> DebugConfig(levl="basic")
Traceback (most recent call last):
...
diffusion_debug.errors.ConfigError: Unknown config key 'levl'; did you mean 'level'?

Options left as ``None`` take their value from ``level`` (the presets, also shipped as
``configs/basic.yaml``, ``configs/advanced.yaml``, ``configs/extreme.yaml``); an option given
explicitly always wins over the level.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import numbers
import os
import reprlib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from .errors import ConfigError

LEVELS = ("basic", "advanced", "extreme")
POLICIES = ("record", "warn", "skip", "raise", "stop")
PROBE_MODES = ("sentinel", "full", "off")
AUTOGRAD_ANOMALY_MODES = ("detect", "warn", "raise")
SEVERITIES = ("info", "warning", "error")
STALL_ACTIONS = ("wait", "exit")

# What each level turns on.  Keys are DebugConfig fields whose default is None.
PRESETS: dict[str, dict[str, Any]] = {
    "basic": dict(
        probes="sentinel",
        localize=True,
        previews=False,
        preview_vae_every=0,
        memory_tracking=False,
        repro_bundle=False,
        per_module_grad_norms=False,
    ),
    "advanced": dict(
        probes="sentinel",
        localize=True,
        previews=True,
        preview_vae_every=0,
        memory_tracking=True,
        repro_bundle=True,
        per_module_grad_norms=True,
    ),
    "extreme": dict(
        probes="full",
        localize=True,
        previews=True,
        preview_vae_every=5,
        memory_tracking=True,
        repro_bundle=True,
        per_module_grad_norms=True,
    ),
}

# The largest values of the int options that size something: beyond them a run only fails late
# (an OverflowError once the pipeline loaded) or allocates for nothing.
MAX_HISTORY_SIZE = 10_000_000
"""``history_size``: ring buffers of this many step rows and events each (and 10x as many anomalies)."""
MAX_LOSS_SPIKE_WINDOW = 100_000
"""``loss_spike_window``: the window is sorted at every monitored step."""
MAX_TIMESTEP_BUCKETS = 10_000
"""``timestep_buckets``: 3 values per bucket ride in every step's transfer (schedulers train on
1000 timesteps: more buckets than timesteps stay empty)."""
MAX_STEP_OFFSET = 10**12
"""``step_offset``: every recorded step number stays an exact int64 (a parquet export) and float64."""

# Other names for two options, accepted in config files (in code, the message names the field).
ALIASES = {"debug_output_dir": "output_dir", "enable_memory_debugging": "memory_tracking"}
# Old names of this package, accepted everywhere (keyword or file) with a DeprecationWarning.
DEPRECATED = {"debug_level": "log_level", "save_debug_info": "stream_events"}


@dataclass(init=False)
class DebugConfig:
    """All options of both debuggers. Every field is validated on construction."""

    # -- stable keys ------------------------------------------------------------------
    level: str = "advanced"
    """``basic`` (sentinel probes, NaN/Inf localisation), ``advanced`` (+ previews, memory,
    repro bundles, per-module gradient norms), ``extreme`` (+ full probes on every module,
    VAE-decoded previews)."""
    output_dir: str = "debug_output"
    """Run directories are created below this."""
    policy: str = "record"
    """On an anomaly of severity error: ``record`` it, ``warn`` (Python warning), ``skip`` the
    optimizer step (training), ``raise`` DiffusionDebugError, or ``stop`` the pipeline loop."""
    strict: bool = False
    """Re-raise the debugger's own internal errors instead of going on without them (each is still
    recorded once, as a ``debugger_error`` that says it was raised: the run may end there)."""

    # -- what is watched (None: from level) --------------------------------------------
    probes: str | None = None
    """``sentinel`` (block outputs), ``full`` (every module) or ``off``."""
    localize: bool | None = None
    """Replay a call that went non-finite with full probes to name the producing module."""
    previews: bool | None = None
    """Cheap latent-to-RGB preview of every denoising step."""
    preview_vae_every: int | None = None
    """Also decode the latents with the real VAE every N steps (0: never)."""
    memory_tracking: bool | None = None
    """Process RSS and CUDA memory per step and per component."""
    repro_bundle: bool | None = None
    """Save the inputs of the first failing component call for an offline replay."""
    per_module_grad_norms: bool | None = None
    """Training: gradient norm of every module, not only the global one."""
    cuda_synchronize: bool = False
    """Synchronise around timed component calls on CUDA (exact times, some overhead)."""

    # -- thresholds ---------------------------------------------------------------------
    overflow_fraction: float = 0.5
    """overflow_risk when an fp16/bf16 activation's abs-max passes this share of the dtype max."""
    latent_std_tolerance: float = 4.0
    """latent_divergence when the latent std is this many times off the scheduler's sigma."""
    vae_saturation_fraction: float = 0.05
    """vae_saturation when more than this share of decoded pixels lies outside [-1, 1]."""
    loss_spike_window: int = 50
    """Steps of the rolling median the loss is compared with (at most 100000)."""
    loss_spike_threshold: float = 6.0
    """loss_spike when the loss is this many robust deviations (MAD) above the rolling median."""
    loss_spike_min_ratio: float = 2.0
    """... and also above (1 + this) x the window's 90th percentile: a relative floor, so the tiny
    noise of a converged loss (6e-10 +- 1e-10), the first noisy steps, and the heavy tail of
    small-timestep batches are no spike."""
    grad_explosion_threshold: float = 1e3
    grad_vanishing_threshold: float = 1e-7
    lr_jump_factor: float = 10.0
    """lr_spike when a param group's learning rate rises more than this factor between monitored
    steps, above every earlier value (warmup from 0 and cosine restarts are not jumps)."""
    update_ratio_threshold: float = 1.0
    """lr_spike when a module's update-to-weight ratio (lr x grad norm / weight norm, with
    per-module gradient norms) passes this: the step would move the weights by their own size."""
    memory_growth_mb: float = 1024.0
    """memory_growth when RSS (or CUDA allocated) grows by this much over the history (or over
    pipeline calls in a row)."""

    # -- stability actions (training; off by default; each one recorded as an anomaly) ----------
    clip_grad_on_explosion: float | None = None
    """On gradient_explosion, scale the gradients to this global norm before the optimizer step."""
    lr_reduce_after_spikes: int = 0
    """After this many loss_spike / gradient_explosion steps within loss_spike_window steps, multiply
    every param group's lr by lr_reduce_factor (0: off)."""
    lr_reduce_factor: float = 0.5
    restore_finite_weights_mb: float = 0.0
    """Keep a host copy of the trainable weights (up to this many MB) from each finite step and put
    it back when the weights go non-finite (0: off)."""
    timestep_buckets: int = 10
    """Buckets of the loss-per-timestep curve (at most 10000)."""
    rank_check_every: int = 100
    """Compare a parameter checksum across ranks every N monitored steps (0: never)."""
    stall_timeout: float = 30.0
    """Training on several processes: seconds a rank may wait in a collective while the ranks
    disagree before the stall is named (liveness side channel; 0: off)."""
    stall_action: str = "wait"
    """A named stall that may resolve (a long validation on one rank): ``wait`` on, or ``exit``
    every process. Stalls no rank can leave (a skipped step, a monitor on some ranks) always exit."""
    step_offset: int = 0
    """Training: added to every step number recorded (1: number steps from 1, as the official
    diffusers scripts' progress bar and ``accelerator.log`` do when ``step=global_step`` is passed
    before ``global_step += 1``; at most 10**12)."""

    # -- budgets, history, output and logging --------------------------------------------
    enable_autograd_anomaly: bool = False
    """Run every monitored backward under torch.autograd anomaly mode (slow: opt-in)."""
    autograd_anomaly_mode: str = "detect"
    """``detect`` (record), ``warn`` or ``raise`` when anomaly mode reports a problem."""
    max_debug_iterations: int | None = None
    """Stop measuring after this many monitored steps (None: never)."""
    debug_timeout: float = 300.0
    """Seconds of localisation replays one pipeline run may spend (each FreeInit pass is a run); once
    spent, no new replay starts (one already running finishes). Training reports a replay that took longer."""
    history_size: int = 1000
    """Step rows and events kept in memory (ring buffers of this many each, 10x as many anomalies; at most
    10000000); older ones live on in events.jsonl."""
    stream_events: bool = True
    """Stream events to ``events.jsonl`` while running (otherwise only on save)."""
    debug_file_prefix: str = "run"
    """Run directories are named ``<prefix>-<date>-<time>-<pid>-<6 random hex digits>``."""
    run_name: str | None = None
    """A fixed run directory name instead; when a live run holds it or it holds an earlier run,
    the run writes to ``NAME-2`` (``NAME-3`` ...) and warns: a run directory holds one run."""
    log_level: str = "warning"
    """Least severity logged to the terminal: ``info``, ``warning`` or ``error``."""
    warn_severity: str = "warning"
    """Policy ``warn``: the least severity that gets a Python warning."""
    serve_port: int | None = None
    """Serve the live run on ``http://127.0.0.1:<port>`` while the debugger is open (training:
    ``/debug/training/summary`` answers the current counters; a pipeline: ``/debug/summary`` its
    ``get_summary()``; 0: a free port, see ``server_url``). None: off. No authentication,
    loopback only."""

    def __init__(self, **options: Any) -> None:
        """Keyword options only. A misspelt key is a ConfigError naming the closest one (a
        generated ``__init__`` would raise a bare TypeError); old names are renamed with a
        DeprecationWarning."""
        options = _renamed(options)
        for key in options:
            if key not in _field_names():
                raise ConfigError(_unknown_key_message(key))
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        self.__dict__.update({**defaults, **options})
        self.__post_init__()

    def __post_init__(self) -> None:
        """The one place a config is normalised and checked."""
        if not isinstance(self.level, str) or self.level not in LEVELS:
            raise ConfigError(_choice_message("level", self.level, LEVELS))
        # what the level fills in (and replace() re-derives for a new level)
        from_level = frozenset(key for key in PRESETS[self.level] if self.__dict__[key] is None)
        self.__dict__.update({key: PRESETS[self.level][key] for key in from_level}, _from_level=from_level)
        if isinstance(self.output_dir, os.PathLike):
            self.__dict__["output_dir"] = os.fspath(self.output_dir)
        _check_type("output_dir", self.output_dir, str)
        _check_type("debug_file_prefix", self.debug_file_prefix, str)
        for key, choices in (
            ("policy", POLICIES),
            ("probes", PROBE_MODES),
            ("autograd_anomaly_mode", AUTOGRAD_ANOMALY_MODES),
            ("log_level", SEVERITIES),
            ("warn_severity", SEVERITIES),
            ("stall_action", STALL_ACTIONS),
        ):
            if getattr(self, key) not in choices:
                raise ConfigError(_choice_message(key, getattr(self, key), choices))
        for key in (
            "strict",
            "localize",
            "previews",
            "memory_tracking",
            "repro_bundle",
            "per_module_grad_norms",
            "cuda_synchronize",
            "enable_autograd_anomaly",
            "stream_events",
        ):
            _check_type(key, getattr(self, key), bool)
        for key in ("overflow_fraction", "vae_saturation_fraction"):
            value = _check_number(key, getattr(self, key))
            if not 0 < value <= 1:
                raise ConfigError(f"Config key {key!r} must be in (0, 1], not {_short(value)}.")
            self.__dict__[key] = value
        for key in (
            "latent_std_tolerance",
            "loss_spike_threshold",
            "loss_spike_min_ratio",
            "lr_jump_factor",
            "update_ratio_threshold",
            "grad_explosion_threshold",
            "grad_vanishing_threshold",
            "memory_growth_mb",
            "debug_timeout",
        ):
            value = _check_number(key, getattr(self, key))
            if value <= 0:
                raise ConfigError(f"Config key {key!r} must be positive, not {_short(value)}.")
            self.__dict__[key] = value
        stall = _check_number("stall_timeout", self.stall_timeout)
        if stall < 0:
            raise ConfigError(f"Config key 'stall_timeout' must be 0 (off) or positive, not {_short(stall)}.")
        self.__dict__["stall_timeout"] = stall
        for key, least, most in (
            ("preview_vae_every", 0, None),  # a large N only means never
            ("loss_spike_window", 3, MAX_LOSS_SPIKE_WINDOW),
            ("timestep_buckets", 1, MAX_TIMESTEP_BUCKETS),
            ("rank_check_every", 0, None),
            ("step_offset", 0, MAX_STEP_OFFSET),
            ("history_size", 1, MAX_HISTORY_SIZE),
        ):
            self.__dict__[key] = _check_int(key, getattr(self, key), least, most)
        if self.max_debug_iterations is not None:
            self.__dict__["max_debug_iterations"] = _check_int("max_debug_iterations", self.max_debug_iterations, 1)
        _check_stability(self)
        port = self.serve_port
        if port is not None and (
            isinstance(port, bool) or not isinstance(port, numbers.Integral) or not 0 <= port <= 65535
        ):
            raise ConfigError(f"Config key 'serve_port' must be a port from 0 to 65535 or None, not {_short(port)}.")
        if port is not None:
            self.__dict__["serve_port"] = int(port)  # numpy's integers too
        _check_plain_name("debug_file_prefix", self.debug_file_prefix)
        if self.run_name is not None:
            _check_type("run_name", self.run_name, str)
            _check_plain_name("run_name", self.run_name)

    # -- construction from data ----------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DebugConfig":
        """Build from a mapping (the config-file names in ``ALIASES``, such as ``debug_output_dir``,
        accepted)."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"A config must be a mapping of keys to values, not {type(data).__name__}.")
        resolved: dict[str, Any] = {}
        for key, value in data.items():
            if not isinstance(key, str):
                raise ConfigError(f"Config keys are names, not {type(key).__name__} {_short(key)}.")
            name = ALIASES.get(key, key)
            if name in resolved:
                raise ConfigError(f"Config key {name!r} is given twice (once as {key!r}).")
            resolved[name] = value
        return cls(**resolved)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "DebugConfig":
        """Read a YAML (``.yaml``/``.yml``) or JSON (``.json``) config file."""
        return cls.from_dict(read_config_file(path))

    def to_dict(self) -> dict[str, Any]:
        """Every option, with level-derived ones resolved."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "DebugConfig":
        """A copy with some options changed (validated like a new config).  Options that came
        from the level follow a new ``level``; options set explicitly stay.

        >>> DebugConfig(level="basic").replace(level="extreme").probes
        'full'
        """
        changes = _renamed(changes)
        kept = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in self._from_level}
        return type(self)(**{**kept, **changes})

    def __setattr__(self, name: str, value: Any) -> None:
        """An assignment is ``replace`` in place: ``config.policy = "explode"`` raises ConfigError
        and changes nothing. (Kept because assigning an option is public behaviour; a frozen
        dataclass would refuse the valid assignments too.)"""
        self.__dict__.update(self.replace(**{name: value}).__dict__)


def resolve_config(config: Any) -> DebugConfig:
    """What the debuggers accept as ``config``: a DebugConfig, a mapping of its keys, or
    ``None`` for the defaults."""
    if config is None:
        return DebugConfig()
    if isinstance(config, DebugConfig):
        return config
    if isinstance(config, Mapping):
        return DebugConfig.from_dict(config)
    raise ConfigError(f"config must be a DebugConfig (or a mapping of its keys), not {type(config).__name__}.")


_MAX_CONFIG_BYTES = 64 * 1024


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """The keys a YAML or JSON config file sets, unvalidated (``DebugConfig.from_dict``
    validates them)."""
    path = Path(path)
    kind = "JSON" if path.suffix.lower() == ".json" else "YAML"
    try:
        # read at most one byte past the cap: a device or a pipe (/dev/zero) has no size to stat
        with open(path, "rb") as handle:
            raw = handle.read(_MAX_CONFIG_BYTES + 1)
        if len(raw) > _MAX_CONFIG_BYTES:
            raise ConfigError(
                f"Config file {str(path)!r} is over {_MAX_CONFIG_BYTES // 1024} KB; a config is a few lines."
            )
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"Config file {str(path)!r} does not exist.") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"Config file {str(path)!r} cannot be read: {error}.") from None
    try:
        data = json.loads(text) if kind == "JSON" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as error:
        first_line = str(error).strip().splitlines()[0]
        raise ConfigError(f"Config file {str(path)!r} is not valid {kind}: {first_line}.") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"Config file {str(path)!r} must hold a mapping of keys to values, not {type(data).__name__}."
        )
    return dict(data)


def _renamed(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with this package's old option names replaced by the current ones."""
    if not any(key in DEPRECATED for key in kwargs):
        return kwargs
    out = {}
    for key, value in kwargs.items():
        new = DEPRECATED.get(key)
        if new is None:
            out[key] = value
            continue
        if new in kwargs:
            raise ConfigError(f"Config key {new!r} is given twice (once under its old name {key!r}).")
        warnings.warn(f"Config key {key!r} is now called {new!r}.", DeprecationWarning, stacklevel=3)
        out[new] = value
    return out


def _field_names() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(DebugConfig))


def _unknown_key_message(key: str) -> str:
    names = sorted(_field_names())
    if key in ALIASES:
        return f"Unknown config key {_short(key)}; in code it is called {ALIASES[key]!r}."
    close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}?" if close else f"valid keys are: {', '.join(names)}."
    return f"Unknown config key {_short(key)}; {hint}"


# -- how a value is checked, and how a bad one is told: each check raises one ConfigError sentence
# naming the key; a hostile value (a YAML alias bomb) is shown short, never in full.

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
    """``value`` as a plain int or float: any real number (numpy's too), not a bool or NaN.

    >>> _check_number("overflow_fraction", "half")
    Traceback (most recent call last):
    ...
    diffusion_debug.errors.ConfigError: Config key 'overflow_fraction' must be a number, not 'half'.
    """
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
