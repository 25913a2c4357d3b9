"""The read-only HTTP server over the runs of an output directory: behind ``diffusion-debug serve DIR``,
and, with live endpoints, in a debugger that has ``serve_port`` set (:func:`start_live_server`).

Endpoints (GET and HEAD only):

* ``/`` -- an HTML list of the runs, newest first, with links to their reports (``templates/runs.html``);
* ``/runs`` -- the same list as JSON;
* ``/runs/<name>/summary`` -- that run's summary as JSON (a killed run's is rebuilt from its events);
* ``/debug/summary`` and ``/debug/training/summary`` -- the newest inference / training run's summary;
* ``/runs/<name>/<file>`` -- a file of the run (``report.html``, ``summary.json``, ``previews/strip.png`` ...).

Nothing outside DIR is ever served: a path with ``..``, a NUL, a backslash or an absolute part is
refused (403), and every file is resolved (symlinks followed) and must still lie inside DIR (403
otherwise); only then does the standard library's ``SimpleHTTPRequestHandler`` send it. A
request whose ``Host`` is not a loopback name with the server's port (``127.0.0.1:P``,
``localhost:P``, ``[::1]:P``, or the address it was bound to) is refused (403: a page elsewhere
cannot reach the server by rebinding its name to 127.0.0.1). A missing run or file is a 404.
Bodies of errors are one short line of text. JSON answers from a run directory are the strict
reader's data (:func:`~diffusion_debug.record.load_run`, as ``report`` reads it) written by the
C encoder, so whatever nesting ``report`` reads, ``serve`` answers. A client that goes away
mid-answer is one line in the log when ``verbose``, and nothing otherwise.

Live endpoints (``live=``, a path -> a callable without arguments returning JSON-able data)
answer the callable's current value instead, as strict JSON; everything else is still read from
DIR, so a live run's files and its summary rebuilt from ``events.jsonl`` are reachable too. This
module never sees the live objects themselves, only those callables. A callable that raises is a
503 with one short line, and the serving thread goes on (it never touches the caller's loop).

Limits: no directory listings inside a run, no authentication (it binds to 127.0.0.1 by
default for that reason), no caching; each request reads the run directory again, so a run
that is still being written shows its latest state. A client that sends nothing for 30 s is
dropped, so no request thread outlives a stuck connection for long.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import logging
import operator
import sys
import threading
import weakref
from http import HTTPStatus
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Mapping
from urllib.parse import quote, unquote, urlsplit

from ..config import DebugConfig
from ..errors import DiffusionDebugError
from ..record import dumps, load_run

__all__ = ["RunServer", "list_runs", "make_server", "start_live_server"]

# A summary's "kind" per endpoint.
_LATEST = {"/debug/summary": "diffusion", "/debug/training/summary": "training"}


class _Refused(Exception):
    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(message)
        self.status = status


def list_runs(root: Path) -> list[dict[str, Any]]:
    """The run directories directly under ``root`` (a summary.json or events.jsonl), newest first."""
    runs = []
    for child in root.iterdir() if root.is_dir() else ():
        if child.is_symlink() or not child.is_dir():
            continue
        if not ((child / "summary.json").is_file() or (child / "events.jsonl").is_file()):
            continue
        entry: dict[str, Any] = {"name": child.name, "modified": child.stat().st_mtime}
        try:
            summary = load_run(child).summary
        except DiffusionDebugError as error:
            entry["error"] = str(error)
        else:
            entry.update(
                kind=summary.get("kind"),
                started=summary.get("started"),
                pipeline=summary.get("pipeline"),
                anomalies=len(summary.get("anomalies") or []),
                incomplete=bool(summary.get("incomplete")),
            )
        entry["report"] = (child / "report.html").is_file()
        runs.append(entry)
    return sorted(runs, key=lambda run: run["modified"], reverse=True)


def _inside(root: Path, parts: list[str]) -> Path:
    """``root/parts...`` resolved, or _Refused when it would leave ``root``."""
    for part in parts:
        if part in ("", ".", "..") or "\x00" in part or "\\" in part or part.startswith("~"):
            raise _Refused(HTTPStatus.FORBIDDEN, "forbidden path")
    target = root.joinpath(*parts).resolve()
    if not target.is_relative_to(root):
        raise _Refused(HTTPStatus.FORBIDDEN, "forbidden path")
    return target


class _Handler(SimpleHTTPRequestHandler):
    """The endpoints of the module docstring; a run's files are served by the standard library's
    :class:`SimpleHTTPRequestHandler` (content types, HEAD, ranges of headers) once our
    containment check has passed, and every error is one short line of text."""

    server: RunServer
    server_version = "diffusion-debug"
    timeout = 30  # seconds a connection may stay silent

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, directory=str(kwargs.pop("root", "")) or None, **kwargs)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        if self.server.verbose:
            super().log_message(format, *args)

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
        self._answer(head=True)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(head=False)

    def _answer(self, *, head: bool) -> None:
        try:
            self._check_host()
            found = self._route(urlsplit(self.path).path)
        except _Refused as refused:
            found = (refused.status, "text/plain; charset=utf-8", f"{refused}\n".encode())
        except DiffusionDebugError as error:  # an unreadable run: say which, in one line
            found = (HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", f"{error}\n".encode())
        except RecursionError:  # deeper than the reader takes is refused by it; this is a last guard
            found = (HTTPStatus.INTERNAL_SERVER_ERROR, "text/plain; charset=utf-8", b"nested too deeply to answer\n")
        if isinstance(found, str):  # a run's file, inside the directory: the standard library serves it
            self.path = found
            super().do_HEAD() if head else super().do_GET()
            return
        status, content_type, body = found
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _check_host(self) -> None:
        """Only one ``Host``, a loopback name or the bound address with the server's port (a page
        elsewhere that rebinds its own name to 127.0.0.1 sends its own name, and is refused)."""
        hosts = self.headers.get_all("Host") or []
        if len(hosts) != 1 or hosts[0].strip().lower() not in self.server.allowed_hosts:
            raise _Refused(HTTPStatus.FORBIDDEN, "forbidden host")

    def _route(self, raw_path: str) -> tuple[HTTPStatus, str, bytes] | str:
        root = self.server.root
        path = unquote(raw_path)
        if "\x00" in path or "\\" in path:
            raise _Refused(HTTPStatus.FORBIDDEN, "forbidden path")
        if path in ("/", "/index.html"):
            from .html_env import render  # jinja2: here, not in every process that imports a debugger

            return HTTPStatus.OK, "text/html; charset=utf-8", render("runs.html", runs=list_runs(root)).encode()
        if path == "/runs":
            return _read_json(list_runs(root))
        if path in self.server.live:
            return _live(path, self.server.live[path])
        if path in _LATEST:
            kind = _LATEST[path]
            latest = next((run for run in list_runs(root) if run.get("kind") == kind), None)
            if latest is None:
                raise _Refused(HTTPStatus.NOT_FOUND, f"no {kind} run in this directory")
            return _read_json(load_run(root / latest["name"]).summary)
        parts = path.split("/")[1:]
        if len(parts) < 3 or parts[0] != "runs":
            raise _Refused(HTTPStatus.NOT_FOUND, "not found")
        run_dir = _inside(root, parts[1:2])
        if not run_dir.is_dir() or run_dir.parent != root:
            raise _Refused(HTTPStatus.NOT_FOUND, "no such run")
        if parts[2:] == ["summary"]:
            try:
                return _read_json(load_run(run_dir).summary)
            except DiffusionDebugError as error:
                raise _Refused(HTTPStatus.NOT_FOUND, str(error)) from None
        target = _inside(root, parts[1:])
        if not target.is_file():
            raise _Refused(HTTPStatus.NOT_FOUND, "no such file")
        return "/" + quote(target.relative_to(root).as_posix())

    # -- what SimpleHTTPRequestHandler does our way ------------------------------------------------
    def guess_type(self, path: Any) -> str:
        content_type = super().guess_type(path)
        if content_type.startswith("text/") or content_type == "application/json":
            content_type += "; charset=utf-8"
        return content_type

    def end_headers(self) -> None:
        self.send_header("X-Content-Type-Options", "nosniff")
        super().end_headers()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        body = f"{message or HTTPStatus(code).phrase}\n".encode()
        self.send_response(code, message)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def _json(data: Any) -> tuple[HTTPStatus, str, bytes]:
    """A live value (tensors, numpy numbers, NaN floats ...) as strict JSON."""
    return HTTPStatus.OK, "application/json", dumps(data).encode()


def _read_json(data: Any) -> tuple[HTTPStatus, str, bytes]:
    """What the strict reader returned (plain JSON data already) as JSON, by the C encoder: one
    level of C recursion per level of nesting, as the reader took, and no Python frame per level.
    A number too large for a float (``1e400`` reads as inf) is written as ``"inf"``, as the record
    writes it."""
    try:
        return HTTPStatus.OK, "application/json", json.dumps(data, allow_nan=False).encode()
    except ValueError:
        return _json(data)


def _live(path: str, answer: Callable[[], Any]) -> tuple[HTTPStatus, str, bytes]:
    """The live value as JSON; a failure is a 503. A RuntimeError (a dict the training loop
    changed while it was read) is tried again, twice."""
    for _ in range(3):
        try:
            return _json(answer())
        except RuntimeError as error:
            failure: Exception = error
        except Exception as error:
            failure = error
            break
    text = f"{type(failure).__name__}: {failure}".splitlines()[0] if str(failure) else type(failure).__name__
    raise _Refused(HTTPStatus.SERVICE_UNAVAILABLE, f"{path} is unavailable now ({text[:160]})")


Live = Mapping[str, Callable[[], Any]]


class RunServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer over one output directory; ``url`` is where it listens.

    ``live``: endpoint path -> callable answering it (see the module docstring). With live
    endpoints the directory may not exist yet (the live run creates it)."""

    daemon_threads = True

    def __init__(
        self,
        root: str | Path,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        verbose: bool = False,
        live: Live | None = None,
    ):
        root = Path(root)
        try:
            port = operator.index(port)  # any integer type: int, numpy's
        except TypeError:
            raise DiffusionDebugError(f"A port is a whole number from 0 to 65535, not {port!r}.") from None
        if not 0 <= port <= 65535:
            raise DiffusionDebugError(f"A port is a whole number from 0 to 65535, not {port}.")
        if not root.is_dir() and not (live and not root.exists()):
            raise DiffusionDebugError(f"{str(root)!r} is not a directory to serve.")
        bad = [path for path in live or {} if not isinstance(path, str) or not path.startswith("/")]
        if bad:
            raise DiffusionDebugError(f"A live endpoint is a path starting with '/', not {bad[0]!r}.")
        self.root = root.resolve()
        self.verbose = verbose
        self.live: dict[str, Callable[[], Any]] = dict(live or {})
        self.thread: threading.Thread | None = None
        super().__init__((host, port), functools.partial(_Handler, root=self.root))
        self.allowed_hosts = _allowed_hosts(self.server_address[0], self.server_address[1])

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client gone mid-answer is one line when ``verbose`` and none otherwise; anything else
        is one line on stderr, never socketserver's traceback."""
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            if self.verbose:
                sys.stderr.write(f"{client_address[0]} went away: {type(error).__name__}\n")
            return
        text = f"{type(error).__name__}: {error}".splitlines()[0][:300] if error is not None else "unknown"
        sys.stderr.write(f"diffusion-debug serve: a request from {client_address[0]} failed: {text}\n")

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start_in_thread(self) -> threading.Thread:
        """Serve from a daemon thread (tests, a live training job); :meth:`stop` ends it."""
        thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.2}, name=SERVER_THREAD, daemon=True
        )
        thread.start()
        self.thread = thread
        return thread

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving, wait for the serving thread and close the socket; idempotent. Called
        from the serving thread itself (a garbage-collector finalizer can run there), it hands
        the stop to a short thread of its own instead of waiting for itself."""
        thread = self.thread
        if thread is threading.current_thread():
            threading.Thread(target=self.stop, name=f"{SERVER_THREAD}-stop", daemon=True).start()
            return
        if thread is not None:  # shutdown() waits for serve_forever, so only once it was started
            self.shutdown()
            thread.join(timeout)
        self.server_close()


def _allowed_hosts(address: str, port: int) -> frozenset[str]:
    """The ``Host`` values answered: each loopback name with the port, and the bound address when
    it is one IP address (a page can only send that Host from this server itself)."""
    names = {"127.0.0.1", "localhost", "[::1]"}
    try:
        bound = ipaddress.ip_address(address)
    except ValueError:
        bound = None
    if bound is not None and not bound.is_unspecified:
        names.add(f"[{bound}]" if bound.version == 6 else str(bound))
    return frozenset(f"{name}:{port}" for name in names)


SERVER_THREAD = "diffusion-debug-serve"
"""The name of the serving thread that :meth:`RunServer.start_in_thread` starts."""


def make_server(
    root: str | Path, port: int = 0, host: str = "127.0.0.1", *, verbose: bool = False, live: Live | None = None
) -> RunServer:
    """A :class:`RunServer` bound to ``host:port`` (port 0: a free one; see ``server.url``);
    a port in use is one DiffusionDebugError."""
    try:
        return RunServer(root, host, port, verbose=verbose, live=live)
    except OSError as error:
        raise DiffusionDebugError(f"Cannot listen on {host}:{port}: {error.strerror or error}.") from None


# -- serve_port: a debugger's run served while it runs ---------------------------------------------


def start_live_server(
    config: DebugConfig,
    owner: Any,
    endpoints: Mapping[str, Callable[[Any], Any]],
    *,
    is_main: bool = True,
    agree: Callable[[Any], Any] | None = None,
) -> RunServer | None:
    """With ``config.serve_port`` set, a server on 127.0.0.1 started in a daemon thread (the
    caller stops it: ``server.stop()``); None when unset, and on every process but the main one.

    ``endpoints`` (path -> function of ``owner``) answer from ``owner`` as it is at each request;
    every other endpoint is ``diffusion-debug serve`` over ``config.output_dir``. ``owner`` is held
    weakly, so a debugger never closed can still be collected (its finalizer stops the server).
    A port that cannot be bound is one DiffusionDebugError, before the caller does any work;
    ``agree`` (the main process's value on every process: a broadcast) makes every process raise it.
    """
    if config.serve_port is None:
        return None
    server, error = None, None
    if is_main:
        ref = weakref.ref(owner)
        live = {path: functools.partial(_answer_from, ref, answer) for path, answer in endpoints.items()}
        try:
            server = make_server(config.output_dir, config.serve_port, live=live)
        except DiffusionDebugError as failure:
            error = f"{str(failure).rstrip('.')}; set another serve_port, or 0 for a free one."
    if agree is not None:
        error = agree(error)
    if error is not None:
        if server is not None:
            server.server_close()
        raise DiffusionDebugError(error)
    if server is not None:
        server.start_in_thread()
        logging.getLogger("diffusion_debug").info("serving the live run at %s/ (%s)", server.url, ", ".join(endpoints))
    return server


def _answer_from(ref: "weakref.ref[Any]", answer: Callable[[Any], Any]) -> Any:
    owner = ref()
    if owner is None:
        raise ReferenceError("the debugger is gone")
    return answer(owner)
