"""serve_port on a DiffusionModelDebugger: /debug/summary answers the running debugger over real HTTP."""

import json
import urllib.error
import urllib.request

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import tiny_pipeline


def _get(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read(), parse_constant=lambda name: pytest.fail(name))


def test_the_live_summary_follows_the_denoising_loop_and_close_ends_it(tmp_path):
    pipe = tiny_pipeline("sd")
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), serve_port=0))
    url = dbg.server_url
    seen = []

    def ask_the_server(pipe, step, timestep, callback_kwargs):  # from inside the loop, after each step
        seen.append(_get(url + "/debug/summary")["steps_recorded"])
        return callback_kwargs

    try:
        with dbg:
            generator = torch.Generator().manual_seed(0)
            pipe("a cat", num_inference_steps=3, generator=generator, callback_on_step_end=ask_the_server)
        assert seen == [1, 2, 3]
        live = _get(url + "/debug/summary")
        assert live == json.loads(json.dumps(dbg.get_summary()))
        assert live["runs"] == 1 and live["pipeline"] == "StableDiffusionPipeline" and not live["attached"]
    finally:
        dbg.close()
    assert dbg.server_url is None
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url + "/debug/summary", timeout=5)


def test_run_prints_where_the_live_run_is_served(tmp_path, monkeypatch, capsys):
    from diffusion_debug.cli import main
    from diffusion_debug.jobs import pipeline_loading

    monkeypatch.setattr(pipeline_loading, "load_pipeline", lambda *args, **kwargs: tiny_pipeline("sd"))
    config = tmp_path / "serve.yaml"
    config.write_text("serve_port: 0\n")
    assert main(["run", "--steps", "2", "--config", str(config), "--output-dir", str(tmp_path / "out")]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("serving the live run at ")]
    assert line.startswith("serving the live run at http://127.0.0.1:") and line.endswith("/debug/summary")


def test_a_constructor_failing_after_the_server_started_stops_it(tmp_path, monkeypatch):
    import threading

    from diffusion_debug.diffusion import debugger as module
    from diffusion_debug.report.server import SERVER_THREAD

    def broken(*args, **kwargs):
        raise RuntimeError("planted failure")

    monkeypatch.setattr(module, "StepPipeline", broken)
    with pytest.raises(RuntimeError, match="planted failure"):
        DiffusionModelDebugger(tiny_pipeline("sd"), DebugConfig(output_dir=str(tmp_path), serve_port=0))
    assert not [t for t in threading.enumerate() if t.name.startswith(SERVER_THREAD) and t.is_alive()]
