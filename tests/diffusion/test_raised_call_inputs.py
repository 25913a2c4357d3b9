"""A pipeline call that raises on a NaN/Inf the user passed before any component receives it
(WanImageToVideoPipeline: transformers' CLIP image processor raises ValueError on a NaN ``image``
before the image encoder runs): the input is the run's error, named in the headline and on disk at
once; the user's exception goes on as it was raised (the same object, message and traceback, also
under policy ``raise``); detach leaves nothing; the run is over, so the debugger's next call has its
own origin; a call that raises with finite inputs records nothing."""

from __future__ import annotations

import json
import traceback

import pytest
import torch
from diffusion_helpers import pipeline_hooks

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.record.anomaly import by_cause
from diffusion_debug.record.run_dir import load_run
from diffusion_debug.testing import plant_nonfinite, tiny_pipeline, zoo_newer
from diffusion_debug.testing.features import kind_missing

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
wan_i2v = pytest.mark.skipif(bool(kind_missing("wan_i2v")), reason=str(kind_missing("wan_i2v")))

MESSAGE = (
    "The pipeline input image= held NaN/Inf, and WanImageToVideoPipeline.__call__ raised ValueError before any "
    "component received it; pass finite values (check how image was made, its dtype and any division or log "
    "before it)."
)


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline("wan_i2v")


def call_kwargs(**extra):
    kwargs = {**zoo_newer.ZOO_CALLS["wan_i2v"][0](), **extra}
    return {**kwargs, "num_inference_steps": 2, "generator": torch.Generator().manual_seed(0), "output_type": "pt"}


def nan_image():
    image = zoo_newer.ZOO_CALLS["wan_i2v"][0]()["image"].clone()
    image[0, 0, 3, 5] = float("nan")
    return image


def cfg(tmp_path, **kwargs):
    return DebugConfig(output_dir=str(tmp_path), log_level="error", **kwargs)


def raised_through(dbg, pipe, **kwargs):
    """The ValueError as the pipeline raised it (and its traceback then) and as it left ``with dbg``."""
    with pytest.raises(ValueError) as left:
        with dbg:
            try:
                pipe(**call_kwargs(**kwargs))
            except ValueError as error:
                inner = (error, error.__traceback__)
                raise
    return inner, left.value


def frames(error):
    return [(f.filename, f.name) for f in traceback.extract_tb(error.__traceback__)]


def errors(anomalies):
    return [a for a in anomalies if a.severity == "error"]


@wan_i2v
@pytest.mark.parametrize("policy", ["record", "raise"])
def test_a_nan_image_the_pipeline_raises_on_is_the_error_and_its_exception_goes_on_unchanged(pipe, tmp_path, policy):
    with pytest.raises(ValueError) as plain:
        pipe(**call_kwargs(image=nan_image()))
    before = pipeline_hooks(pipe)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, policy=policy))
    (inner, tb), left = raised_through(dbg, pipe, image=nan_image())
    # the same exception object with the same traceback object: nothing of ours raised it again or wrapped it
    assert left is inner and left.__traceback__ is tb
    assert type(left) is ValueError and str(left) == str(plain.value)
    assert frames(left)[1:] == frames(plain.value)[1:]  # the frames below the test's own line
    assert pipeline_hooks(pipe) == before and not dbg.attached
    # on disk as the call ended, before any report() or save(): a killed process keeps it
    run_dir = dbg.record.run_dir
    lines = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    (written,) = [line for line in lines if line["type"] == "anomaly"]
    assert (written["kind"], written["severity"], written["component"], written["module"]) == (
        "nonfinite",
        "error",
        "input",
        "image",
    )
    assert written["message"] == MESSAGE
    assert not (run_dir / "summary.json").exists()
    loaded = load_run(run_dir)
    assert loaded.summary["incomplete"] is True
    headline = by_cause(loaded.anomalies)[0]
    assert (headline.component, headline.module, headline.step) == ("input", "image", None)
    report = dbg.report()
    (error,) = errors(report.anomalies)
    assert report.headline is error and error.message == MESSAGE
    assert error.details["inputs"] == ["image"] and error.details["raised"] == "ValueError"
    dbg.close()


@wan_i2v
def test_after_a_raised_call_the_next_call_has_its_own_origin(pipe, tmp_path):
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    raised_through(dbg, pipe, image=nan_image())
    with plant_nonfinite(pipe.transformer.proj_out, value=float("nan")):
        with dbg:
            pipe(**call_kwargs())
    first, second = errors(dbg.report().anomalies)
    assert (first.component, first.module, first.details["run"]) == ("input", "image", 1)
    assert (second.component, second.module, second.step, second.details["run"]) == ("transformer", "proj_out", 0, 2)
    dbg.close()


@wan_i2v
def test_a_call_that_raises_with_finite_inputs_records_nothing(pipe, tmp_path):
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with pytest.raises(ValueError, match="divisible by 16") as raised:  # check_inputs, before any component
        with dbg:
            pipe(**call_kwargs(height=24))
    assert type(raised.value) is ValueError
    with pytest.raises(KeyError):  # the user's own error after a clean call
        with dbg:
            pipe(**call_kwargs())
            raise KeyError("after the call")
    assert [a.kind for a in dbg.report().anomalies if a.kind == "nonfinite"] == []
    assert [row["step"] for row in dbg.report().steps] == [0, 1]
    dbg.close()


@wan_i2v
def test_a_nan_image_raised_on_before_any_event_of_ours_is_still_named(pipe, tmp_path):
    """No hook of ours ran in the call (check_inputs raised first): its arguments are read from its
    frame in the traceback, in a run of its own: not a consequence of the run before's origin."""
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with plant_nonfinite(pipe.transformer.proj_out, value=float("nan")):
        with dbg:
            pipe(**call_kwargs())
    with pytest.raises(ValueError, match="divisible by 16"):
        with dbg:
            pipe(**call_kwargs(image=nan_image(), height=24))
    first, second = errors(dbg.report().anomalies)
    assert (first.component, first.module, first.details["run"]) == ("transformer", "proj_out", 1)
    assert (second.component, second.module, second.details["run"]) == ("input", "image", 2)
    dbg.close()


def test_an_sd_call_that_raises_in_check_inputs_names_its_nan_latents(tmp_path):
    """The same on any stack (the floor's too): Stable Diffusion's check_inputs raises on the height
    before any event of ours, while the ``latents`` passed hold a NaN."""
    pipe = tiny_pipeline("sd")
    latents = torch.zeros(1, 4, 8, 8)
    latents[0, 1, 2, 3] = float("nan")
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with pytest.raises(ValueError, match="divisible by"):
        with dbg:
            pipe("a cat", num_inference_steps=2, height=61, width=32, latents=latents, output_type="pt")
    (error,) = errors(dbg.report().anomalies)
    assert (error.component, error.module, error.step) == ("input", "latents", None)
    assert error.message.startswith(
        "The pipeline input latents= held NaN/Inf, and StableDiffusionPipeline.__call__ raised ValueError before"
    )
    dbg.close()


class _Raising(torch.Tensor):
    """A tensor whose every op making a tensor raises, as the ``GGUFParameter`` a compiled GGUF transformer
    returns (its ``__torch_function__`` rebuilds each tensor result as one: ``KeyError: None``)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        result = super().__torch_function__(func, types, args, kwargs or {})
        if isinstance(result, torch.Tensor):
            raise KeyError(None)
        return result


def test_a_denoiser_output_whose_own_ops_raise_adds_no_error_of_ours_to_the_users(tmp_path):
    """The UNet's output is such a tensor: the pipeline's ``chunk`` raises the user's KeyError, as
    without the debugger. The debugger read that output with the subclass's ops: a ``debugger_error``
    (the unfinished step's check, IndexError or KeyError) on top of the user's exception (two on a
    compiled GGUF Wan 2.2). It reads its values as a tensor's now: nothing is recorded."""
    pipe = tiny_pipeline("sd")

    def raising(module, args, output):
        with torch._C.DisableTorchFunctionSubclass():
            return (output[0].as_subclass(_Raising), *output[1:])

    handle = pipe.unet.register_forward_hook(raising)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    try:
        with pytest.raises(KeyError) as raised:
            with dbg:
                pipe("a cat", num_inference_steps=2, output_type="pt")
    finally:
        handle.remove()
    assert raised.value.args == (None,)
    assert [(a.kind, a.details.get("where")) for a in dbg.report().anomalies] == []
    dbg.close()


def test_the_raised_calls_arguments_are_read_as_they_were_when_it_raised_a_deleted_one_left_out():
    """``pipeline_inputs`` from a raised call's frame, against the values written out: an argument
    rebound in the call is read as rebound, one a closure holds (a cell) as it is, one the call
    deleted is left out (the name-by-name way), ``self`` and ``*args`` never, ``**kwargs`` merged."""
    from diffusion_debug.diffusion.origins import pipeline_inputs

    class Pipe:
        def __call__(self, prompt, steps=2, *args, guidance_scale=7.5, delete=False, **kwargs):
            prompt = prompt + "!"
            scale = lambda: guidance_scale  # noqa: E731  (guidance_scale a cell variable)
            if delete:
                del steps
            raise ValueError(scale())

    pipe = Pipe()
    read = []
    for delete in (False, True):
        with pytest.raises(ValueError) as raised:
            pipe("a cat", 3, "extra positional", delete=delete, eta=0.5)
        tb = raised.value.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        read.append(pipeline_inputs(pipe, tb.tb_frame))
    assert read[0] == {"prompt": "a cat!", "steps": 3, "guidance_scale": 7.5, "delete": False, "eta": 0.5}
    assert read[1] == {"prompt": "a cat!", "guidance_scale": 7.5, "delete": True, "eta": 0.5}
    assert list(read[1]) == ["prompt", "guidance_scale", "delete", "eta"]  # (the call's order)
