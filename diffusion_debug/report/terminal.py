"""Plain-text tables for the terminal, from a saved run: anomalies first, then steps and
components.

>>> from diffusion_debug.record import Anomaly
>>> print(anomaly_table([Anomaly("nonfinite", "error", "Inf produced.", "unet", "mid_block", step=3)]))
severity  kind       where                   message
--------  ---------  ----------------------  -------------
error     nonfinite  unet mid_block, step 3  Inf produced.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import IO, Any, Iterable, Sequence

from ..record import Anomaly, RunData, diagnosis_severity, folded
from .columns import INFERENCE_STEP_COLUMNS as INFERENCE_COLUMNS
from .columns import TRAINING_STEP_COLUMNS as TRAINING_COLUMNS
from .columns import Column, pick, run_warnings
from .rank_groups import same_on_ranks
from .text import TERMINAL_MESSAGE_CHARS, cut, follow_label

# The terminal is narrow: a few of the report's step columns.
INFERENCE_STEP_COLUMNS = pick(
    INFERENCE_COLUMNS,
    (
        "step",
        "run",
        "timestep",
        "sigma",
        "latent std",
        "latent |max|",
        "output L2",
        "guidance gap",
        "NaN/Inf values",
        "time s",
    ),
)
TRAINING_STEP_COLUMNS = pick(
    TRAINING_COLUMNS, ("step", "rank", "loss", "grad norm", "lr", "grad scale", "skipped", "step time s", "RSS MB")
)


def _format(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


CELL_CHARS = 200
"""The most of one unwrapped cell a table shows (every row is padded to the widest cell)."""


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], wrap: dict[int, int] | None = None) -> str:
    """A plain table; ``wrap`` maps a column index to the width its text is wrapped at.

    A wrapped cell is cut to :data:`~.text.TERMINAL_MESSAGE_CHARS` characters before wrapping
    (textwrap is quadratic in one long word) and any other to :data:`CELL_CHARS`, each with
    "… N more characters", so a table takes time linear in its rows whatever a saved run holds."""
    wrap = wrap or {}
    cells = [
        [
            wrap_names(cut(_format(v), TERMINAL_MESSAGE_CHARS), wrap[i])
            if i in wrap
            else [cut(_format(v), CELL_CHARS)]
            for i, v in enumerate(row)
        ]
        for row in rows
    ]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, lines in enumerate(row):
            widths[i] = max(widths[i], *(len(line) for line in lines))
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    for row in cells:
        for k in range(max(len(lines) for lines in row)):
            out.append(
                "  ".join((lines[k] if k < len(lines) else "").ljust(w) for lines, w in zip(row, widths)).rstrip()
            )
    return "\n".join(out)


_NAME_BREAK = re.compile(r"(?<=[./])(?=[^\s./])")
"""Where a dotted name may break: after a dot or slash (``up_blocks.1.`` / ``attentions.0``)."""


def wrap_names(text: str, width: int) -> list[str]:
    """``text`` wrapped at ``width`` like :func:`textwrap.wrap`, but a word longer than the width
    (a module name such as ``up_blocks.1.attentions.0.to_q.lora_A.default``) breaks after its dots,
    not mid-word; only a part longer than the width is cut.

    >>> wrap_names("nonfinite at unet.up_blocks.1.resnets.0.conv2 from finite inputs", 20)
    ['nonfinite at unet.', 'up_blocks.1.resnets.', '0.conv2 from finite', 'inputs']
    """
    lines: list[str] = []
    current = ""
    for word in text.split():
        parts = _NAME_BREAK.split(word) if len(word) > width else [word]
        for k, part in enumerate(parts):
            joined = f"{current}{'' if k or not current else ' '}{part}"
            if current and len(joined) > width:
                lines.append(current)
                joined = part
            current = joined
            while len(current) > width:  # one part longer than the width: cut it
                lines.append(current[:width])
                current = current[width:]
    if current:
        lines.append(current)
    return lines or [""]


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: Any) -> str:
    """``text`` safe for a terminal: control characters (escape sequences among them) become ``?``.

    >>> printable("ok\\x1b[2Jcleared")
    'ok?[2Jcleared'
    """
    return _CONTROL.sub("?", str(text))


PIPED_WIDTH = 160
"""The width tables are laid out for when they go to no terminal (a pipe, a file, a CI log, a test
worker) and ``COLUMNS`` is not set: a log has no edge to wrap at, 80 columns left a message 28 wide."""


def table_width(stream: IO[str] | None = None) -> int:
    """The width of the tables printed to ``stream`` (default ``sys.stdout``): ``COLUMNS`` when set,
    else the terminal's width when the stream is one, else :data:`PIPED_WIDTH`.

    >>> import io
    >>> table_width(io.StringIO()) == (int(os.environ["COLUMNS"]) if os.environ.get("COLUMNS") else PIPED_WIDTH)
    True
    """
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    stream = sys.stdout if stream is None else stream
    try:
        if stream is not None and stream.isatty():
            return os.get_terminal_size(stream.fileno()).columns or PIPED_WIDTH
    except (AttributeError, OSError, ValueError):  # a stream with no file behind it, or a closed one
        pass
    return PIPED_WIDTH


def anomaly_table(anomalies: Sequence[Anomaly], width: int | None = None, show_rank: bool = False) -> str:
    """``show_rank``: name every anomaly's rank (a run of several ranks), rank 0 too; ``width``: the
    table's (default: :func:`table_width` of stdout)."""
    width = width or table_width()
    # "step 5", "rank 1", "(t=761)" stay whole on a line: joined by a non-space until the table is made
    rows = [
        (a.severity, printable(a.kind), _UNIT.sub(_join_unit, printable(a.where(show_rank))), printable(a.message))
        for a in anomalies
    ]
    # the width beside severity and kind (32: the longest kind is 18); a table that fits is not
    # wrapped, else the message keeps 28 where it can (at 80 columns a 40-column where made the
    # table 92 wide) and 20 holds a name's longest part
    left = width - 32
    where_need = min(40, max([len(r[2]) for r in rows] + [5]))
    message_need = max([len(r[3]) for r in rows] + [7])
    if where_need + message_need <= left:
        where_width, message_width = where_need, message_need
    else:
        where_width = min(where_need, max(20, left - 28))
        message_width = max(24, left - where_width)
    text = table(["severity", "kind", "where", "message"], rows, wrap={2: where_width, 3: message_width})
    return text.replace(_JOINED, " ")


_JOINED = "\u2060"  # a word joiner: one character, as the space it stands for
_UNIT = re.compile(r"\b(step|ranks?) (?=\S)")


def _join_unit(match: re.Match) -> str:
    return f"{match.group(1)}{_JOINED}"


def steps_table(steps: Sequence[dict[str, Any]], columns: list[Column], limit: int = 12) -> str:
    used = [(h, get) for h, get in columns if any(get(s) is not None for s in steps)]
    chosen = list(steps)
    if len(chosen) > limit:  # the first and last steps; the middle is in summary.json
        chosen = chosen[: limit // 2] + [None] + chosen[-(limit // 2) :]
    rows = [["..."] + [""] * (len(used) - 1) if s is None else [get(s) for _, get in used] for s in chosen]
    return table([h for h, _ in used], rows)


def components_table(components: dict[str, Any]) -> str:
    """Class, parameters, dtype, device and size of each component; calls, mean time and peak
    memory too once a run measured them (``inspect`` runs nothing, so it shows no empty columns)."""
    infos = {name: info for name, info in components.items() if isinstance(info, dict) and "parameters" in info}
    measured = any(info.get("calls") is not None for info in infos.values())
    headers = ["component", "class", "parameters", "dtype", "device", "MB"]
    if measured:
        headers += ["calls", "mean time s", "peak MB"]
    rows = []
    for name, info in infos.items():
        size = info.get("bytes")
        row = [
            name,
            info.get("class"),
            info.get("parameters"),
            info.get("dtype"),
            info.get("device"),
            None if size is None else round(size / 2**20, 2),
        ]
        if measured:
            row += [info.get("calls"), info.get("mean_time_s"), info.get("peak_memory_mb")]
        rows.append(row)
    return table(headers, rows)


def profile_lines(profile: dict[str, Any], run_dir: Path, limit: int = 6) -> str:
    """The profiled step: its files, then the modules and the operators that took the most time."""
    lines = [f"\nprofile of step {profile.get('step')}"]
    if profile.get("trace"):
        lines.append(f"trace: {run_dir / str(profile['trace'])} (open it in https://ui.perfetto.dev)")
    if profile.get("memory_snapshot"):
        snapshot = run_dir / str(profile["memory_snapshot"])
        lines.append(f"CUDA memory snapshot: {snapshot} (open it at https://pytorch.org/memory_viz)")
    lines += [str(profile[key]) for key in ("note", "memory_note") if profile.get(key)]
    modules = [m for m in profile.get("modules") or () if isinstance(m, dict)][:limit]
    if modules:
        clock = "device" if profile.get("time") == "device" else "cpu"
        rows = [(m.get("name"), m.get("calls"), m.get("total_ms")) for m in modules]
        lines.append(table(["module", "calls", f"{clock} ms"], rows))
    ops = [op for op in profile.get("ops") or () if isinstance(op, dict)][:limit]
    if ops:
        clock = "device" if profile.get("time") == "device" else "cpu"
        rows = [(op.get("name"), op.get("calls"), op.get("self_ms")) for op in ops]
        lines.append("\n" + table(["operator", "calls", f"self {clock} ms"], rows))
    return "\n".join(lines)


def once_each(anomalies: Sequence[Anomaly]) -> list[Anomaly]:
    """The anomalies with each row the table would print twice shown once (the same call made by
    ``run --repeat`` finds the same thing each time), its message saying how many times it was found.

    >>> a = Anomaly("nonfinite", "error", "Inf produced.", "unet", "mid_block", step=3)
    >>> [x.message for x in once_each([a, a])]
    ['Inf produced. (found 2 times)']
    """
    counts = Counter((a.severity, a.kind, a.where(), a.message) for a in anomalies)
    shown: dict[tuple[str, str, str, str], Anomaly] = {}
    for a in anomalies:
        key = (a.severity, a.kind, a.where(), a.message)
        if key not in shown:
            repeated = f"{a.message} (found {counts[key]} times)" if counts[key] > 1 else a.message
            shown[key] = dataclasses.replace(a, message=repeated)
    return list(shown.values())


def with_consequences(anomaly: Anomaly, under: Sequence[Anomaly]) -> Anomaly:
    """``anomaly`` with its message saying what follows from it (``record.folded``: those are not shown)
    and the diagnosis's severity (``record.diagnosis_severity``), summary.json's headline keeps the anomaly's own.

    >>> a = Anomaly("lr_spike", "warning", "The lr jumped.", "optimizer", step=10)
    >>> b = Anomaly("loss_spike", "warning", "The loss jumped.", "model", step=11)
    >>> with_consequences(a, [b, b]).message
    'The lr jumped. 2 anomalies follow from it (2 loss_spike).'
    >>> with_consequences(a, [dataclasses.replace(b, severity="error")]).severity
    'error'
    """
    if not under:
        return anomaly
    severity = diagnosis_severity(anomaly, under)
    return dataclasses.replace(anomaly, severity=severity, message=f"{anomaly.message} {follow_label(under)}.")


def render_terminal(run: RunData, width: int | None = None) -> str:
    """The terminal summary of a run directory, its tables ``width`` wide (default: :func:`table_width`
    of stdout; a summary printed to another stream takes that stream's)."""
    summary = run.summary
    kind = summary.get("kind", "run")
    anomalies = run.anomalies
    parts = [f"{kind} run {run.run_dir}", *run_warnings(summary)]
    counts = summary.get("severity_counts", {})
    parts.append(
        f"anomalies: {len(anomalies)}"
        + (
            " (" + ", ".join(f"{counts[s]} {s}" for s in ("error", "warning", "info") if counts.get(s)) + ")"
            if counts
            else ""
        )
    )
    if anomalies:  # the first row is the cause (record.by_cause), as report.html's headline
        world_size = summary.get("world_size")
        show_rank = isinstance(world_size, int) and world_size > 1
        pairs = folded(anomalies)
        if show_rank:  # what every rank found alike: one row naming the ranks
            pairs = same_on_ranks(pairs)
        shown = once_each([with_consequences(a, under) for a, under in pairs])
        parts.append(anomaly_table(shown, width, show_rank=show_rank))
    steps = run.rank_steps  # a training run: every rank's every step
    if steps:
        columns = TRAINING_STEP_COLUMNS if kind == "training" else INFERENCE_STEP_COLUMNS
        if len({row.get("run") for row in steps if isinstance(row, dict)}) < 2:  # one call: no run column
            columns = [column for column in columns if column[0] != "run"]
        parts.append(f"\nsteps ({len(steps)} recorded)\n" + steps_table(steps, columns))
    components = summary.get("components") or {}
    if any(isinstance(v, dict) and "parameters" in v for v in components.values()):
        parts.append("\ncomponents\n" + components_table(components))
    if isinstance(summary.get("profile"), dict):
        parts.append(profile_lines(summary["profile"], run.run_dir))
    return "\n".join(printable(line) for part in parts for line in part.split("\n"))
