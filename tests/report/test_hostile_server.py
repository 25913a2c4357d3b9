"""The local server against a hostile page or client (issue 24): only a loopback Host with the
server's own port is answered, by ``serve`` and by a debugger's ``serve_port`` alike; a summary
``report`` reads is answered however deeply it nests; a client that goes away is no traceback;
a port out of range is one sentence."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.cli import main
from diffusion_debug.errors import DiffusionDebugError
from diffusion_debug.report.server import make_server

DEPTH = 900  # `report` reads a summary nested this deeply; serve's JSON writer once recursed per level in Python


def _summary(**extra):
    return {"kind": "diffusion", "anomalies": [], "steps": [], **extra}


def _deep(depth: int) -> dict:
    nested: dict = {}
    for _ in range(depth):
        nested = {"a": nested}
    return nested


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-serve")
    for name, summary in (("plain", _summary()), ("deep", _summary(extra=_deep(DEPTH)))):
        (root / name).mkdir()
        (root / name / "summary.json").write_text(json.dumps(summary))  # C encoder: any depth
    (root / "huge-number").mkdir()  # 1e400 reads as inf: a strict writer must still answer it
    (root / "huge-number" / "summary.json").write_text('{"kind": "diffusion", "started": 1e400}')
    (root / "plain" / "big.bin").write_bytes(b"\0" * (32 << 20))  # more than loopback's buffers
    server = make_server(root, 0)
    server.start_in_thread()
    yield server, root
    server.stop()


def ask(address, path: str, hosts: list[str], method: str = "GET") -> tuple[int, bytes]:
    """(status, body) of one request with exactly these Host headers."""
    connection = http.client.HTTPConnection(*address[:2], timeout=10)
    try:
        connection.putrequest(method, path, skip_host=True)
        for host in hosts:
            connection.putheader("Host", host)
        connection.endheaders()
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


GOOD_HOSTS = ["127.0.0.1:{port}", "localhost:{port}", "[::1]:{port}", "LocalHost:{port}"]
BAD_HOSTS = [
    ["attacker.example:{port}"],
    ["127.0.0.1:{other}"],  # the wrong port
    ["localhost:{other}"],
    ["[::1]:{other}"],
    ["[::1]"],
    ["localhost.:{port}"],
    ["127.0.0.2:{port}"],
    ["localhost:{port}", "attacker.example:{port}"],  # two Hosts: which one a proxy reads is unknown
    [],
]


def _fill(hosts: list[str], port: int) -> list[str]:
    return [host.format(port=port, other=port + 1 if port < 65535 else port - 1) for host in hosts]


@pytest.mark.parametrize("host", GOOD_HOSTS)
def test_serve_answers_a_loopback_host_with_its_port(site, host):
    server, _ = site
    port = server.server_address[1]
    assert ask(server.server_address, "/runs/plain/summary", _fill([host], port)) == (
        200,
        json.dumps(_summary()).encode(),
    )


@pytest.mark.parametrize("hosts", BAD_HOSTS, ids=lambda hosts: " + ".join(hosts) or "no Host")
def test_serve_refuses_every_other_host(site, hosts):
    server, _ = site
    port = server.server_address[1]
    for path in ("/", "/runs", "/runs/plain/summary", "/runs/plain/summary.json", "/debug/summary"):
        assert ask(server.server_address, path, _fill(hosts, port)) == (403, b"forbidden host\n")


def test_the_address_it_was_bound_to_is_a_host_too(tmp_path):
    """`serve --host 127.0.0.2`: a page can send that Host only when it came from this server."""
    server = make_server(tmp_path, 0, host="127.0.0.2")
    server.start_in_thread()
    try:
        port = server.server_address[1]
        assert ask(server.server_address, "/runs", [f"127.0.0.2:{port}"]) == (200, b"[]")
        assert ask(server.server_address, "/runs", [f"attacker.example:{port}"])[0] == 403
    finally:
        server.stop()


def test_a_debuggers_live_server_checks_the_host_too(tmp_path):
    model = torch.nn.Linear(2, 1)
    debugger = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), serve_port=0))
    try:
        server = debugger._server
        port = server.server_address[1]
        for path in ("/debug/training/summary", "/debug/summary", "/runs"):
            for hosts in BAD_HOSTS:
                assert ask(server.server_address, path, _fill(hosts, port)) == (403, b"forbidden host\n"), hosts
            for host in GOOD_HOSTS:
                assert ask(server.server_address, path, _fill([host], port))[0] == 200
        status, body = ask(server.server_address, "/debug/training/summary", [f"[::1]:{port}"])
        assert json.loads(body)["total_steps"] == 0
    finally:
        debugger.close()


def test_a_summary_nested_as_deep_as_report_reads_is_answered(site, capsys):
    server, root = site
    port = server.server_address[1]
    status, body = ask(server.server_address, "/runs/deep/summary", [f"127.0.0.1:{port}"])
    assert status == 200 and json.loads(body) == _summary(extra=_deep(DEPTH))
    assert main(["report", str(root / "deep"), "--no-html"]) == 0  # report reads it too
    assert capsys.readouterr().err == ""


def test_a_number_too_large_for_a_float_is_answered_as_the_record_writes_inf(site):
    server, _ = site
    port = server.server_address[1]
    status, body = ask(server.server_address, "/runs/huge-number/summary", [f"127.0.0.1:{port}"])
    assert status == 200 and json.loads(body, parse_constant=pytest.fail) == {"kind": "diffusion", "started": "inf"}


def _reset_mid_answer(address, path: str) -> None:
    """Ask for ``path``, read a little of the answer, then drop the connection with a reset (RST)."""
    with socket.create_connection(address[:2], timeout=10) as client:
        client.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{address[1]}\r\n\r\n".encode())
        assert client.recv(12) == b"HTTP/1.0 200"
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _request_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.endswith("(process_request_thread)")]


def test_a_client_that_resets_mid_answer_prints_nothing(site, capfd):
    server, _ = site
    capfd.readouterr()
    for path in ("/runs/plain/big.bin", "/runs/plain/big.bin"):
        _reset_mid_answer(server.server_address, path)
    deadline = time.monotonic() + 20
    while _request_threads() and time.monotonic() < deadline:  # the answering threads meet the reset
        time.sleep(0.05)
    assert not _request_threads()
    assert capfd.readouterr().err == ""
    assert ask(server.server_address, "/runs", [f"127.0.0.1:{server.server_address[1]}"])[0] == 200  # serving on


def test_a_disconnect_is_one_line_when_verbose_and_another_failure_never_a_traceback(tmp_path, capfd):
    server = make_server(tmp_path, 0, verbose=True)
    try:
        for error in (ConnectionResetError(104, "Connection reset by peer"), BrokenPipeError(32, "Broken pipe")):
            try:
                raise error
            except OSError:
                server.handle_error(None, ("127.0.0.1", 5555))
        try:
            raise ValueError("planted\nsecond line")
        except ValueError:
            server.handle_error(None, ("127.0.0.1", 5555))
        assert capfd.readouterr().err.splitlines() == [
            "127.0.0.1 went away: ConnectionResetError",
            "127.0.0.1 went away: BrokenPipeError",
            "diffusion-debug serve: a request from 127.0.0.1 failed: ValueError: planted",
        ]
    finally:
        server.stop()


@pytest.mark.parametrize("port", [-1, 65536, 99999, 2**70, "8080", 1.5])
def test_a_port_out_of_range_is_one_sentence(tmp_path, port):
    with pytest.raises(DiffusionDebugError, match=r"^A port is a whole number from 0 to 65535, not .+\.$"):
        make_server(tmp_path, port)


def test_a_numpy_port_is_a_port(tmp_path):
    server = make_server(tmp_path, np.int64(0))
    try:
        assert server.server_address[1] > 0
    finally:
        server.stop()


@pytest.mark.parametrize("port", ["99999", "-1", str(2**70), "eighty"])
def test_serve_port_out_of_range_is_one_line_exit_2(tmp_path, capsys, port):
    with pytest.raises(SystemExit) as exit:
        main(["serve", str(tmp_path), "--port", port])
    assert exit.value.code == 2
    assert capsys.readouterr().err == (
        f"diffusion-debug serve: error: argument --port: must be a port from 0 to 65535, not '{port}' "
        "(--help for usage)\n"
    )


def test_the_serve_command_takes_a_free_port_checks_the_host_and_stops_quietly(site):
    """The real command in its own process: port 0 by default (printed), the Host check, a client
    reset mid-answer, Ctrl-C: and nothing on stderr."""
    _, root = site
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    process = subprocess.Popen(
        [sys.executable, "-m", "diffusion_debug.cli", "serve", str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # Ctrl-C as a terminal sends it: a shell without job control (CI's `make test &`) starts its
        # children with SIGINT ignored, and Python then installs no KeyboardInterrupt for it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        line = process.stdout.readline()
        found = re.fullmatch(
            rf"serving {re.escape(str(root))} at http://127\.0\.0\.1:(\d+)/ \(Ctrl-C to stop\)\n", line
        )
        assert found, line
        address = ("127.0.0.1", int(found.group(1)))
        assert address[1] > 0
        assert ask(address, "/runs/plain/summary", [f"attacker.example:{address[1]}"]) == (403, b"forbidden host\n")
        status, body = ask(address, "/runs/deep/summary", [f"localhost:{address[1]}"])
        assert status == 200 and json.loads(body) == _summary(extra=_deep(DEPTH))
        _reset_mid_answer(address, "/runs/plain/big.bin")
        assert ask(address, "/runs", [f"localhost:{address[1]}"])[0] == 200
    finally:
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    assert process.returncode == 0 and err == "" and out == ""
