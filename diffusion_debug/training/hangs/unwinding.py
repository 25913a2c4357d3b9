"""An error that left this rank's step outside the watched forward (in the loss, in backward, in a hook of the
user's, in the optimizer step), seen by the watcher thread: read, never hooked, so the user's code and the error
stay as they are.

Two signs, read at each look (:func:`raised_position`):

- the training thread is handling an exception: inside an ``except`` or ``finally`` clause, or a context manager's
  ``__exit__``, as it unwinds (``sys._current_exceptions``): a rank that caught its error and waits (a checkpoint
  saved on a crash, a retry after a pause), or whose ``finally`` enters a collective of its own;
- the main thread ended with an uncaught exception (``sys.last_value``, set before the interpreter's exit
  handlers run) while the process is not yet gone (an exit handler, a non-daemon thread joined at exit).

The position published is then this rank's, in phase ``raised`` with the error and the phase it left
(``Position.raised_in``), as the forward's own hook marks an error leaving the watched forward; the training
thread's position is not written (it moves on by itself once the rank does)::

    >>> import threading
    >>> try:
    ...     raise ValueError("a bad target")
    ... except ValueError:
    ...     seen = raised_position(Position(1, "backward", 3), threading.current_thread())
    >>> seen.phase, seen.step, seen.error, seen.raised_in, seen.uncaught
    ('raised', 3, 'ValueError: a bad target', 'backward', False)
    >>> raised_position(Position(1, "backward", 3), threading.current_thread()).phase  # handled: left behind
    'backward'

Limits: an error caught and left at once (``except: continue``) is not seen; the next forward then marks the
rank (a skipped step, where ``step=`` numbers the steps). ``StopIteration`` is no error (an iterator ended) and a
DiffusionDebugError is the debugger's own (policy ``raise``, on every rank together): neither is named. Any other
exception the training thread handles while frozen is read as its step's error, whatever raised it. A training
loop in another thread than the main one is seen while it handles the error only. A Python without
``sys._current_exceptions`` (not CPython) sees the second sign only.
"""

from __future__ import annotations

import dataclasses
import sys
import threading

from ...errors import DiffusionDebugError
from .patterns import Position, error_text

_NOT_ERRORS = (StopIteration, StopAsyncIteration, DiffusionDebugError)
_NOT_IN_STEP = ("raised", "closed")  # marked already by the forward's hook; a rank that left the loop


def unwinding(thread: threading.Thread) -> tuple[BaseException, bool] | None:
    """The error ``thread`` is unwinding with and whether no one caught it (the main thread ended with it),
    or None."""
    if thread.is_alive():
        current = getattr(sys, "_current_exceptions", None)
        error = current().get(thread.ident) if current is not None else None
        if isinstance(error, tuple):  # before Python 3.12: (type, value, traceback)
            error = error[1]
        return (error, False) if _an_error(error) else None
    if thread is threading.main_thread():
        error = getattr(sys, "last_value", None)  # the uncaught error printed before the exit handlers
        return (error, True) if _an_error(error) else None
    return None


def _an_error(error: object) -> bool:
    return isinstance(error, Exception) and not isinstance(error, _NOT_ERRORS)


def raised_position(position: Position, thread: threading.Thread) -> Position:
    """``position`` as the other ranks should read it: in phase ``raised`` while ``thread`` (the training
    thread) unwinds with an error, else ``position`` itself."""
    if position.phase in _NOT_IN_STEP:
        return position
    found = unwinding(thread)
    if found is None:
        return position
    error, uncaught = found
    return dataclasses.replace(
        position, phase="raised", error=error_text(error), raised_in=position.phase, uncaught=uncaught
    )
