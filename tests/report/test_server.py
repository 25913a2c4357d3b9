"""Tests for diffusion_debug.report.server: real HTTP on loopback against a real output directory."""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.request

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger, TrainingDebugger
from diffusion_debug.errors import DiffusionDebugError
from diffusion_debug.report.server import make_server
from diffusion_debug.testing import tiny_pipeline

pytestmark = [
    pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"),
    # one worker under `pytest -n 2 --dist loadgroup`: the module's `site` (three runs saved) is made once,
    # not once on each worker that runs one of its tests
    pytest.mark.xdist_group("report_server"),
]


def _inference_run(output_dir, name):
    pipe = tiny_pipeline("sd")
    pipe.set_progress_bar_config(disable=True)
    debugger = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(output_dir), run_name=name))
    with debugger:
        pipe("a cat", num_inference_steps=1, generator=torch.Generator().manual_seed(0))
    debugger.report().save()
    debugger.close()


def _training_run(output_dir, name):
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    debugger = TrainingDebugger(model, config=DebugConfig(output_dir=str(output_dir), run_name=name))
    for step in range(3):
        loss = model(torch.ones(4, 2)).pow(2).mean()
        loss.backward()
        debugger.monitor_training_step(loss, optimizer=optimizer, step=step)
        optimizer.step()
        optimizer.zero_grad()
    debugger.report().save()
    debugger.close()


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    base = tmp_path_factory.mktemp("serve")
    root = base / "debug_output"
    root.mkdir()
    _training_run(root, "train-1")
    _inference_run(root, "infer-old")
    os.utime(root / "infer-old", (time.time() - 100, time.time() - 100))
    _inference_run(root, "infer-new")
    (base / "secret.txt").write_text("outside")  # next to DIR, never to be served
    (root / "infer-new" / "leak.txt").symlink_to(base / "secret.txt")
    (root / "linked-out").symlink_to(base)
    server = make_server(root, 0)
    server.start_in_thread()
    yield server, root
    server.shutdown()
    server.server_close()


def get(server, path: str):
    """(status, content type, body) of one real HTTP GET; the raw path is sent as is."""
    host, port = server.server_address[:2]
    connection = http.client.HTTPConnection(host, port, timeout=10)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type"), response.read()
    finally:
        connection.close()


def test_binds_to_loopback_on_a_free_port(site):
    server, _ = site
    host, port = server.server_address[:2]
    assert host == "127.0.0.1" and port > 0
    with urllib.request.urlopen(server.url + "/runs", timeout=10) as response:
        assert response.status == 200


def test_runs_lists_every_run_newest_first_as_strict_json(site):
    server, _ = site
    status, content_type, body = get(server, "/runs")
    assert status == 200 and content_type == "application/json"
    runs = json.loads(body, parse_constant=lambda name: pytest.fail(name))
    assert [run["name"] for run in runs][-1] == "infer-old"
    assert {run["name"]: run["kind"] for run in runs} == {
        "infer-new": "diffusion",
        "infer-old": "diffusion",
        "train-1": "training",
    }
    assert all(run["report"] for run in runs)


def test_index_is_html_with_links_to_reports(site):
    server, _ = site
    status, content_type, body = get(server, "/")
    assert status == 200 and content_type.startswith("text/html")
    assert b'<a href="/runs/infer-new/report.html">infer-new</a>' in body


def test_a_runs_summary_and_files(site):
    server, root = site
    status, _, body = get(server, "/runs/train-1/summary")
    assert status == 200 and json.loads(body)["kind"] == "training"
    status, content_type, body = get(server, "/runs/infer-new/report.html")
    assert status == 200 and content_type == "text/html; charset=utf-8"
    assert body == (root / "infer-new" / "report.html").read_bytes()
    status, _, body = get(server, "/runs/infer-new/summary.json")
    assert status == 200 and body == (root / "infer-new" / "summary.json").read_bytes()


def test_latest_inference_and_training_summaries(site):
    server, _ = site
    status, _, body = get(server, "/debug/summary")
    assert status == 200
    assert json.loads(body)["run_dir"].endswith("infer-new")
    status, _, body = get(server, "/debug/training/summary")
    assert status == 200 and json.loads(body)["kind"] == "training"


@pytest.mark.parametrize(
    "path",
    [
        "/runs/infer-new/../../secret.txt",
        "/runs/infer-new/%2e%2e/%2e%2e/secret.txt",
        "/runs/..%2f..%2fsecret.txt/x",
        "/runs/infer-new/%2fetc%2fpasswd",
        "/runs/infer-new//etc/passwd",
        "/runs/infer-new/leak.txt",  # a symlink leaving DIR
        "/runs/linked-out/secret.txt",  # a run that is a symlink out of DIR
        "/runs/infer-new/summary.json%00.png",
        "/runs/infer-new/..%5c..%5csecret.txt",
    ],
)
def test_nothing_outside_the_directory_is_served(site, path):
    server, _ = site
    status, content_type, body = get(server, path)
    assert status in (403, 404), path
    assert content_type.startswith("text/plain")
    assert b"outside" not in body and len(body) < 200


def test_missing_things_are_404_with_a_short_text(site):
    server, _ = site
    assert get(server, "/runs/nope/summary")[:1] == (404,)
    assert get(server, "/runs/infer-new/nope.png")[0] == 404
    assert get(server, "/elsewhere")[0] == 404


def test_no_latest_run_of_a_kind_is_a_404(tmp_path):
    server = make_server(tmp_path, 0)
    server.start_in_thread()
    try:
        status, _, body = get(server, "/debug/training/summary")
        assert (status, body) == (404, b"no training run in this directory\n")
        assert json.loads(get(server, "/runs")[2]) == []
    finally:
        server.shutdown()
        server.server_close()


def test_a_missing_directory_is_one_clear_error(tmp_path):
    with pytest.raises(DiffusionDebugError, match="is not a directory to serve"):
        make_server(tmp_path / "missing")


def test_urlopen_sees_errors_as_http_errors(site):
    server, _ = site
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(server.url + "/runs/infer-new/../../secret.txt", timeout=10)
    info.value.close()  # the error holds the response, and its socket
    assert info.value.code in (403, 404)


def test_live_endpoints_answer_the_callables_current_value(tmp_path):
    counter = {"calls": 0}

    def live_summary():
        counter["calls"] += 1
        return {"total_steps": counter["calls"], "loss": float("nan")}

    def broken():
        raise ValueError("the training loop is between steps\nsecond line")

    missing = tmp_path / "not-yet"  # a live run creates its output directory after the server starts
    server = make_server(missing, 0, live={"/debug/training/summary": live_summary, "/debug/summary": broken})
    server.start_in_thread()
    try:
        for expected in (1, 2):
            status, content_type, body = get(server, "/debug/training/summary")
            assert (status, content_type) == (200, "application/json")
            assert json.loads(body, parse_constant=lambda name: pytest.fail(name)) == {
                "total_steps": expected,
                "loss": "nan",  # strict JSON: the record's spelling of a NaN
            }
        status, content_type, body = get(server, "/debug/summary")
        assert status == 503 and content_type.startswith("text/plain")
        assert body == b"/debug/summary is unavailable now (ValueError: the training loop is between steps)\n"
        assert get(server, "/runs")[:1] == (200,) and json.loads(get(server, "/runs")[2]) == []
        missing.mkdir()
        assert get(server, "/runs/x/summary")[0] == 404
    finally:
        server.stop()
    assert not server.thread.is_alive()
    with pytest.raises(OSError):
        http.client.HTTPConnection(*server.server_address[:2], timeout=2).connect()
    server.stop()  # idempotent


def test_a_live_endpoint_is_a_path():
    with pytest.raises(DiffusionDebugError, match="starting with '/'"):
        make_server(".", 0, live={"debug/summary": dict})


def test_a_port_in_use_is_one_sentence(tmp_path):
    first = make_server(tmp_path, 0)
    try:
        port = first.server_address[1]
        with pytest.raises(DiffusionDebugError, match=rf"^Cannot listen on 127\.0\.0\.1:{port}: .+\.$"):
            make_server(tmp_path, port)
    finally:
        first.stop()


@pytest.mark.parametrize(
    "host", ["evil.example:{port}", "127.0.0.1:1", "localhost", "", "127.0.0.1.evil.example:{port}"]
)
def test_a_request_for_another_host_is_refused(site, host):
    """DNS rebinding: a page on another name that resolves to 127.0.0.1 still sends its own Host."""
    server, _ = site
    address, port = server.server_address[:2]
    connection = http.client.HTTPConnection(address, port, timeout=10)
    try:
        connection.putrequest("GET", "/runs/infer-new/summary.json", skip_host=True)
        if host:
            connection.putheader("Host", host.format(port=port))
        connection.endheaders()
        response = connection.getresponse()
        assert (response.status, response.read()) == (403, b"forbidden host\n")
    finally:
        connection.close()
    for name in ("127.0.0.1", "localhost"):
        connection = http.client.HTTPConnection(address, port, timeout=10)
        try:
            connection.putrequest("HEAD", "/runs/infer-new/summary.json", skip_host=True)
            connection.putheader("Host", f"{name}:{port}")
            connection.endheaders()
            response = connection.getresponse()
            assert response.status == 200 and response.getheader("Content-Type") == "application/json; charset=utf-8"
            assert response.read() == b""  # HEAD: headers only
        finally:
            connection.close()


def _request(server, method: str, path: str, headers: dict | None = None):
    host, port = server.server_address[:2]
    connection = http.client.HTTPConnection(host, port, timeout=10)
    try:
        connection.request(method, path, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def test_head_of_a_file_has_its_headers_and_no_body(site):
    server, root = site
    status, headers, body = _request(server, "HEAD", "/runs/infer-new/report.html")
    assert (status, body) == (200, b"")
    assert headers["Content-type"] == "text/html; charset=utf-8"
    assert int(headers["Content-Length"]) == (root / "infer-new" / "report.html").stat().st_size
    assert headers["X-Content-Type-Options"] == "nosniff"


def test_a_folder_of_a_run_is_not_listed(site):
    server, root = site
    assert (root / "infer-new" / "previews").is_dir()
    for path in ("/runs/infer-new/previews", "/runs/infer-new/previews/", "/runs/infer-new/"):
        status, content_type, body = get(server, path)
        assert status in (403, 404) and content_type.startswith("text/plain"), path
        assert b"strip.png" not in body


def test_an_unreadable_run_says_why_in_its_body_with_a_plain_status_line(tmp_path):
    run_dir = tmp_path / "brokén"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text("{not json")
    server = make_server(tmp_path, 0)
    server.start_in_thread()
    try:
        status, headers, body = _request(server, "GET", "/runs/brok%C3%A9n/summary")
        assert status == 404 and headers["Content-Type"] == "text/plain; charset=utf-8"
        assert "brokén" in body.decode() and "not valid" in body.decode() and body.count(b"\n") == 1
    finally:
        server.stop()


_INDEX_HEAD = (
    "<!doctype html><meta charset=utf-8><title>diffusion-debug runs</title>"
    "<style>body{font-family:sans-serif;margin:2em}td,th{padding:.2em 1em;text-align:left}</style>"
    "<h1>diffusion-debug runs</h1><table><tr><th>run</th><th>kind</th><th>pipeline</th>"
    "<th>anomalies</th><th></th></tr>"
)


def test_index_page_escapes_what_a_run_says_and_names_an_empty_directory(tmp_path):
    server = make_server(tmp_path, 0)
    server.start_in_thread()
    try:
        assert get(server, "/")[2].decode() == _INDEX_HEAD + '<tr><td colspan="5">no runs yet</td></tr></table>'
        run_dir = tmp_path / "a<b>&'c'"
        run_dir.mkdir()
        (run_dir / "summary.json").write_text(json.dumps({"kind": "diffusion", "pipeline": '<i>"P"</i>'}))
        name = "a&lt;b&gt;&amp;&#x27;c&#x27;"
        assert get(server, "/")[2].decode() == (
            f"{_INDEX_HEAD}<tr><td>{name}</td><td>diffusion</td><td>&lt;i&gt;&quot;P&quot;&lt;/i&gt;</td><td>0</td>"
            f'<td><a href="/runs/{name}/summary">summary</a></td></tr></table>'
        )
    finally:
        server.stop()
