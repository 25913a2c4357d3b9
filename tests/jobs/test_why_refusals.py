"""``diffusion-debug why`` on a run directory an attacker edited: a bundle outside the run, crafted
fields of invocation.json and meta.json, inputs larger than the run's call: one line, exit 2."""

from __future__ import annotations

import importlib
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffusion_debug.cli import main
from diffusion_debug.testing import tiny_pipeline

FAULTY_MODULE = "up_blocks.1.resnets.0.conv2"
# one worker under -n 2 --dist loadgroup: the module's `faulty_run` (a saved pipeline and its run) is made once
pytestmark = pytest.mark.xdist_group("why_refusals")


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    """A saved tiny SD with one Inf weight, and a 1-step run of it: a run directory with a bundle."""
    root = tmp_path_factory.mktemp("why")
    pipe = tiny_pipeline("sd", seed=3)
    with torch.no_grad():
        pipe.unet.get_submodule(FAULTY_MODULE).weight.view(-1)[0] = float("inf")
    pipe.save_pretrained(root / "model")
    assert main(["run", "--model", str(root / "model"), "--steps", "1", "--output-dir", str(root / "runs")]) == 0
    (run_dir,) = (root / "runs").iterdir()
    return run_dir


def _copy(run_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy, symlinks=True)
    return copy


def _set_bundle(run_dir, bundle):
    summary = json.loads((run_dir / "summary.json").read_text())
    for anomaly in summary["anomalies"]:
        if "bundle" in anomaly["details"]:
            anomaly["details"]["bundle"] = bundle
    (run_dir / "summary.json").write_text(json.dumps(summary))


def _why(capsys, run_dir):
    capsys.readouterr()
    code = main(["why", str(run_dir)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("where", ["absolute", "dotdot", "symlink"])
def test_why_refuses_a_bundle_outside_the_run_directory(capsys, faulty_run, tmp_path, where):
    copy = _copy(faulty_run, tmp_path)
    outside = faulty_run / "bundles" / "unet-step0"  # a real bundle, in another run directory
    if where == "absolute":
        bundle = str(outside)
        _set_bundle(copy, bundle)
    elif where == "dotdot":
        bundle = f"../../{faulty_run.parent.name}/{faulty_run.name}/bundles/unet-step0"
        (tmp_path / faulty_run.parent.name).symlink_to(faulty_run.parent)
        _set_bundle(copy, bundle)
    else:
        bundle = "bundles/unet-step0"
        shutil.rmtree(copy / bundle)
        (copy / bundle).symlink_to(outside)
    code, out, err = _why(capsys, copy)
    assert (code, out) == (2, "")
    assert err == (
        f"diffusion-debug why: error: the run's repro bundle {bundle!r} is outside the run directory: "
        "a run directory is self-contained, so why reads no bundle from elsewhere.\n"
    )
    assert not (copy / "why.md").exists()


def test_why_refuses_a_crafted_kind_in_invocation_json(capsys, faulty_run, tmp_path):
    copy = _copy(faulty_run, tmp_path)
    (copy / "invocation.json").write_text(json.dumps({"command": "run", "model": None, "kind": "sd; touch pwned"}))
    code, out, err = _why(capsys, copy)
    assert (code, out) == (2, "")
    assert err == (
        "diffusion-debug why: error: invocation.json field 'kind' is 'sd; touch pwned', not one of sd, sdxl, sd3.\n"
    )


def test_why_refuses_a_call_prefix_that_is_no_submodule_as_replay_does(capsys, faulty_run, tmp_path):
    copy = _copy(faulty_run, tmp_path)
    meta_path = copy / "bundles" / "unet-step0" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["call_prefix"] = "__class__.__init__"
    meta_path.write_text(json.dumps(meta))
    message = "meta.json field 'call_prefix' names '__class__.__init__', which UNet2DConditionModel does not have."
    code, out, err = _why(capsys, copy)
    assert (code, out, err) == (2, "", f"diffusion-debug why: error: {message}\n")
    model = json.loads((copy / "invocation.json").read_text())["model"]
    assert main(["replay", str(copy / "bundles" / "unet-step0"), "--model", model]) == 2
    assert capsys.readouterr().err == f"diffusion-debug replay: error: {message}\n"


def test_why_stops_after_the_as_is_replay_when_it_is_slower_than_the_runs_call(
    capsys, monkeypatch, faulty_run, tmp_path
):
    """Inputs 4x the run's (meta agreeing); the run's own unet call recorded as 1 ns and no floor,
    so the bound is met by any replay: why stops before the factor replays, in one line."""
    why = importlib.import_module("diffusion_debug.diffusion.replay.why")  # `replay` is also a function's name

    copy = _copy(faulty_run, tmp_path)
    bundle = copy / "bundles" / "unet-step0"
    tensors = load_file(str(bundle / "inputs.safetensors"))
    tensors["args.0"] = torch.randn(2, 4, 16, 16)
    save_file(tensors, str(bundle / "inputs.safetensors"))
    meta = json.loads((bundle / "meta.json").read_text())
    meta["shapes"]["args.0"] = [2, 4, 16, 16]
    (bundle / "meta.json").write_text(json.dumps(meta))
    summary = json.loads((copy / "summary.json").read_text())
    summary["components"]["unet"]["mean_time_s"] = 1e-9
    (copy / "summary.json").write_text(json.dumps(summary))
    monkeypatch.setattr(why, "REPLAY_TIME_FLOOR_S", 0.0)
    replays = []
    monkeypatch.setattr(why, "_replay_factor", lambda call, factor: replays.append(factor) or pytest.fail("ran"))

    code, out, err = _why(capsys, copy)
    assert (code, out, replays) == (2, "", [])
    assert err.startswith("diffusion-debug why: error: the bundle's unet call took ")
    assert err.endswith(
        "s (10x the run's own call, 1e-09 s): its inputs are larger than the run's call made, "
        "so why stopped before the factor replays.\n"
    )
    assert len(err.splitlines()) == 1 and not (copy / "why.md").exists()


def test_why_on_the_untouched_run_names_the_weights_at_the_top_of_the_report(capsys, faulty_run, tmp_path):
    copy = _copy(faulty_run, tmp_path)
    code, out, _ = _why(capsys, copy)
    verdict = f"no setting fixes it: the weights of unet {FAULTY_MODULE} hold NaN/Inf"
    assert code == 0 and verdict in out
    page = (copy / "report.html").read_text()
    assert f"<p class='why'><b>why:</b> {verdict}" in page
    assert page.index(verdict) < page.index("<section id='anomalies'")  # the answer above every section


def test_why_on_a_killed_run_finds_the_bundle_its_event_file_names(capsys, faulty_run, tmp_path):
    """A run killed (SIGKILL) after its first error saved a bundle, before it wrote summary.json: the
    summary rebuilt from events.jsonl names the bundle, and why replays it (it said "the run had no
    NaN/Inf error to replay", the anomaly's event having been written before its bundle was)."""
    from diffusion_debug.record import load_run

    copy = _copy(faulty_run, tmp_path)
    (copy / "summary.json").unlink()
    (copy / "report.html").unlink()
    (first,) = [a for a in load_run(copy).anomalies if (a.kind, a.severity) == ("nonfinite", "error")]
    assert (first.module, first.details.get("bundle")) == (FAULTY_MODULE, "bundles/unet-step0")
    code, out, err = _why(capsys, copy)
    assert code == 0, err
    assert out.startswith(f"# why: unet {FAULTY_MODULE}, step 0\n")
