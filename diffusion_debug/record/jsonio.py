"""Strict JSON in and out: every file of a run directory is read and written here.

Non-finite floats are written as the strings ``"nan"``, ``"inf"`` and ``"-inf"`` (see
:func:`to_jsonable`), so ``json.loads(text, parse_constant=<raise>)`` accepts every file.

>>> dumps({"loss": float("nan"), "shape": (2, 3)})
'{"loss": "nan", "shape": [2, 3]}'
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import tempfile
from collections import deque
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import torch

from ..stats import read_now

_NONE_READY: Mapping[str, Any] = MappingProxyType({})


def to_jsonable(obj: Any, ready: Mapping[str, Any] = _NONE_READY) -> Any:
    """Plain JSON data for ``obj``: non-finite floats become ``"nan"``/``"inf"``/``"-inf"``;
    tensors, numpy values, dtypes, paths, enums and dataclasses become lists, numbers or text.
    ``ready``: for a dict ``obj``, the JSON copies its maker already made of some of its dict values, by key,
    taken as they are, not walked (a step row's statistics, copied where they are made: ``step_values.py``)."""
    kind = type(obj)
    if kind is dict:  # most of a row or an event: its plain leaves without a call each (a row a step)
        out = {}
        for key, value in obj.items():
            leaf = type(value)
            if key.__class__ is not str:
                key = str(key)
            if leaf is float:
                out[key] = value if value - value == 0.0 else _nonfinite(value)
            elif leaf in _PLAIN:
                out[key] = value
            elif leaf is list:  # plain numbers, finite floats or text (a shape: five a step): copied, no call
                for item in value:
                    if item.__class__ not in _PLAIN and not (item.__class__ is float and item - item == 0.0):
                        out[key] = to_jsonable(value)
                        break
                else:
                    out[key] = value[:]
            elif leaf is dict:  # a row's statistics (five a step), its memory sample: plain leaves copied, no call
                if key in ready:  # (spelled out: no C call; ~300 bytecodes a statistics dict fewer)
                    out[key] = ready[key]
                    continue
                inner = {}
                for name, item in value.items():
                    kind = item.__class__
                    if name.__class__ is not str:
                        break
                    if kind in _PLAIN or (kind is float and item - item == 0.0):
                        inner[name] = item
                    elif kind is list:  # a shape
                        for part in item:
                            if part.__class__ not in _PLAIN and not (part.__class__ is float and part - part == 0.0):
                                break
                        else:
                            inner[name] = item[:]
                            continue
                        break
                    else:
                        break
                else:
                    out[key] = inner
                    continue
                out[key] = to_jsonable(value)  # anything else: the long way
            else:
                out[key] = to_jsonable(value)
        return out
    if kind in _PLAIN:
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else _nonfinite(obj)
    if isinstance(obj, (str, int)):  # their subclasses (None and bool are plain)
        return obj
    if isinstance(obj, (list, tuple, deque, set, frozenset)):  # before Mapping: an ABC check is slow
        if hasattr(obj, "_asdict"):  # a named tuple (a probe's ModuleReading): its fields by name
            return to_jsonable(obj._asdict())
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, torch.Tensor):
        if obj.is_meta:
            return f"<meta tensor {tuple(obj.shape)}>"
        return to_jsonable(read_now(obj.detach().cpu()))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        to_dict = getattr(obj, "to_dict", None)
        return to_jsonable(to_dict() if callable(to_dict) else dataclasses.asdict(obj))
    if isinstance(obj, enum.Enum):
        return to_jsonable(obj.value)
    if isinstance(obj, (torch.dtype, torch.device, Path)):
        return str(obj)
    if hasattr(obj, "tolist") and hasattr(obj, "dtype"):  # numpy arrays and scalars
        return to_jsonable(read_now(obj))
    return repr(obj)


_PLAIN = frozenset({str, int, bool, type(None)})
"""Types written as they are (their subclasses, an IntEnum say, go the long way)."""


def _nonfinite(value: float) -> str:
    return "nan" if value != value else ("inf" if value > 0 else "-inf")


_ENCODE = json.JSONEncoder(allow_nan=False).encode
"""``json.dumps(obj, allow_nan=False)``, the same text, with one encoder made once (``json.dumps``
given an argument makes a new one at each call: a step row is written every step)."""


def dumps(obj: Any, **kwargs: Any) -> str:
    """Strict JSON text for ``obj``."""
    if kwargs:
        return json.dumps(to_jsonable(obj), allow_nan=False, **kwargs)
    return _ENCODE(to_jsonable(obj))


encode = _ENCODE
"""Strict JSON text for plain data (:func:`to_jsonable`'s): the encoder's own method, no call of ours."""


def _chunks_of(encoder: json.JSONEncoder) -> Any:
    """``encoder.encode(obj)``'s text as chunks, ``"".join(chunks_of(obj, 0))``, made by the C
    encoder it runs (the same arguments as ``iterencode(obj, _one_shot=True)`` gives it) with no
    Python call (``encode`` and ``iterencode`` are two a line); no watch for cycles (plain data,
    :func:`to_jsonable`'s). Without json's C extension, ``encode`` itself."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None or encoder.indent is not None:  # pragma: no cover - CPython has it
        return lambda obj, _level: (encoder.encode(obj),)
    strings = json.encoder.encode_basestring_ascii if encoder.ensure_ascii else json.encoder.encode_basestring
    separators = (encoder.key_separator, encoder.item_separator)
    return make(
        None, encoder.default, strings, None, *separators, encoder.sort_keys, encoder.skipkeys, encoder.allow_nan
    )


encode_chunks = _chunks_of(json.JSONEncoder(allow_nan=False))
""":data:`encode`'s text as chunks (``"".join(encode_chunks(entry, 0))``): a streamed line with no Python call."""


_ENCODE_PLAIN = json.JSONEncoder(allow_nan=False, check_circular=False).encode
""":data:`encode` without its watch for cycles (an id kept and dropped in a dict for every list: a
quarter of the time on a full probe's readings), for data its caller built and knows has none."""


def dumps_plain(obj: Any) -> str:
    """:func:`dumps` of plain data, the same text, made by the C encoder alone while it can: for
    ``obj`` built of dicts with ``str`` keys, lists, plain tuples, ``str``, ``int``, ``float``,
    ``bool`` and ``None`` (a full probe's module readings: thousands of values a pipeline call,
    which :func:`to_jsonable` would copy one Python call a list). A NaN/Inf or a value the encoder
    cannot write (a tensor, a set) makes it :func:`dumps`. Not for a named tuple (the encoder writes
    a list, :func:`to_jsonable` its fields by name), a key other than ``str``, nor data that holds
    itself (no check for cycles: a ``RecursionError``).

    >>> dumps_plain({"m": [("conv", 0, 1.5)]}), dumps_plain({"m": [("conv", 0, float("nan"))]})
    ('{"m": [["conv", 0, 1.5]]}', '{"m": [["conv", 0, "nan"]]}')
    """
    try:
        return _ENCODE_PLAIN(obj)
    except (ValueError, TypeError):  # a non-finite float (only where something went wrong), or not plain
        return dumps(obj)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name!r}")


def loads(text: str) -> Any:
    """Parse strict JSON (``NaN``/``Infinity`` are rejected, as any strict reader would)."""
    return json.loads(text, parse_constant=_reject_constant)


def load_json(path: str | os.PathLike) -> Any:
    return loads(Path(path).read_text(encoding="utf-8"))


class JsonLines(list):
    """The rows of a JSONL file; ``bad_lines`` lists the 1-based numbers of lines that were not
    JSON objects (a line cut by a killed writer, or garbage) and were left out."""

    bad_lines: list[int]


def read_jsonl(path: str | os.PathLike) -> JsonLines:
    """Every readable line of a JSONL file, as dicts. A line that is not a JSON object (the cut
    tail of a killed run, or damage) is left out and counted in ``bad_lines``, never raised."""
    rows = JsonLines()
    rows.bad_lines = []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = loads(line)
            except (ValueError, RecursionError):
                row = None
            if isinstance(row, dict):
                rows.append(row)
            else:
                rows.bad_lines.append(number)
    return rows


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def write_atomic(path: str | os.PathLike, data: str | bytes, durable: bool = True) -> Path:
    """Write a file so that readers see the old content or the new one, never a part.
    ``durable=False`` skips the ``fsync`` (9 ms on a busy disk): still whole for every reader, but
    a power cut may lose it (the pytest plugin's per-test runs, which a session writes by hundreds)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    binary = isinstance(data, bytes)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # as events.jsonl (os.open 0o644): mkstemp's 0600 would differ
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as handle:
            handle.write(data)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
