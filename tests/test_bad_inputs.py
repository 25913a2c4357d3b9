"""Bad inputs and planted faults (issue 14): every bad input is one line and exit 2 before work
starts; a failing disk or a failing pipeline never breaks the run, loses no file and leaves
nothing outside the run directory; nothing a user hands in runs code."""

from __future__ import annotations

import errno
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffusion_debug import DebugConfig
from diffusion_debug.cli import main
from diffusion_debug.core import DebugReport
from diffusion_debug.diffusion import DiffusionModelDebugger
from diffusion_debug.diffusion.replay.bundle import save_bundle
from diffusion_debug.errors import ConfigError, DiffusionDebugError
from diffusion_debug.jobs import pipeline_loading
from diffusion_debug.record import load_json, run_record
from diffusion_debug.testing import tiny_pipeline

CUDA = torch.cuda.is_available()


def run_cli(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit:  # argparse: its one line, then exit 2
        code = exit.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(err: str, message: str) -> None:
    assert message in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def files_under(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


# -- the CLI's values ------------------------------------------------------------------------------

CLI_CASES = [
    (["run", "--steps", "1001"], "--steps 1001 is more than the scheduler's 1000 training timesteps"),
    (["run", "--steps", "0"], "must be at least 1, not 0"),
    (["run", "--steps", "many"], "must be a whole number, not 'many'"),
    (["run", "--height", "7"], "--height 7 is not a multiple of 4 (this pipeline's VAE factor)"),
    (["run", "--width", "30"], "--width 30 is not a multiple of 4"),
    (["run", "--height", "100000"], "--height 100000 is larger than 8192 pixels"),
    (["run", "--kind", "sd3", "--height", "36"], "--height 36 is not a multiple of 8"),
    (["run", "--seed", str(2**70)], "must be between 0 and 2**64-1"),
    (["run", "--seed", "-1"], "must be between 0 and 2**64-1"),
    (["run", "--guidance-scale", "nan"], "must be a finite number, not nan"),
    (["run", "--device", "bogus"], "--device 'bogus' is not a device (e.g. cpu, cuda, cuda:1)."),
    pytest.param(
        ["run", "--device", "cuda"],
        "--device 'cuda': cuda is not available on this machine.",
        marks=pytest.mark.skipif(CUDA, reason="CUDA is available here"),
    ),
    (["doctor", "--device", "bogus"], "is not a device"),
    (["inspect", "--device", "bogus"], "is not a device"),
    (["train", "--learning-rate", "nan"], "--learning-rate must be a positive finite number, not nan."),
    (["train", "--learning-rate", "-1"], "--learning-rate must be a positive finite number"),
    pytest.param(
        ["train", "--mixed-precision", "fp16", "--steps", "1"],
        "--mixed-precision fp16 needs a CUDA GPU on this machine (no CUDA GPU); use bf16 or no.",
        marks=pytest.mark.skipif(CUDA, reason="a CUDA GPU is here"),
    ),
    (["train", "--mixed-precision", "fp16", "--cpu"], "--mixed-precision fp16 needs a CUDA GPU with --cpu"),
]


@pytest.mark.parametrize(("argv", "message"), CLI_CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_a_bad_value_is_one_line_exit_2_and_no_run_directory(capsys, tmp_path, argv, message):
    out_dir = tmp_path / "out"
    code, _, err = run_cli(capsys, *argv, "--output-dir", out_dir) if argv[0] != "inspect" else run_cli(capsys, *argv)
    assert code == 2
    assert_one_line(err, message)
    assert not out_dir.exists() or not any(out_dir.iterdir())  # no run directory was made


def test_an_unwritable_output_dir_is_reported_before_the_pipeline_loads(capsys, tmp_path, monkeypatch):
    loaded = []
    monkeypatch.setattr(pipeline_loading, "load_pipeline", lambda *a, **k: loaded.append(1))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for command in ("run", "train", "doctor", "demo"):
        code, _, err = run_cli(capsys, command, "--output-dir", blocker / "runs")
        assert code == 2
        assert_one_line(err, f"--output-dir {str(blocker / 'runs')!r} cannot be written")
    assert loaded == []


# -- model directories -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"_class_name": "StableDiffusionPipeline",', "model_index.json is not valid JSON"),
        ("", "model_index.json is not valid JSON"),
        ("[1, 2]", "model_index.json is not a pipeline index"),
        ("null", "model_index.json is not a pipeline index"),
        ('{"_class_name": ["evil_pipeline", "Evil"]}', "model_index.json is not a pipeline index"),
        (
            '{"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"]}',
            "could not be loaded",
        ),
    ],
)
@pytest.mark.parametrize("command", ["run", "inspect", "doctor"])
def test_a_broken_model_directory_is_one_line(capsys, tmp_path, content, message, command):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text(content)
    marker = tmp_path / "ran"
    # a custom pipeline module next to the index must never be imported (no model directory runs code)
    (model / "evil_pipeline.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    extra = ["--output-dir", tmp_path / "out"] if command != "inspect" else []
    code, _, err = run_cli(capsys, command, "--model", model, *extra)
    assert code == 2
    assert_one_line(err, message)
    assert not marker.exists()
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []  # no run directory


# -- configs ---------------------------------------------------------------------------------------


def test_a_nul_in_run_name_is_refused():
    with pytest.raises(ConfigError):
        DebugConfig(run_name="run\x00name")
    config = DebugConfig()
    with pytest.raises(ConfigError):
        config.run_name = "a\x00b"


def test_a_yaml_tag_never_runs_code(capsys, tmp_path):
    marker = tmp_path / "ran"
    config = tmp_path / "evil.yaml"
    config.write_text(f"policy: !!python/object/apply:os.system ['touch {marker}']\n")
    code, _, err = run_cli(capsys, "run", "--config", config, "--output-dir", tmp_path / "out")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_huge_config_integer_is_refused_before_the_pipeline_loads(capsys, tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the pipeline loaded")

    monkeypatch.setattr(pipeline_loading, "load_pipeline", never)
    config = tmp_path / "c.yaml"
    config.write_text("history_size: 100000000000000000000\n")
    code, _, err = run_cli(capsys, "run", "--config", config, "--steps", 1, "--output-dir", tmp_path / "out")
    assert code == 2
    assert_one_line(err, "error: Config key 'history_size' must be at most 10000000, not 100000000000000000000.")
    assert not (tmp_path / "out").exists()


# -- bundles for replay ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_bundle(tmp_path_factory) -> Path:
    pipe = tiny_pipeline("sd")
    sample = torch.randn(1, 4, 8, 8)
    return save_bundle(
        tmp_path_factory.mktemp("bundle") / "unet-step0",
        component="unet",
        component_module=pipe.unet,
        call_prefix="",
        args=(sample, torch.tensor(1.0)),
        kwargs={"encoder_hidden_states": torch.randn(1, 77, 32)},
        step=0,
        timestep=1.0,
        module="",
        anomaly_kind="nonfinite",
    )


def _damaged(bundle: Path, tmp_path: Path, damage: str) -> Path:
    copy = tmp_path / "bundle"
    copy.mkdir()
    meta = json.loads((bundle / "meta.json").read_text())
    (copy / "inputs.safetensors").write_bytes((bundle / "inputs.safetensors").read_bytes())
    if damage == "meta-not-json":
        (copy / "meta.json").write_text("{not json")
        return copy
    if damage == "meta-a-list":
        (copy / "meta.json").write_text("[]")
        return copy
    if damage == "no-meta":
        return copy
    if damage == "no-inputs":
        (copy / "inputs.safetensors").unlink()
    elif damage == "corrupt-safetensors":
        (copy / "inputs.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    elif damage == "pickle-as-safetensors":
        import pickle

        (copy / "inputs.safetensors").write_bytes(pickle.dumps(print))
    elif damage == "bad-parameter-dtype":
        meta["parameter_dtype"] = "load"  # never getattr(torch, ...) from a file
    elif damage == "bad-tensor-dtype":
        meta["dtypes"]["args.0"] = "float64"
    elif damage == "missing-component":
        meta["component"] = None
    elif damage == "unknown-component":
        meta["component"] = "__class__"
    elif damage == "tensor-not-in-file":
        meta["call"]["args"] = {"__tuple__": [{"__tensor__": "args.9"}]}
    elif damage == "call-not-packed":
        meta["call"] = "x"
    elif damage == "bad-overflow-fraction":
        meta["overflow_fraction"] = "0.5"
    elif damage == "bad-autocast":
        meta["autocast"] = [["cuda", "load"]]  # never getattr(torch, ...) from a file
    (copy / "meta.json").write_text(json.dumps(meta))
    return copy


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("no-meta", "is not a repro bundle: it has no meta.json."),
        ("meta-not-json", "meta.json is not valid JSON"),
        ("meta-a-list", "meta.json is not a JSON object."),
        ("no-inputs", "the bundle has no inputs.safetensors."),
        ("corrupt-safetensors", "inputs.safetensors is not a readable safetensors file"),
        ("pickle-as-safetensors", "inputs.safetensors is not a readable safetensors file"),
        ("bad-parameter-dtype", "meta.json field 'parameter_dtype' is 'load', expected float32, float16, bfloat16."),
        ("bad-tensor-dtype", "meta.json field 'dtypes' says 'args.0' is 'float64', inputs.safetensors holds float32."),
        ("missing-component", "meta.json field 'component' is None, expected a component name."),
        ("unknown-component", "The pipeline has no component '__class__'"),
        ("tensor-not-in-file", "meta.json's call names tensor 'args.9'; inputs.safetensors lacks it."),
        ("call-not-packed", "meta.json field 'call' is 'x'"),
        ("bad-overflow-fraction", "meta.json field 'overflow_fraction' is '0.5', expected a number in (0, 1]."),
        ("bad-autocast", "meta.json field 'autocast' is [['cuda', 'load']], expected [device type, dtype] pairs."),
    ],
)
def test_a_damaged_bundle_is_one_line(capsys, tmp_path, good_bundle, damage, message):
    bundle = _damaged(good_bundle, tmp_path, damage)
    code, _, err = run_cli(capsys, "replay", bundle)
    assert code == 2
    assert_one_line(err, message)


def test_the_good_bundle_replays(capsys, good_bundle):
    code, out, err = run_cli(capsys, "replay", good_bundle)
    assert code == 1 and "the replay stayed finite" in out and err == ""


# -- training data ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("corrupt-png", "--data: 'b.png' is not a readable image"),
        ("metadata-not-json", "--data: metadata.jsonl line 2 is not a JSON object with a file_name"),
        ("metadata-no-file-name", "--data: metadata.jsonl line 1 is not a JSON object with a file_name"),
    ],
)
def test_broken_training_data_is_one_line(capsys, tmp_path, damage, message):
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(data / "a.png")
    (data / "b.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really" if damage == "corrupt-png" else b"")
    if damage == "corrupt-png":
        (data / "metadata.jsonl").write_text('{"file_name": "a.png", "text": "red"}\n')
    elif damage == "metadata-not-json":
        Image.new("RGB", (16, 16)).save(data / "b.png")
        (data / "metadata.jsonl").write_text('{"file_name": "a.png", "text": "red"}\n{"file_name": "b.png",\n')
    else:
        Image.new("RGB", (16, 16)).save(data / "b.png")
        (data / "metadata.jsonl").write_text('{"text": "red"}\n')
    code, _, err = run_cli(capsys, "train", "--cpu", "--steps", 1, "--data", data, "--output-dir", tmp_path / "out")
    assert code == 2
    assert_one_line(err, message)


# -- a failing disk never breaks the run -----------------------------------------------------------


class FailingStream:
    """``events.jsonl`` on a disk that fills up when ``fail`` is set (ENOSPC on every write)."""

    def __init__(self, path):
        self.file = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - closed by close()
        self.fail = False

    def write(self, text):
        if self.fail:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.file.write(text)

    def flush(self):
        if self.fail:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.file.flush()

    def close(self):
        self.file.close()
        if self.fail:
            raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture
def disk(monkeypatch):
    """The event streams opened from now on; ``disk.fill()`` makes each one fail."""

    class Disk:
        streams: list[FailingStream] = []
        full = False

        def fill(self):
            for stream in self.streams:
                stream.fail = True

    state = Disk()

    def opened(path):
        stream = FailingStream(path)
        stream.fail = state.full
        state.streams.append(stream)
        return stream

    monkeypatch.setattr(run_record, "_open_stream", opened)
    return state


def _generate(pipe, **kwargs):
    return pipe("a cat", num_inference_steps=2, generator=torch.Generator().manual_seed(0), **kwargs).images[0]


def _hooks(pipe) -> int:
    modules = [m for name in ("unet", "vae", "text_encoder") for m in getattr(pipe, name).modules()]
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in modules)


def _patched(pipe) -> set[str]:
    return ({"step", "set_timesteps"} & set(vars(pipe.scheduler))) | ({"encode_prompt"} & set(vars(pipe)))


@pytest.fixture(scope="module")
def clean_image():
    return torch.from_numpy(np.asarray(_generate(tiny_pipeline("sd"))).copy())


@pytest.mark.parametrize("when", ["construction", "attach", "a step", "detach", "close"])
def test_a_full_disk_is_one_debugger_error_and_one_warning(tmp_path, disk, clean_image, when):
    pipe = tiny_pipeline("sd")
    hooks = _hooks(pipe)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        disk.full = when == "construction"  # the very first line (the start event) fails
        dbg = DiffusionModelDebugger(pipe, DebugConfig(level="basic", output_dir=str(tmp_path)))
        if when == "attach":
            disk.fill()

        def on_step_end(pipeline, step, timestep, kwargs):
            if when == "a step" and step == 0:
                disk.fill()
            return kwargs

        with dbg:
            image = _generate(pipe, callback_on_step_end=on_step_end)
            if when == "detach":
                disk.fill()
        if when == "close":
            disk.fill()
        dbg.close()
        dbg.close()
    ours = [w for w in caught if "diffusion-debug" in str(w.message) and "events.jsonl" in str(w.message)]
    if when != "close":  # at close the stream has nothing left to lose: it is only recorded
        assert len(ours) == 1, [str(w.message) for w in caught]
        errors = [a for a in dbg.report().anomalies if a.kind == "debugger_error"]
        assert len(errors) == 1 and "No space left on device" in errors[0].message
    assert torch.equal(torch.from_numpy(np.asarray(image).copy()), clean_image)  # the image is untouched
    assert _hooks(pipe) == hooks and not _patched(pipe)
    run_dir = dbg.report().save()  # summary.json still holds the whole record
    assert load_json(run_dir / "summary.json")["stream_error"].startswith("OSError")
    assert set(files_under(tmp_path)) <= {run_dir.name} | {f"{run_dir.name}/{p}" for p in files_under(run_dir)}


def test_a_pipeline_exception_inside_with_leaves_no_hook_or_wrapper(tmp_path, capsys):
    pipe = tiny_pipeline("sd")
    hooks = _hooks(pipe)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(level="basic", output_dir=str(tmp_path)))

    def boom(pipeline, step, timestep, kwargs):
        raise RuntimeError("out of memory (planted)")

    with pytest.raises(RuntimeError, match="planted"):
        with dbg:
            _generate(pipe, callback_on_step_end=boom)
    assert _hooks(pipe) == hooks and not _patched(pipe) and not dbg.attached
    run_dir = dbg.report().save()
    dbg.close()
    code, out, _ = run_cli(capsys, "report", run_dir)
    assert code == 0 and "steps (1 recorded)" in out


def test_policy_raise_on_a_full_disk_raises_the_policy_error_not_oserror(tmp_path, monkeypatch):
    from diffusion_debug.testing.faults import plant_nonfinite

    def full(self, html=True):
        raise OSError(errno.ENOSPC, "No space left on device")

    pipe = tiny_pipeline("sd")
    hooks = _hooks(pipe)
    plant_nonfinite(pipe.unet.get_submodule("up_blocks.1.resnets.0.conv2"))
    dbg = DiffusionModelDebugger(pipe, DebugConfig(level="basic", policy="raise", output_dir=str(tmp_path)))
    monkeypatch.setattr(DebugReport, "save", full)
    with pytest.raises(DiffusionDebugError, match="could not be saved .*No space left on device"):
        with dbg:
            _generate(pipe)
    dbg.close()
    assert not _patched(pipe) and _hooks(pipe) == hooks + 1  # only the planted fault's hook


def test_the_training_debugger_on_a_full_disk_goes_on(tmp_path, disk):
    from diffusion_debug.training import TrainingDebugger

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dbg = TrainingDebugger(model, config=DebugConfig(level="basic", output_dir=str(tmp_path)))
        disk.fill()
        with dbg:
            for step in range(3):
                loss = model(torch.randn(2, 4)).pow(2).mean()
                loss.backward()
                dbg.monitor_training_step(loss, optimizer, step=step)
                optimizer.step()
                optimizer.zero_grad()
        dbg.close()
    assert len([w for w in caught if "events.jsonl" in str(w.message)]) == 1
    summary = load_json(dbg.report().save() / "summary.json")
    assert len(summary["steps"]) == 3 and summary["anomaly_counts"].get("debugger_error") == 1


# -- the CLI keeps what it can -------------------------------------------------------------------------


def _failing_pipeline(*args, **kwargs):
    pipe = tiny_pipeline("sd")
    pipe.set_progress_bar_config(disable=True)
    calls = {"n": 0}

    def fail_on_second_call(module, inputs, output):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("CUDA out of memory (planted)\nTried to allocate 20 GiB")

    pipe.unet.register_forward_hook(fail_on_second_call)
    return pipe


def test_run_whose_pipeline_raises_keeps_a_run_directory_report_can_read(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline_loading, "load_pipeline", _failing_pipeline)
    code, _, err = run_cli(capsys, "run", "--steps", 3, "--output-dir", tmp_path)
    assert code == 1
    assert_one_line(err, "the pipeline failed: RuntimeError: CUDA out of memory (planted) Tried to allocate 20 GiB")
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert {"events.jsonl", "summary.json", "report.html"} <= set(files_under(run_dir))
    assert str(run_dir) in err
    code, out, err = run_cli(capsys, "report", run_dir)
    assert code == 0 and err == "" and "steps (1 recorded)" in out


def test_report_on_a_run_killed_before_its_summary(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline_loading, "load_pipeline", _failing_pipeline)
    run_cli(capsys, "run", "--steps", 3, "--output-dir", tmp_path)
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    (run_dir / "summary.json").unlink()  # as if the process died before saving
    code, out, _ = run_cli(capsys, "report", run_dir)
    assert code == 0 and "incomplete" in out.lower()


def test_run_on_a_full_disk_keeps_image_png_and_exits_with_one_line(capsys, tmp_path, monkeypatch):
    def full(self, html=True):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DebugReport, "save", full)
    code, _, err = run_cli(capsys, "run", "--steps", 2, "--output-dir", tmp_path)
    assert code == 1
    assert_one_line(err, "the report could not be saved: No space left on device; the image is kept:")
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert (run_dir / "image.png").is_file() and Image.open(run_dir / "image.png").size == (32, 32)
    assert files_under(tmp_path) <= {run_dir.name} | {f"{run_dir.name}/{p}" for p in files_under(run_dir)}


# -- hostile strings --------------------------------------------------------------------------------


def test_hostile_strings_are_escaped_in_report_html_and_stripped_in_the_terminal(capsys, tmp_path):
    hostile = "<script>alert(1)</script>\x1b[2J\x07"
    code, out, _ = run_cli(capsys, "run", "--steps", 1, "--output-dir", tmp_path, "--prompt", hostile + " word" * 90)
    assert code == 0
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    summary = load_json(run_dir / "summary.json")
    summary["anomalies"].append(dict(summary["anomalies"][0], message=hostile))
    (run_dir / "summary.json").write_text(json.dumps(summary))
    code, out, _ = run_cli(capsys, "report", run_dir)
    assert code == 0 and "\x1b" not in out and "\x07" not in out
    assert "<script>alert" not in (run_dir / "report.html").read_text()
