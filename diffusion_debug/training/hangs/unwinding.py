"""An error that left this rank's step outside the watched forward (in the loss, in backward, in a hook of the
user's, in the optimizer step), seen by the watcher thread: read, never hooked, so the user's code and the error
stay as they are.

Two signs, read at each look (:meth:`Unwinding.position`):

- the training thread is handling an exception: inside an ``except`` or ``finally`` clause, or a context manager's
  ``__exit__``, as it unwinds (``sys._current_exceptions``): a rank that caught its error and waits (a checkpoint
  saved on a crash, a retry after a pause), or whose ``finally`` enters a collective of its own;
- the main thread ended with an uncaught exception (``sys.last_value``, set before the interpreter's exit
  handlers run) while the process is not yet gone (an exit handler, a non-daemon thread joined at exit).

The position published is then this rank's, in phase ``raised`` with the error and the phase it left
(``Position.raised_in``; a phase of the user's that this very error left, and its step: ``Position.left``), as
the forward's own hook marks an error leaving the watched forward; the training thread's position is not written
(it moves on by itself once the rank does)::

    >>> import threading
    >>> thread = threading.current_thread()
    >>> watch = Unwinding(thread)
    >>> try:
    ...     raise ValueError("a bad target")
    ... except ValueError:
    ...     seen = watch.position(Position(1, "backward", 3, counter=7), thread)
    >>> seen.phase, seen.step, seen.error, seen.raised_in, seen.uncaught
    ('raised', 3, 'ValueError: a bad target', 'backward', False)
    >>> watch.position(Position(1, "backward", 3, counter=7), thread).phase  # handled: left behind
    'backward'

An error handled around the training loop (``except FileNotFoundError: trainer.train()``, a resume's fallback) is
not the step's: one already handled when the watch began or when the step's training forward began (its mark,
:meth:`Unwinding.forward_began`), and one still handled after the rank's position moved on from where it was first
seen (its handler encloses the steps)::

    >>> try:
    ...     raise FileNotFoundError("no checkpoint to resume from")
    ... except FileNotFoundError:  # the loop runs here
    ...     first = watch.position(Position(1, "backward", 3, counter=8), thread).phase
    ...     later = watch.position(Position(1, "backward", 4, counter=9), thread).phase
    >>> first, later
    ('raised', 'backward')

Limits: an error caught and left at once (``except: continue``) is not seen; the next forward then marks the
rank (a skipped step, where ``step=`` numbers the steps). ``StopIteration`` is no error (an iterator ended) and a
DiffusionDebugError is the debugger's own (policy ``raise``, on every rank together): neither is named. Any other
exception the training thread handles while frozen is read as its step's error, whatever raised it, until its
position moves: an error handled around a loop that marks no training forward (no watched model's forward with
grad), first seen after the rank's last move, is read as raised; and in a loop run inside an ``except`` clause, a
step's error handled within a look (1 s at most) of an earlier one's handler, at the freed one's address, is not
(read as around the loop). A training loop in another thread than the main one is
seen while it handles the error only. A Python without ``sys._current_exceptions`` (not CPython) sees the second
sign only; an uncaught error already in ``sys.last_value`` when the watch began (a REPL's) is not read.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from typing import Any

from ...core.out_of_memory import raised_at
from ...errors import DiffusionDebugError
from .patterns import Position, error_text

_NOT_ERRORS = (StopIteration, StopAsyncIteration, DiffusionDebugError)
_NOT_IN_STEP = ("raised", "closed")  # marked already by the forward's hook; a rank that left the loop


class Unwinding:
    """The errors one watcher has seen the training thread handle, to tell a step's own from one handled around
    the loop. Read by the watcher thread at each look, then once at close (the watcher stopped); told by the
    training thread as each training forward begins (:meth:`forward_began`)."""

    def __init__(self, thread: threading.Thread):
        self._around = {id(e) for e in _chain(_handled(thread))}
        """Handled when the watch began: around the loop (``id``: each is alive while handled)."""
        self._seen: dict[int, tuple[int, int]] = {}
        """``id(error)``: the position's counter when first seen, and the generation then; a later counter means
        the handler encloses the steps. Only errors still handled are kept, and of this generation: a freed
        error's ``id`` comes back at once for the next one."""
        self._generation = 0
        """Training forwards begun with nothing handled: every error seen before them is gone."""
        self._stale = getattr(sys, "last_value", None)
        """An uncaught error already left when the watch began (a REPL's, a notebook's): not this run's."""
        self._at_forward: tuple[Any, ...] | None = None
        """The error handled as the last training forward began (:func:`_identity`): around the step."""

    def forward_began(self) -> None:
        """On the training thread, as a training forward begins (its mark): an error handled now is around the
        step, not raised in it (a loop run in an ``except`` clause, whatever the watcher's looks saw); with none
        handled, every error seen so far is gone."""
        error = sys.exc_info()[1]
        if error is None:
            self._at_forward = None
            self._generation += 1
        else:
            self._at_forward = _identity(error)

    def position(self, position: Position, thread: threading.Thread) -> Position:
        """``position`` as the other ranks should read it: in phase ``raised`` while ``thread`` (the training
        thread) unwinds with its step's error, else ``position`` itself."""
        if position.phase in _NOT_IN_STEP:
            return position
        found = self.unwinding(position, thread)
        if found is None:
            return position
        error, uncaught = found
        phase, step = position.left[:2] if _left(position, error) else (position.phase, position.step)
        return dataclasses.replace(
            position, phase="raised", step=step, error=error_text(error), raised_in=phase, uncaught=uncaught
        )

    def unwinding(self, position: Position, thread: threading.Thread) -> tuple[BaseException, bool] | None:
        """The step's error ``thread`` is unwinding with and whether no one caught it (the main thread ended with
        it), or None."""
        if thread.is_alive():
            error = _handled(thread)
            generation = self._generation  # read after the error: a forward begun before it is counted
            handled = {id(e) for e in _chain(error)}
            self._around &= handled if generation == 0 else set()
            self._seen = {key: seen for key, seen in self._seen.items() if key in handled and seen[1] == generation}
            if error is None or id(error) in self._around or _identity(error) == self._at_forward:
                return None
            if _left(position, error):  # the error a phase of the user's left (its handler may follow that phase)
                return (error, False) if _an_error(error) else None
            if self._seen.setdefault(id(error), (position.counter, generation))[0] != position.counter:
                return None  # still handled after the rank moved on: its handler encloses the steps
            return (error, False) if _an_error(error) else None
        if thread is threading.main_thread():
            error = getattr(sys, "last_value", None)  # the uncaught error printed before the exit handlers
            return (error, True) if _an_error(error) and error is not self._stale else None
        return None


def _left(position: Position, error: BaseException) -> bool:
    """Whether ``error`` is the one that left a phase of the user's (``Position.left``: it was in that phase)."""
    return bool(position.left) and position.left[2] == raised_at(error)


def _identity(error: BaseException) -> tuple[Any, ...]:
    """``error`` told from a later one at its freed address: its type and where it was caught (the first entry
    of its traceback), never the error itself (its traceback holds the frames' tensors)."""
    caught = error.__traceback__
    return (id(error), type(error), caught and caught.tb_frame.f_code, caught and caught.tb_lineno)


def _handled(thread: threading.Thread) -> BaseException | None:
    """The exception ``thread`` handles now (innermost), or None."""
    current = getattr(sys, "_current_exceptions", None)
    error = current().get(thread.ident) if current is not None and thread.is_alive() else None
    if isinstance(error, tuple):  # before Python 3.12: (type, value, traceback)
        error = error[1]
    return error if isinstance(error, BaseException) else None


def _chain(error: BaseException | None) -> list[BaseException]:
    """``error`` and those handled around it (``__context__``: an error raised in a handler has the handled one)."""
    chain: list[BaseException] = []
    while error is not None and all(error is not e for e in chain):
        chain.append(error)
        error = error.__context__
    return chain


def _an_error(error: object) -> bool:
    return isinstance(error, Exception) and not isinstance(error, _NOT_ERRORS)
