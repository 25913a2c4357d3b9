"""serve_port: a TrainingDebugger serves its run live over real HTTP on loopback (urllib)."""

import gc
import json
import socket
import threading
import urllib.error
import urllib.request

import pytest
import torch
from torch import nn

from diffusion_debug import DebugConfig, DiffusionDebugError, TrainingDebugger
from diffusion_debug.report.server import SERVER_THREAD


def _get(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Type"] == "application/json"
        return json.loads(response.read(), parse_constant=lambda name: pytest.fail(name))


def _step(tdbg, model, optimizer, step, *, nan=False):
    loss = model(torch.ones(4, 3)).pow(2).mean()
    loss.backward()
    if nan:
        loss = loss * float("nan")
    tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
    optimizer.step()
    optimizer.zero_grad()


def _server_threads():
    return [t for t in threading.enumerate() if t.name.startswith(SERVER_THREAD) and t.is_alive()]


@pytest.fixture
def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def test_the_live_summary_follows_the_loop_and_close_ends_the_server(tmp_path, model, caplog):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with caplog.at_level("INFO", logger="diffusion_debug"):
        tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path / "out"), serve_port=0))
    url = tdbg.server_url
    assert url.startswith("http://127.0.0.1:") and f"serving the live run at {url}/" in caplog.text
    try:
        for step in range(3):
            _step(tdbg, model, optimizer, step)
        live = _get(url + "/debug/training/summary")
        assert live["total_steps"] == 3 and live == tdbg.get_summary()
        _step(tdbg, model, optimizer, 3, nan=True)  # a planted NaN loss
        live = _get(url + "/debug/training/summary")
        assert live["total_steps"] == 4 and live["loss_anomalies"] == 1 and live["anomaly_counts"]["nonfinite_loss"]
        assert _get(url + "/debug/summary") == {"run": tdbg.record.run_dir.name, "training_debugger": live}
        # the rest is `diffusion-debug serve` over output_dir: this run, its summary rebuilt from its events
        (run,) = _get(url + "/runs")
        assert run["name"] == tdbg.record.run_dir.name and run["incomplete"]
        tdbg.detach()  # detach can be undone: the server stays
        assert tdbg.server_url == url and _get(url + "/debug/training/summary")["total_steps"] == 4
    finally:
        tdbg.close()
    assert tdbg.server_url is None and not _server_threads()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url + "/runs", timeout=5)
    assert tdbg.report().summary["training"]["total_steps"] == 4  # the record still works after close


def test_off_by_default(tmp_path, model):
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path)))
    assert tdbg.server_url is None and not _server_threads()
    tdbg.close()


def test_a_busy_port_is_one_sentence_before_any_run_directory(tmp_path, model):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        with pytest.raises(DiffusionDebugError) as info:
            TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path / "out"), serve_port=port))
    finally:
        busy.close()
    message = str(info.value)
    assert message.startswith(f"Cannot listen on 127.0.0.1:{port}: ") and message.count(".") <= 4
    assert message.endswith("; set another serve_port, or 0 for a free one.") and "\n" not in message
    assert not (tmp_path / "out").exists() and not _server_threads()


def test_a_failing_live_answer_is_a_503_and_training_goes_on(tmp_path, model, monkeypatch):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), serve_port=0))
    try:

        def broken():
            raise RuntimeError("counts are being rebuilt")

        monkeypatch.setattr(tdbg, "get_summary", broken)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(tdbg.server_url + "/debug/training/summary", timeout=10)
        with info.value as response:  # the error holds the response, and its socket
            assert response.code == 503
            assert response.read() == (
                b"/debug/training/summary is unavailable now (RuntimeError: counts are being rebuilt)\n"
            )
        _step(tdbg, model, optimizer, 0)
        monkeypatch.undo()
        assert _get(tdbg.server_url + "/debug/training/summary")["total_steps"] == 1
    finally:
        tdbg.close()


@pytest.mark.usefixtures("only_the_tests_objects")  # its gc.collect() walks only what the test made
def test_a_debugger_never_closed_stops_its_server_when_collected(tmp_path, model):
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), serve_port=0))
    url = tdbg.server_url
    del tdbg
    gc.collect()
    assert not _server_threads()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url + "/runs", timeout=5)
