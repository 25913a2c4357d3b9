"""`launch`'s seams never break the job they watch (in-process, each seam as a launched process
installs it): a backward or an optimizer step on another thread while one runs is its own; a give-up
with a debugger made closes it there (the script runs on as a plain run, bitwise); after the end, a
wrapper of ours left inside the script's own passes through; DeepSpeed's engine class is put back as
it was, whether it defines the methods or inherits them. And the shapes of a training loop a script
may have: ``torch.autograd.backward`` on a list of one, two ``backward`` calls a step
(``retain_graph``), a step the GradScaler skips."""

from __future__ import annotations

import functools
import gc
import importlib.util
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch.amp import GradScaler

from diffusion_debug.jobs.launch_deepspeed import _patch_engine_class
from diffusion_debug.jobs.launch_end import NO_HTML
from diffusion_debug.jobs.launched import ENDED, LaunchWatch
from diffusion_debug.record import by_cause, load_run
from diffusion_debug.testing.launch import cpu_launch_env

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 60  # a thread waiting on the other one: ends at once but on a stuck test


@pytest.fixture(autouse=True)
def _no_report_html(monkeypatch):
    """The runs these tests save are read from summary.json and the steps, never from report.html:
    ``DIFFUSION_DEBUG_NO_HTML`` spares each ``finish`` its plots (about a second of CPU a test)."""
    monkeypatch.setenv(NO_HTML, "1")


@pytest.fixture
def torch_own():
    """torch's own ``backward`` functions, put back after the test whatever it left (and
    Accelerate's own ``Accelerator.prepare``, which a watch's install wraps)."""
    import accelerate

    own = torch.Tensor.backward, torch.autograd.backward, torch.nn.Module.__getstate__
    prepare = accelerate.Accelerator.prepare
    yield own
    torch.Tensor.backward, torch.autograd.backward, torch.nn.Module.__getstate__ = own
    accelerate.Accelerator.prepare = prepare


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


X = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))


def _launch_hooks():
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    return [getattr(hook, "__self__", None) for hook in _global_optimizer_pre_hooks.values()]


def _hooks(model: torch.nn.Module) -> int:
    """The hooks on ``model``'s modules and parameters (none on a model nothing watches)."""
    modules = sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) + len(m._backward_pre_hooks)
        for m in model.modules()
    )
    parameters = sum(
        len(p._backward_hooks or {}) + len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
        for p in model.parameters()
    )
    return modules + parameters


def _installed_watch(tmp_path: Path, script: str) -> LaunchWatch:
    """A launch watch installed as a launched process installs it, saving its run under ``tmp_path / "runs"``
    (the caller finishes and uninstalls it)."""
    watch = LaunchWatch({"output_dir": str(tmp_path / "runs")}, script)
    watch.check_settings()
    watch.install()
    return watch


def _plain_then_watched(tmp_path: Path, loop, script: str = "train.py"):
    """``loop()`` run plain, then again under a launch watch (installed as a launched process
    installs it, finished as its end does, uninstalled whatever happens) that saves its run under
    ``tmp_path / "runs"``: what the plain run returned, what the watched one returned, and the run."""
    plain = loop()
    watch = _installed_watch(tmp_path, script)
    try:
        watched = loop()
        watch.finish()
    finally:
        watch.uninstall()
    (run_dir,) = (tmp_path / "runs").iterdir()
    return plain, watched, load_run(run_dir)


# -- threads ---------------------------------------------------------------------------------------


def _started(target) -> tuple[threading.Thread, list[BaseException]]:
    """``target()`` running on a thread of its own: the thread, and what it raised (kept for the test)."""
    errors: list[BaseException] = []

    def run():
        try:
            target()
        except BaseException as error:  # pragma: no cover - what the test would report
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def test_a_backward_on_another_thread_while_one_runs_is_a_loss_of_its_own(torch_own):
    """Thread A's backward waits inside (a hook on its loss) while this thread's backward runs: that
    one is observed at once (its loss kept), then A's when it ends, each thread's loss its own. A flag
    shared by the threads passed the second by, as if it were an inner call of A's; and one loss for
    the process had A's replace this thread's (its step then read A's loss, and A's step none)."""
    watch = LaunchWatch({}, "train.py")
    watch.install()
    a_inside, b_done = threading.Event(), threading.Event()
    model_a, model_b = _model(0), _model(1)
    loss_a, loss_b = model_a(X).pow(2).mean(), model_b(X).pow(2).mean()

    def wait_inside(grad):
        a_inside.set()
        b_done.wait(WAIT_S)

    loss_a.register_hook(wait_inside)
    seen = {}

    def thread_a():
        loss_a.backward()
        seen["a"] = watch.loss

    thread, errors = _started(thread_a)
    try:
        assert a_inside.wait(WAIT_S)
        loss_b.backward()
        seen["b"] = watch.loss
        b_done.set()
        thread.join(WAIT_S)
        assert not thread.is_alive() and errors == []
        assert seen["b"] is not None and torch.equal(seen["b"], loss_b.detach())
        assert seen["a"] is not None and torch.equal(seen["a"], loss_a.detach())
        assert watch.loss is seen["b"] and watch.thread.micro is None  # A's loss is A's: none of this thread's
        # each thread's inner calls are still not another loss: Tensor.backward runs autograd's
        loss_c = model_b(X).sum()
        watch.loss = None
        loss_c.backward()
        assert torch.equal(watch.loss, loss_c.detach()) and watch.thread.micro is None
    finally:
        b_done.set()
        thread.join(WAIT_S)
        watch.uninstall()
    assert (torch.Tensor.backward, torch.autograd.backward) == torch_own[:2]


def test_a_give_up_in_one_threads_optimizer_step_while_another_thread_stepped_leaves_the_hook_till_the_end(
    torch_own,
):
    """Thread A is in torch's global optimizer pre-hook (launch's) while this thread's step runs it
    through and returns; then A gives up there. The hook must stay (torch iterates over its dict in
    A's ``step``) until the end: a flag shared by the threads said none was running, and the removal
    raised in A's step where another global pre-hook follows launch's (a library's: RuntimeError:
    OrderedDict mutated during iteration)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    watch = LaunchWatch({}, "train.py")
    watch.install()  # before the script makes its models, as a launched process does: launch notes them
    model_a, model_b = _model(0), _model(1)
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.5)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.5)
    for model in (model_a, model_b):
        model(X).pow(2).mean().backward()
    expected = [[p.detach() - 0.5 * p.grad for p in m.parameters()] for m in (model_a, model_b)]
    library = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: None)
    a_inside, b_done = threading.Event(), threading.Event()
    errors = []

    def held(optimizer, **settings):  # launch's read of the step, where thread A waits and gives up
        if threading.current_thread() is thread:
            a_inside.set()
            b_done.wait(WAIT_S)
            watch.give_up("the debugger could not be made (OSError: disk full)")

    watch._optimizer_step = held

    def thread_a():
        try:
            opt_a.step()
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=thread_a)
    try:
        thread.start()
        assert a_inside.wait(WAIT_S)
        opt_b.step()
        b_done.set()
        thread.join(WAIT_S)
        assert not thread.is_alive()
        assert errors == []
        for model, weights in zip((model_a, model_b), expected):
            assert all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), weights))
        assert watch.failed is not None and watch in _launch_hooks()
        watch.finish()
        assert watch not in _launch_hooks()
    finally:
        b_done.set()
        thread.join(WAIT_S)
        watch.uninstall()
        library.remove()


def test_two_threads_scaling_at_once_keep_each_the_loss_its_grad_scaler_scaled(torch_own):
    """Thread A scales its loss and waits before its backward while this thread scales and backwards
    its own: each backward keeps the loss its own thread scaled. One scaled loss remembered for the
    process: this thread's scale replaced A's, and A's backward kept A's loss times 1024."""
    from torch.amp import GradScaler

    watch = LaunchWatch({}, "train.py")
    watch.install()
    scaler = GradScaler("cpu", init_scale=1024.0)
    model_a, model_b = _model(0), _model(1)
    loss_a, loss_b = model_a(X).pow(2).mean(), model_b(X).pow(2).mean()
    a_scaled, b_done = threading.Event(), threading.Event()
    seen = {}

    def thread_a():
        scaled = scaler.scale(loss_a)
        a_scaled.set()
        b_done.wait(WAIT_S)
        scaled.backward()
        seen["a"] = watch.loss

    thread, errors = _started(thread_a)
    try:
        assert a_scaled.wait(WAIT_S)
        scaler.scale(loss_b).backward()
        seen["b"] = watch.loss
        b_done.set()
        thread.join(WAIT_S)
        assert not thread.is_alive() and errors == []
    finally:
        b_done.set()
        thread.join(WAIT_S)
        watch.uninstall()
    assert torch.equal(seen["b"], loss_b.detach()) and torch.equal(seen["a"], loss_a.detach())


def test_an_accelerator_backward_on_one_thread_leaves_another_threads_plain_backward_watched(torch_own):
    """Thread A trains through ``Accelerator.backward`` (the ``loss.backward()`` Accelerate runs inside
    it is not another loss), then this thread backwards a plain model's loss: that one is kept. One
    flag for the process said every backward after A's first ``Accelerator.backward`` was Accelerate's
    own: this thread's loss was never kept."""
    import accelerate

    own_prepare = accelerate.Accelerator.prepare
    watch = LaunchWatch({}, "train.py")
    watch.install()
    seen = {}
    try:
        accelerator = accelerate.Accelerator(cpu=True)
        model_a = accelerator.prepare(_model(0))
        loss_a = model_a(X).pow(2).mean()

        def thread_a():
            accelerator.backward(loss_a)
            seen["a"] = watch.loss

        thread, errors = _started(thread_a)
        thread.join(WAIT_S)
        assert not thread.is_alive() and errors == []
        loss_b = _model(1)(X).pow(2).mean()
        loss_b.backward()
        seen["b"] = watch.loss
    finally:
        watch.uninstall()
        accelerate.Accelerator.prepare = own_prepare
    assert torch.equal(seen["a"], loss_a.detach()) and torch.equal(seen["b"], loss_b.detach())


def test_a_backward_run_inside_another_backwards_graph_is_not_a_loss(torch_own):
    """A reentrant backward (``torch.utils.checkpoint``'s) runs ``torch.autograd.backward`` on its
    segment's outputs, given their gradients, inside the graph of the backward that reached it; on a
    GPU in autograd's own thread, where no flag of the script's thread is set. It is not a loss:
    here under ``torch.autograd.grad``, which no seam observes, a Function's backward does the same
    (counted, it would keep the segment's outputs times their gradients as the loss)."""
    model = _model()

    class Reentrant(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return model(x)

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            with torch.enable_grad():
                inner = x.detach().requires_grad_()
                torch.autograd.backward(model(inner), grad)
            return inner.grad

    x = X.clone().requires_grad_()
    watch = LaunchWatch({}, "train.py")
    watch.install()
    try:
        (grad,) = torch.autograd.grad(Reentrant.apply(x).pow(2).mean(), [x])
        kept = watch.loss
    finally:
        watch.uninstall()
    assert grad.shape == x.shape and model[0].weight.grad is not None
    assert kept is None


def test_the_backward_seam_adds_no_python_call_a_step(torch_own):
    """The per-thread state is attributes (a ``threading.local``'s), no Python call: a watched
    ``loss.backward()`` runs the two seams' functions and nothing more of ours (a backward of
    several tensors, or one given its gradient, adds the sum of its loss; a second backward before
    the step, the keeping of the first as a micro-step of it)."""
    model = _model()
    watch = LaunchWatch({}, "train.py")
    watch.install()
    try:
        model(X).pow(2).mean().backward()  # the first: the early check is tried there
        watch.loss = None  # read, as an optimizer step reads it (a backward before that joins this one)
        loss = model(X).pow(2).mean()
        calls = []

        def count(frame, event, arg):
            if event == "call" and frame.f_code.co_filename.endswith("launch_plain.py"):
                calls.append(frame.f_code.co_name)

        sys.setprofile(count)
        try:
            loss.backward()
        finally:
            sys.setprofile(None)
    finally:
        watch.uninstall()
    assert calls == ["backward", "observed", "autograd", "observed"]


# -- a give-up with a debugger made ----------------------------------------------------------------


def _accelerate_script(watch: LaunchWatch | None = None, plant=None) -> list[torch.Tensor]:
    """Four steps of an Accelerate script that prepares a second optimizer after step 1 (``plant``:
    what goes wrong in launch's watch of that ``prepare``); its final weights."""
    import accelerate

    accelerator = accelerate.Accelerator(cpu=True)
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    other = _model(2)
    for step in range(4):
        accelerator.backward(model(X).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:
            if plant is not None:
                plant()
            accelerator.prepare(torch.optim.SGD(other.parameters(), lr=0.1))
            assert _hooks(model) == 0  # under launch: the debugger let go at the give-up
    return [p.detach().clone() for p in model.parameters()]


def test_a_give_up_after_the_debugger_was_made_closes_it_there_and_the_run_goes_on_bitwise_plain(
    tmp_path, monkeypatch, capsys, torch_own
):
    """Launch gives up in the script's second ``prepare`` (a planted failure of its watch), with the
    debugger made at step 0: that debugger's hooks go at once (none left on the model; it stayed
    attached till the end before), the later steps are those of the plain script bitwise, and the
    end saves the run of the two steps it monitored."""

    plain = _accelerate_script()
    watch = _installed_watch(tmp_path, "train.py")

    def plant():
        def fail(optimizer):
            raise RuntimeError("planted")

        assert watch.debugger is not None and watch.debugger.attached
        monkeypatch.setattr(watch, "_wrap_step", fail)

    try:
        watched = _accelerate_script(watch, plant)
        assert watch.failed == "the debugger could not watch Accelerator.prepare (RuntimeError: planted)"
        assert watch.debugger is not None and not watch.debugger.attached
        watch.finish()
    finally:
        watch.uninstall()
    assert all(torch.equal(a, b) for a, b in zip(watched, plain))
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("diffusion-debug launch:")]
    assert said[0] == (
        "diffusion-debug launch: stopped watching train.py after 2 step(s): the debugger could not watch "
        "Accelerator.prepare (RuntimeError: planted); it runs on unwatched."
    )
    (run_dir,) = (tmp_path / "runs").iterdir()
    run = load_run(run_dir)
    assert [row["step"] for row in run.steps] == [0, 1] and run.summary["end"] == {"status": "finished"}


def test_a_script_that_raises_before_its_first_training_forward_is_said_to_have_raised_there(
    tmp_path, capsys, torch_own
):
    """diffusers' train_dreambooth_lora.py with ``--train_text_encoder``, whose text encoder's
    ``add_adapter`` raises (transformers 5 wants a newer PEFT) once the UNet is prepared with its
    optimizer: nothing was watched, and the line said "it stepped no optimizer of a model it
    trains", as if launch had missed the script's ``prepare``, under the traceback of the error
    that stopped it."""
    import accelerate

    from diffusion_debug.jobs.launch_end import describe_end

    def check_peft_version():
        raise ValueError("The version of PEFT you are using is not compatible, please use a version >= 0.22.0")

    watch = _installed_watch(tmp_path, "train_dreambooth_lora.py")
    try:
        accelerator = accelerate.Accelerator(cpu=True)
        model = _model()
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        with pytest.raises(ValueError) as raised:
            check_peft_version()
        watch.end = describe_end(raised.value, None)
        watch.finish()
    finally:
        watch.uninstall()
    assert (
        watch.end["where"]
        == f"{__file__}, line {check_peft_version.__code__.co_firstlineno + 1}, in check_peft_version"
    )
    assert capsys.readouterr().err == (
        "diffusion-debug launch: nothing was watched in train_dreambooth_lora.py: it raised ValueError before its "
        f"first training step ({watch.end['where']}); the script ran unchanged.\n"
    )
    assert not (tmp_path / "runs").exists()


def test_an_out_of_memory_error_in_the_first_training_forward_is_recorded_at_step_0(tmp_path, capsys, torch_own):
    """diffusers' scripts most often fail in their first step's forward, out of memory (SDXL at 1024
    px). launch made its debugger at the first ``backward``, so that OOM was not recorded and no run
    was saved, while one in step 1's forward was (``out_of_memory`` at step 1). The debugger is now
    made at the prepared model's first forward under grad: the OOM is step 0's, the run saved with
    how the script ended."""
    import accelerate

    from diffusion_debug.jobs.launch_end import describe_end
    from diffusion_debug.testing import plant_oom

    watch = _installed_watch(tmp_path, "train_dreambooth_lora_sdxl.py")
    try:
        accelerator = accelerate.Accelerator(cpu=True)
        model = _model()
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        with torch.no_grad():
            model(X)  # a validation-like call first: no training step, no debugger
        assert watch.debugger is None
        plant_oom(model[2])
        with pytest.raises(torch.OutOfMemoryError) as raised:
            model(X)
        watch.end = describe_end(raised.value, None)
        watch.finish()
    finally:
        watch.uninstall()
    (run_dir,) = (tmp_path / "runs").iterdir()
    run = load_run(run_dir)
    assert [(a.kind, a.component, a.step) for a in run.anomalies] == [("out_of_memory", "model", 0)]
    assert run.summary["end"]["status"] == "raised" and run.summary["end"]["exception"] == "OutOfMemoryError"
    assert run.steps == []
    assert "nothing was watched" not in capsys.readouterr().err


def test_a_plain_scripts_out_of_memory_error_in_its_first_training_forward_is_recorded_at_step_0(
    tmp_path, capsys, torch_own
):
    """With no Accelerator the models were found, and the debugger made, at the first optimizer step:
    an OOM in step 0's forward left only "nothing was watched ... it raised OutOfMemoryError". The
    model holding the optimizer's parameters now gets a pre-hook as the optimizer is made, and its
    first forward under grad makes the debugger (a call under no_grad first does not): the OOM is
    step 0's, at its module, and the script's own error goes up as it was raised."""
    from diffusion_debug.jobs.launch_end import describe_end
    from diffusion_debug.testing import plant_oom

    watch = _installed_watch(tmp_path, "train.py")
    try:
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # noqa: F841 (alive: its model is found)
        with torch.no_grad():
            model(X)  # a validation-like call first: no training step, no debugger
        assert watch.debugger is None and _hooks(model) == 1  # the optimizer's model's pre-hook, waiting
        plant_oom(model[2])
        with pytest.raises(torch.OutOfMemoryError) as raised:
            model(X)
        assert str(raised.value).endswith("(planted by diffusion_debug.testing)")
        assert raised.traceback[-1].name == "hook"  # plant_oom's, where it was raised
        watch.end = describe_end(raised.value, None)
        watch.finish()
    finally:
        watch.uninstall()
    (run_dir,) = (tmp_path / "runs").iterdir()
    run = load_run(run_dir)
    assert [(a.kind, a.component, a.module, a.step, a.rank) for a in run.anomalies] == [
        ("out_of_memory", "model", "2", 0, 0)
    ]
    assert run.summary["end"]["status"] == "raised" and run.summary["end"]["exception"] == "OutOfMemoryError"
    assert "nothing was watched" not in capsys.readouterr().err
    assert _hooks(model) == 1  # plant_oom's own: none of launch's is left


def test_a_plain_scripts_optimizer_made_again_before_its_first_forward_still_makes_the_debugger_there(
    tmp_path, torch_own
):
    """The optimizer is made twice before step 0 (``optimizer = make_optimizer()`` again after a
    checkpoint is loaded: the first one dropped). The model's pre-hook, given with the first, found it
    gone at the first forward and made nothing (an OOM there went unrecorded); it now takes the live
    optimizer of that model: the debugger is made as step 0's forward begins."""
    import gc

    watch = _installed_watch(tmp_path, "train.py")
    try:
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        gc.collect()
        loss = model(X).pow(2).mean()
        assert watch.debugger is not None and watch.optimizers == [optimizer]
        loss.backward()
        optimizer.step()
        watch.finish()
    finally:
        watch.uninstall()
    assert _hooks(model) == 0


def test_a_copy_or_a_save_of_a_plain_scripts_model_made_after_its_optimizer_works_and_carries_no_hook(
    tmp_path, torch_own
):
    """``ema = copy.deepcopy(model)`` and ``torch.save(model)`` once the optimizer is made (an EMA copy,
    a whole-model checkpoint): launch's first-forward pre-hook, on the model then, was copied with it,
    and the watch inside it could not be (``TypeError: cannot pickle 'ThisThread' object``: the script
    broke). The copy and the saved model now hold no hook of launch's; the model's own first forward
    under grad still makes the debugger; the copy is the model, bitwise."""
    import copy
    import io

    watch = _installed_watch(tmp_path, "train.py")
    try:
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ema = copy.deepcopy(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert (_hooks(model), _hooks(ema), _hooks(loaded)) == (1, 0, 0)
        assert all(torch.equal(a, b) for a, b in zip(ema.parameters(), model.parameters()))
        model(X).pow(2).mean().backward()
        assert watch.debugger is not None
        optimizer.step()
        watch.finish()
    finally:
        watch.uninstall()
    assert _hooks(model) == 0


def _scripts_hook(module, args, output):
    """A hook of the script's own (a module-level function: it pickles by name)."""
    return output * 1.0


def test_a_copy_or_a_save_of_a_plain_scripts_model_once_the_debugger_is_made_is_a_plain_model(tmp_path, torch_own):
    """After step 0 made the debugger: ``torch.save(model)`` raised (``Can't pickle local object
    'InputWatch.watch_trained.<locals>.before'``) and ``copy.deepcopy`` carried launch's and the debugger's
    hooks onto the EMA copy (a frozen encoder's watch alike). Now the copy, the saved and the pickled model
    hold only the script's own hook,
    their pickle names nothing of ours (it loads where diffusion-debug is not installed), the copy's output is
    the model's, bitwise; the copy's own training calls are no step of the model's, whose later NaN loss is
    still named at its step."""
    import copy
    import io
    import pickle

    watch = _installed_watch(tmp_path, "train.py")
    try:
        encoder = torch.nn.Sequential(torch.nn.Linear(4, 4)).requires_grad_(False)  # frozen: its calls watched
        model = _model()
        model[0].register_forward_hook(_scripts_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            if step == 2:
                assert watch.debugger is not None and _hooks(model) > 1
                ema = copy.deepcopy(model)
                buffer = io.BytesIO()
                torch.save(model, buffer)
                data = pickle.dumps(model)
                loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
                for twin in (ema, loaded, pickle.loads(data)):
                    assert _hooks(twin) == 1 and list(twin[0]._forward_hooks.values()) == [_scripts_hook]
                    assert torch.equal(twin(X), model(X))
                assert b"diffusion_debug" not in data and b"diffusion_debug" not in buffer.getvalue()
                assert _hooks(encoder) == 3 and _hooks(copy.deepcopy(encoder)) == 0
                assert b"diffusion_debug" not in pickle.dumps(encoder)  # (before: its local hooks did not pickle)
                ema(X).pow(2).mean().backward()  # the EMA's own training call: not the model's
            loss = model(encoder(X)).pow(2).mean() * (float("nan") if step == 3 else 1.0)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        watch.finish()
    finally:
        watch.uninstall()
    assert _hooks(model) == 1 and torch.nn.Module.__getstate__ is torch_own[2]
    (run_dir,) = (tmp_path / "runs").iterdir()
    run = load_run(run_dir)
    assert [row["step"] for row in run.steps] == [0, 1, 2, 3]
    first = by_cause(run.anomalies)[0]
    assert (first.kind, first.step, first.component) == ("nonfinite_loss", 3, "model")


@pytest.mark.parametrize("how", ["in_place", "step_function"])
def test_a_plain_scripts_model_compiled_in_place_makes_the_debugger_at_its_first_forward_with_the_plain_graphs(
    how, tmp_path, torch_own
):
    """``model.compile()`` before its optimizer is made: launch's first-forward pre-hook is called as a
    frame of its own (torch compiles ``_call_impl``, a frame dynamo skips); it runs eagerly there, so the
    debugger is made as step 0's forward begins, with the plain run's graphs and graph breaks, bitwise.
    ``step_function``: the model, its optimizer made, is called inside a compiled function of the script's
    (``@torch.compile def loss_of(x)``); dynamo traces the model's call there, and the pre-hook was traced
    with it, guarded (``len(model._forward_pre_hooks) == 1``): the debugger's hooks added at the first step
    recompiled it (2 graphs). It is lifted while dynamo compiles, so the trace is the plain run's and the
    first step makes the debugger, as before."""
    from torch._dynamo.utils import counters

    from diffusion_debug.probes.tracing import compile_callback

    if compile_callback is None:  # (2.5: a step_function's empty hook dicts are guarded: the debugger recompiles it)
        pytest.skip("no dynamo frame callback to ask on this torch (2.5): the first step makes the debugger")
    made = []

    def loop(watch=None):
        torch._dynamo.reset()
        counters.clear()
        model = _Net()
        if how == "in_place":
            model.compile(backend="aot_eager")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss_of = lambda x: model(x).pow(2).mean()  # noqa: E731
        if how == "step_function":
            loss_of = torch.compile(loss_of, backend="aot_eager")
        losses = []
        for step in range(3):
            x = X.clone()
            if step == 1:
                x[0, 1] = float("nan")
            loss = loss_of(x)
            if watch is not None and step == 0:
                made.append(watch.debugger is not None)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        graphs = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        watched_model[:] = [model]
        return losses, [p.detach().clone() for p in model.parameters()], graphs

    watched_model = []
    plain_losses, plain, plain_graphs = loop()
    watch = _installed_watch(tmp_path, "train.py")
    try:
        losses, watched, graphs = loop(watch)
        watch.finish()
    finally:
        watch.uninstall()
    assert made == [how == "in_place"] and graphs == plain_graphs == (1, 0)
    same = functools.partial(torch.allclose, rtol=0, atol=0, equal_nan=True)
    assert same(torch.tensor(losses), torch.tensor(plain_losses)) and all(map(same, watched, plain))
    (run_dir,) = (tmp_path / "runs").iterdir()
    first = by_cause(load_run(run_dir).anomalies)[0]
    if how == "in_place":
        assert (first.kind, first.component, first.step, first.details["inputs"]) == (
            "nonfinite_input",
            "input",
            1,
            ["model(x)"],
        )
    else:  # the model's call is compiled code: no hook of ours runs there, its input is not counted
        assert (first.kind, first.step) == ("nonfinite_loss", 1)
    assert _hooks(watched_model[0]) == 0


# -- after the end ---------------------------------------------------------------------------------


def test_after_the_end_launchs_wrappers_inside_the_scripts_own_pass_through_and_record_nothing(
    tmp_path, torch_own, capsys
):
    """The script wrapped ``Tensor.backward``, ``accelerator.backward`` and the prepared optimizer's
    ``step`` over launch's: the end cannot put those back, so launch's, inside, must call the
    originals and record nothing. Before, the ``backward`` after the end kept its loss and the step
    made a debugger (a run directory) after the run was saved."""
    import accelerate

    def wrap(function):
        def theirs(*args, **kwargs):
            return function(*args, **kwargs)

        return theirs

    def script(watch=None):
        accelerator = accelerate.Accelerator(cpu=True)
        model = _model()
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        torch.Tensor.backward = wrap(torch.Tensor.backward)
        accelerator.backward = wrap(accelerator.backward)
        optimizer.step = wrap(optimizer.step)
        if watch is not None:
            watch.finish()  # the script's main ended; a thread of it trains on, say
            assert watch.failed == ENDED
        plain_model = _model(3)
        plain_model(X).sum().backward()
        for _ in range(3):
            accelerator.backward(model(X).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().clone() for p in [*model.parameters(), *plain_model.parameters()]]

    own_prepare = accelerate.Accelerator.prepare
    try:
        plain = script()
    finally:
        torch.Tensor.backward = torch_own[0]
    watch = _installed_watch(tmp_path, "train.py")
    try:
        watched = script(watch)
    finally:
        watch.uninstall()
        accelerate.Accelerator.prepare = own_prepare
    assert all(torch.equal(a, b) for a, b in zip(watched, plain))
    assert watch.loss is None and watch.debugger is None and not watch.early.tried and watch.steps == 0
    assert not (tmp_path / "runs").exists()
    assert capsys.readouterr().err == (
        "diffusion-debug launch: nothing was watched in train.py: it stepped no optimizer of a model it trains "
        "(Accelerator.prepare or torch.optim); the script ran unchanged.\n"
    )


# -- the shapes of a training loop -----------------------------------------------------------------


class _ScalesItself(GradScaler):
    """A GradScaler whose ``scale`` is its own, as FSDP1's ``ShardedGradScaler`` has it (the product
    made there, ``GradScaler.scale`` never called; its class made before launch installs)."""

    def scale(self, outputs):
        if not self._enabled:
            return outputs
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(outputs.device)
        return (outputs * self._scale.to(device=outputs.device, non_blocking=True)).type(outputs.dtype)


def _made_while_watched() -> type:
    """The same class, made when the loop runs (under launch: after it installed)."""

    class ScalesItselfLater(GradScaler):
        scale = _ScalesItself.scale

    return ScalesItselfLater


SCALERS = {
    "grad_scaler": lambda: GradScaler,
    "own_scale": lambda: _ScalesItself,
    "own_scale_later": _made_while_watched,
}


def _plain_loop(steps: int = 6, scaler: str = "grad_scaler") -> tuple[list[float], list[torch.Tensor]]:
    """A plain torch loop of the shapes a script may have: step 0 two ``backward`` calls on one
    graph (``retain_graph``), step 1 ``torch.autograd.backward([loss])``, then a GradScaler's (which
    skips step 3: an Inf planted in a gradient; ``scaler``: a key of :data:`SCALERS`; step 4 one
    backward of the two halves' losses, each scaled, step 5 too, torch's GradScaler scaling them as one
    list); its losses and final weights."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = SCALERS[scaler]()("cpu", init_scale=1024.0)
    losses = []
    for step in range(steps):
        loss = model(X).pow(2).mean()
        if step == 0:
            loss.backward(retain_graph=True)
            loss.backward()
            optimizer.step()
        elif step == 1:
            torch.autograd.backward([loss])
            optimizer.step()
        elif step in (4, 5):
            halves = [model(x).pow(2).mean() / 2 for x in X.split(4)]
            as_list = step == 5 and scaler == "grad_scaler"  # torch's scales a list (the stand-ins do not)
            scaled = amp.scale(halves) if as_list else [amp.scale(half) for half in halves]
            torch.autograd.backward(scaled)
            loss = halves[0] + halves[1]
            amp.step(optimizer)
            amp.update()
        else:
            amp.scale(loss).backward()
            if step == 3:
                model[2].weight.grad[0, 0] = float("inf")
            amp.step(optimizer)
            amp.update()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("scaler", SCALERS)
def test_a_plain_loop_with_two_backwards_a_list_backward_and_a_grad_scaler_skip_is_counted_step_by_step(
    tmp_path, torch_own, capsys, scaler
):
    """Every step of the loop is a step of the run, with the script's loss: the GradScaler's skipped
    step (no optimizer step, no step hook) is step 3, judged skipped, and the loss is the one the
    scaler scaled. Before, the skipped step was not monitored (the later steps were numbered one
    short) and each loss was the scaled one (times 1024, then 512: halved at the skip); and it still
    was under a GradScaler subclass with a ``scale`` of its own (FSDP1's ``ShardedGradScaler``),
    whether its class was made before launch installed or after. One backward of two scaled losses
    keeps both as the losses they scaled (before, only the last one scaled was: the first counted
    times the scale), scaled one by one or as one list (before, a list's were not remembered)."""
    own_scaler, own_itself = dict(vars(GradScaler)), dict(vars(_ScalesItself))
    (plain_losses, plain), (losses, watched), run = _plain_then_watched(tmp_path, lambda: _plain_loop(scaler=scaler))
    assert dict(vars(GradScaler)) == own_scaler and dict(vars(_ScalesItself)) == own_itself
    assert losses == plain_losses and all(torch.equal(a, b) for a, b in zip(watched, plain))
    assert [row["step"] for row in run.steps] == list(range(6))
    assert [row["loss"] for row in run.steps] == pytest.approx(plain_losses, rel=1e-6)
    assert [(a.kind, a.step, a.details.get("reason")) for a in run.anomalies if a.kind == "skipped_step"] == [
        ("skipped_step", 3, "grad_scaler")
    ]
    assert "anomalies: 2 (2 info)" in capsys.readouterr().err


def test_a_grad_scaler_skip_at_the_last_step_is_in_the_saved_summary(tmp_path, torch_own):
    """The last step's skip, which no later step shows, is judged before the run is saved: in
    summary.json's anomalies and counts as in its events. Before, the launch saved the run, then
    closed the debugger, which judged it: summary.json counted one skip less than events.jsonl (a
    DeepSpeed fp16 run whose every step overflowed read 11 skips of 12)."""
    _, _, run = _plain_then_watched(tmp_path, lambda: _plain_loop(steps=4))
    found = [(a.kind, a.step, a.details.get("reason")) for a in run.anomalies if a.kind == "skipped_step"]
    assert found == [("skipped_step", 3, "grad_scaler")]
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert (summary["training"]["skipped_steps"], summary["training"]["skipped_by_scaler"]) == (1, 1)
    assert [a["step"] for a in summary["anomalies"] if a["kind"] == "skipped_step"] == [3]


def _compiled_loop(nan_input_at: int | None = None, only: bool = False) -> tuple[list[float], list[torch.Tensor], int]:
    """A plain loop of 3 steps on ``torch.compile(model)`` (aot_eager), its input NaN at ``nan_input_at``
    (``only``: the script holds only what torch.compile returned, around a model of its own class): its
    losses, final weights and dynamo's graph count."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _Net() if only else _model()
    compiled = torch.compile(model, backend="aot_eager")
    if only:
        del model
    optimizer = torch.optim.SGD(compiled.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        x = X.clone()
        if step == nan_input_at:
            x[0, 1] = float("nan")
        loss = compiled(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, [p.detach().clone() for p in compiled.parameters()], counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("only", [False, True])
def test_a_compiled_models_nan_input_is_named_at_the_compiled_call_and_the_run_is_bitwise(tmp_path, torch_own, only):
    """``torch.compile(model)`` in a plain script: its arguments are counted at what torch.compile
    returned, whose hooks run before the compiled code, so a NaN input is the headline as the input
    at its step; the compiled model's own hooks count nothing (no graph of ours), and the run is the
    plain one. Before, dynamo traced launch's hooks inside the compiled code (recompiles; on a DDP UNet,
    graph breaks and weights an ulp off the plain run's); once they counted nothing there, the NaN
    input was only the NaN loss it made. A script that holds ``only`` the compiled model: launch took the
    model's one part that holds every parameter (``layers``, of torch's own class, hooked inside the
    compiled code) for the trained model, so the NaN input was only the NaN loss, its modules named
    ``0``, not ``layers.0``."""
    (plain_losses, plain, plain_graphs), (losses, watched, graphs), run = _plain_then_watched(
        tmp_path, lambda: _compiled_loop(nan_input_at=1, only=only)
    )
    assert graphs == plain_graphs
    same = functools.partial(torch.allclose, rtol=0, atol=0, equal_nan=True)  # bitwise, NaN as NaN
    assert same(torch.tensor(losses), torch.tensor(plain_losses)) and all(map(same, watched, plain))
    first = by_cause(run.anomalies)[0]
    assert (first.kind, first.component, first.step) == ("nonfinite_input", "input", 1)
    assert first.details["inputs"] == ["compiled(x)" if only else "compiled(input)"]
    made = [a.module for a in run.anomalies if a.kind == "nonfinite" and a.step == 1]
    assert made == ["layers.0" if only else "0"]


class _Net(torch.nn.Module):
    """``_model``'s layers in a class of the script's own (DDP around one of torch's is not compiled)."""

    def __init__(self):
        super().__init__()
        self.layers = _model()

    def forward(self, x):
        return self.layers(x)


def _compiled_after_prepare_loop(
    make: Callable[[], torch.nn.Module], how: str = "wrapper"
) -> tuple[list[float], list[torch.Tensor], tuple]:
    """An Accelerate loop that compiles its model after ``prepare`` (``model = accelerator.prepare(model);
    model = torch.compile(model)``; ``model.compile()`` ``in_place``; a ``validation`` copy compiled and
    called under ``no_grad`` before step 0, the model trained uncompiled), 3 steps, its input NaN at step 1:
    its losses, final weights, and dynamo's graph count and graph breaks."""
    import accelerate
    from accelerate.state import AcceleratorState, GradientState
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True)
    model = make()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if how == "in_place":
        model.compile(backend="aot_eager")
    elif how == "validation":
        with torch.no_grad():
            torch.compile(model, backend="aot_eager")(X)
    else:
        model = torch.compile(model, backend="aot_eager")
    losses = []
    for step in range(3):
        x = X.clone()
        if step == 1:
            x[0, 1] = float("nan")
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    counted = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    return losses, [p.detach().clone() for p in model.parameters()], counted


@pytest.mark.parametrize(
    "ddp, how", [(False, "wrapper"), (True, "wrapper"), (False, "in_place"), (False, "validation")]
)
def test_a_model_compiled_after_prepare_gets_no_recompile_or_graph_break_and_its_nan_input_is_named(
    tmp_path, torch_own, monkeypatch, ddp, how, request
):
    """``torch.compile`` after ``accelerator.prepare``: launch is told of the wrapper as torch.compile
    makes it and watches it in place of the prepared model, so the debugger is made at its first call
    (its hooks run before the compiled code) and everything is registered before dynamo traces: the
    plain run's graphs and graph breaks, the run bitwise, the NaN input named at its step. Before, the
    debugger was made at the first ``backward``, after the first compiled call: its hooks failed
    dynamo's guards on an ``nn.Sequential`` (torch's own class: dynamo traces its hooks), 2 graphs for
    1; with DDP (a gloo group of one rank; its hooks traced too) around a model of the script's class,
    the pre-hooks of launch and of its debugger on DDP made dynamo trace DDP's Python: 4 graph breaks
    for the plain run's 3. ``model.compile()`` (``in_place``, no wrapper: torch compiles the model's
    ``_call_impl``, whose hooks dynamo traces as frames of their own) counted nothing: launch's hook was
    traced there, the NaN input was only the NaN loss it made, the debugger made at the ``backward``. A
    ``validation`` copy compiled before step 0 took the trained model's hook, its training calls not
    counted (the NaN input only the NaN loss)."""
    import accelerate

    from diffusion_debug.probes.tracing import compile_callback

    if how == "in_place" and compile_callback is None:
        pytest.skip("no dynamo frame callback to ask on this torch (2.5): model.compile()'s calls count nothing")
    if ddp:
        request.getfixturevalue("one_rank_group")
        for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("MASTER_PORT", "29500")  # the group is made already: accelerate joins none
    own_prepare = accelerate.Accelerator.prepare
    try:
        (plain_losses, plain, plain_graphs), (losses, watched, graphs), run = _plain_then_watched(
            tmp_path, functools.partial(_compiled_after_prepare_loop, _Net if ddp or how != "wrapper" else _model, how)
        )
    finally:
        accelerate.Accelerator.prepare = own_prepare
    assert graphs == plain_graphs == ((1, 3) if ddp else (1, 0))
    same = functools.partial(torch.allclose, rtol=0, atol=0, equal_nan=True)
    assert same(torch.tensor(losses), torch.tensor(plain_losses)) and all(map(same, watched, plain))
    first = by_cause(run.anomalies)[0]
    assert (first.kind, first.component, first.step) == ("nonfinite_input", "input", 1)
    assert first.details["inputs"] == ["model(input)" if how == "wrapper" and not ddp else "model(x)"]
    assert [row["step"] for row in run.steps] == [0, 1, 2]
    # the debugger watches the wrapper: its names are the model's own, as without the compile
    named = {(a.component, a.module, a.parameter) for a in run.anomalies if a.parameter or a.module}
    assert named and not any(w in f"{n}" for n in named for w in ("_orig_mod", "module.", "optimizedmodule"))


def test_fsdps_sharded_grad_scaler_s_own_scale_gives_the_loss_it_scaled(torch_own):
    """FSDP1's ``ShardedGradScaler`` itself (its ``scale`` runs on CPU without a process group): the
    backward of what it scaled keeps the loss, and its class is put back as it was."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    own = dict(vars(ShardedGradScaler))
    watch = LaunchWatch({}, "train.py")
    watch.install()
    try:
        scaler = ShardedGradScaler(device="cpu", init_scale=1024.0)
        loss = _model()(X).pow(2).mean()
        scaled = scaler.scale(loss)
        scaled.backward()
        assert torch.equal(scaled.detach(), loss.detach() * 1024)
        assert torch.equal(watch.loss, loss.detach())
    finally:
        watch.uninstall()
    assert dict(vars(ShardedGradScaler)) == own


def _backward_forms(nan_at: int | None = None, nan_gradient_at: int | None = None) -> tuple[list, list[torch.Tensor]]:
    """A plain loop whose every step backwards in another form, on two losses: several tensors at once
    (step 0: before any optimizer is known), ``loss.backward()``, a pipeline stage's backward (outputs
    given their gradient: no loss) then ``torch.autograd.backward(loss)``, a pipeline stage's alone
    (its given gradient NaN at ``nan_gradient_at``), a loss and a stage's outputs given their
    gradients at once, and several losses again (``nan_at``: that step's second loss NaN); each
    step's loss (the sum, each loss times its gradient; None: no loss) and the final weights."""
    model_a, model_b = _model(0), _model(1)
    optimizer = torch.optim.SGD([*model_a.parameters(), *model_b.parameters()], lr=0.1)
    model = torch.nn.ModuleList([model_a, model_b])
    losses = []
    for step in range(6):
        loss_a, loss_b = model[0](X).pow(2).mean(), model[1](X).pow(2).mean()
        if step == nan_at:
            loss_b = loss_b * float("nan")
        if step in (0, 5):
            torch.autograd.backward([loss_a, loss_b])
            losses.append(float(loss_a.detach()) + float(loss_b.detach()))
        elif step == 1:
            loss_a.backward()
            losses.append(float(loss_a.detach()))
        elif step == 2:
            outputs = model[0](X)
            outputs.backward(gradient=torch.full_like(outputs, 0.125))
            torch.autograd.backward(loss_b)
            losses.append(float(loss_b.detach()))
        elif step == 3:
            outputs = model[0](X)
            given = torch.full_like(outputs, 0.125)
            if step == nan_gradient_at:
                given[3, 0] = float("nan")
            torch.autograd.backward(outputs, given)
            losses.append(None)
        else:
            outputs = model[1](X)
            weights = (torch.tensor(0.25), torch.full_like(outputs, 0.125))
            torch.autograd.backward(tensors=(loss_a, outputs), grad_tensors=weights)
            losses.append(0.25 * float(loss_a.detach()))
        optimizer.step()
        optimizer.zero_grad()
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("nan", ["loss", "given_gradient"])
def test_every_form_of_backward_is_a_step_numbered_with_its_loss_and_a_nan_in_either_of_two_losses_is_named(
    tmp_path, torch_own, nan
):
    """Each step of the loop is monitored, in order, with the loss its backward was of: several
    tensors' sum (each times its gradient); the NaN of the second of two losses at step 5 is that
    step's ``nonfinite_loss``. Before, a backward of several tensors gave no loss: at step 0 launch
    stopped watching (its optimizer stepped before any backward of a scalar loss), later the step
    went unmonitored and the next ones were numbered one short. A pipeline stage's backward (outputs
    given their gradient) is no loss: alone, its step has none (no row loss, none judged), its
    gradients read; beside a loss, in one call or another, the step's loss is the loss's; a NaN in
    the gradient it was given is named where backward made it, the last layer's weight, not as a
    NaN loss (before, its loss was the sum of outputs times gradients: NaN, the headline). The plain
    twin's model and optimizer, let go of but held by their reference cycle (the collector kept
    off), are not found live and watched beside the script's: launch collects garbage before it
    looks (in a full suite run they were, and step 4 read a NaN update)."""
    planted = {"nan_at": 5} if nan == "loss" else {"nan_gradient_at": 3}
    gc.disable()
    try:
        (plain_losses, plain), (losses, watched), run = _plain_then_watched(
            tmp_path, lambda: _backward_forms(**planted)
        )
    finally:
        gc.enable()
    assert [repr(v) for v in losses] == [repr(v) for v in plain_losses]
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(watched, plain))  # NaN too
    assert [row["step"] for row in run.steps] == list(range(6))
    assert [row["micro_steps"] for row in run.steps] == [1, 1, 1, 0, 1, 1]
    assert run.steps[3]["loss"] is None  # the stage's backward alone: no loss
    first = by_cause(run.anomalies)[0]
    if nan == "loss":
        assert [row["loss"] for row in run.steps[:5]] == pytest.approx(plain_losses[:5], rel=1e-6)
        assert run.steps[5]["loss"] == "nan"  # the NaN of the second loss, in the sum
        assert (first.kind, first.step) == ("nonfinite_loss", 5)
    else:
        assert [row["loss"] for row in run.steps[:3]] == pytest.approx(plain_losses[:3], rel=1e-6)
        assert (first.kind, first.step, first.parameter) == ("nonfinite", 3, "0.2.weight")  # the last layer's
        assert not [a for a in run.anomalies if a.kind == "nonfinite_loss" and a.step == 3]


def _accumulating_loop(
    form: str, nan_at: int | None = None, where: str = "loss", steps: int = 6
) -> tuple[list[float], list, list]:
    """A plain loop that backwards several times before each optimizer step: ``accumulate``, four
    micro-batches of ``X`` (``loss = loss / 4; loss.backward()``, NaN in the second at step
    ``nan_at``: in its loss, or ``where="input"`` in its batch); ``terms``, one forward and a backward
    for each of two loss terms (the first NaN at ``nan_at``); ``probe``, a probing backward whose
    gradients the script drops (``optimizer.zero_grad()``; ``probe_model``: ``model.zero_grad
    (set_to_none=False)``; ``probe_none``: ``p.grad = None`` by hand; ``probe_zero``: ``p.grad.zero_()``
    by hand, ``probe_detach``: ``p.grad.detach_(); p.grad.zero_()``; ``probe_part``: only the last
    layer's, ``model[2].zero_grad()``) before the step's own backward (the probe NaN at ``nan_at``,
    in its loss or, ``where="input"``, in its batch). Each
    backwarded loss, each step's mean of those it steps on, and the final weights."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    backwarded, means = [], []
    for step in range(steps):
        kept = []
        if form == "accumulate":
            for i, batch in enumerate(X.split(2)):
                if step == nan_at and i == 1 and where == "input":
                    batch = batch.clone().fill_(float("nan"))
                loss = model(batch).pow(2).mean() / 4
                if step == nan_at and i == 1 and where == "loss":
                    loss = loss * float("nan")
                loss.backward()
                kept.append(float(loss.detach()))
        elif form.startswith("probe"):
            batch = X.clone().fill_(float("nan")) if step == nan_at and where == "input" else X
            probe = model(batch).abs().mean() * (1 if form == "probe_part" else 100)  # stepped on: no lr spike
            if step == nan_at and where == "loss":
                probe = probe * float("nan")
            probe.backward()
            backwarded.append(float(probe.detach()))
            if form == "probe":
                optimizer.zero_grad()
            elif form == "probe_model":
                model.zero_grad(set_to_none=False)
            elif form == "probe_none":
                for p in model.parameters():
                    p.grad = None
            elif form == "probe_zero":
                for p in model.parameters():
                    p.grad.zero_()
            elif form == "probe_detach":  # as zero_grad(set_to_none=False) does it
                for p in model.parameters():
                    p.grad.detach_()
                    p.grad.zero_()
            else:  # the last layer's alone: the probe's other gradients are stepped on
                model[2].zero_grad()
                kept.append(backwarded[-1])
            loss = model(X).pow(2).mean()
            loss.backward()
            kept.append(float(loss.detach()))
        else:
            out = model(X)
            first, second = out.pow(2).mean(), out.abs().mean()
            if step == nan_at:
                first = first * float("nan")
            first.backward(retain_graph=True)
            second.backward()
            kept += [float(first.detach()), float(second.detach())]
        optimizer.step()
        optimizer.zero_grad()
        backwarded += kept
        means.append(sum(kept) / len(kept))
    return backwarded, means, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    ("form", "nan_at", "where"),
    [
        ("accumulate", None, "loss"),
        ("accumulate", 5, "loss"),
        ("accumulate", 0, "loss"),
        ("accumulate", 5, "input"),
        ("terms", None, "loss"),
        ("terms", 5, "loss"),
        ("probe", 5, "loss"),
        ("probe_model", 0, "loss"),
        ("probe_none", 0, "loss"),
        ("probe_none", 5, "loss"),
        ("probe", 5, "input"),
        ("probe_none", 3, "input"),
        ("probe_part", None, "loss"),
        ("probe_zero", 0, "loss"),
        ("probe_zero", 5, "loss"),
        ("probe_detach", 5, "input"),
    ],
    ids=[
        "accumulate",
        "accumulate-nan5",
        "accumulate-nan0",
        "accumulate-nan_input5",
        "terms",
        "terms-nan5",
        "probe-nan5",
        "probe_model-nan0",
        "probe_none-nan0",
        "probe_none-nan5",
        "probe-nan_input5",
        "probe_none-nan_input3",
        "probe_part",
        "probe_zero-nan0",
        "probe_zero-nan5",
        "probe_detach-nan_input5",
    ],
)
def test_several_backwards_before_a_step_are_that_steps_loss_and_a_nan_in_an_earlier_one_is_its_nan_loss(
    tmp_path, torch_own, form, nan_at, where
):
    """Gradient accumulation (four ``backward`` calls a step) and a backward per loss term: the step's
    loss is the mean of every backward it steps on (each earlier one a micro-step of it, as under
    Accelerate's ``accumulate``), the steps are the optimizer steps, a clean run is quiet and the
    run is the plain one, bitwise. A NaN in micro-batch 2 of 4 (or in the first of two terms) is its
    step's ``nonfinite_loss``, at step 5 and at step 0 (before any optimizer is known). Before, the
    step kept only its last backward's loss: the NaN showed only through the gradients, and the
    headline named a gradient (a consequence), not the NaN loss. A NaN batch in micro-batch 2 is the
    step's ``nonfinite_input`` (the trained model's argument), named before the NaN loss it makes:
    before, only a step's first micro-batch's inputs were counted. A probing backward whose
    gradients the script drops (``zero_grad`` of the optimizer, or of the model) before the step's
    own backward is no micro-step: the step's loss is its own backward's, and a NaN in the probe
    (at step 5, and at step 0 before any optimizer is known) leaves the run quiet; before, the probe
    joined the step's mean, and its NaN was that step's ``nonfinite_loss``. So is one whose gradients
    the script sets to None by hand (``p.grad = None`` for every parameter), seen at the next backward
    (before, it was a micro-step, its NaN the step's), or zeroes in place by hand (``p.grad.zero_()``,
    after ``p.grad.detach_()`` or not), at step 5 and at step 0 (before, a micro-step: its NaN loss was
    the step's, and its loss in the step's mean). A NaN batch the dropped probe alone took is no
    input of the step either: it changed no weight, and nothing is said of it (before, its count
    joined the step's and it was the step's ``nonfinite_input``). A probe whose gradients
    are dropped in part (one layer's ``zero_grad``) is still a micro-step of the step that steps on the
    rest."""
    (plain_backwarded, means, plain), (backwarded, _, watched), run = _plain_then_watched(
        tmp_path, lambda: _accumulating_loop(form, nan_at, where)
    )
    assert [repr(v) for v in backwarded] == [repr(v) for v in plain_backwarded]
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(watched, plain))  # NaN too
    micro = {"accumulate": 3, "terms": 1, "probe_part": 1}.get(form, 0)
    counts = run.summary["training"]
    assert (counts["total_steps"], counts["accumulating_micro_steps"]) == (6, 6 * micro)
    assert [row["step"] for row in run.steps] == list(range(6))
    quiet = nan_at is None or form.startswith("probe")
    finite = 6 if quiet else nan_at  # the weights are NaN after the NaN step
    assert [row["loss"] for row in run.steps[:finite]] == pytest.approx(means[:finite], rel=1e-6)
    if quiet:
        assert run.anomalies == []
    else:
        assert run.steps[nan_at]["loss"] == "nan"
        first = by_cause(run.anomalies)[0]
        assert (first.kind, first.step) == ("nonfinite_" + where, nan_at)


def _frozen_branch_loop(order: str, zero: str, nan_at: int, steps: int = 5) -> tuple[list, list]:
    """A plain loop that also backwards the loss of a model it does not train (an EMA copy whose
    parameters still require grad, held by no optimizer), ``order`` ``first`` or ``after`` the
    model's own backward; the step's gradients zeroed to None or to zeros (``zero``); the EMA's loss
    NaN at ``nan_at``. Each step's model loss, and the final weights."""
    import copy

    model = _model()
    ema = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    backward = torch.Tensor.backward
    if order == "accelerator":  # after the model's, through Accelerator.backward
        import accelerate

        accelerator = accelerate.Accelerator(cpu=True)
        model, optimizer = accelerator.prepare(model, optimizer)
        backward = accelerator.backward
    losses = []
    for step in range(steps):
        ema_loss = ema(X).abs().mean() * (float("nan") if step == nan_at else 1.0)
        loss = model(X).pow(2).mean()
        for backwarded in (ema_loss, loss) if order == "first" else (loss, ema_loss):
            backward(backwarded)
        optimizer.step()
        optimizer.zero_grad(set_to_none=zero == "none")
        ema.zero_grad()
        losses.append(float(loss.detach()))
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    ("order", "zero", "nan_at"),
    [
        ("first", "none", 3),
        ("after", "none", 3),
        ("after", "none", 0),
        ("first", "zeros", 3),
        ("accelerator", "none", 0),
    ],
)
def test_a_backward_that_reaches_no_watched_parameter_is_no_loss_of_the_step_in_either_order(
    tmp_path, torch_own, order, zero, nan_at
):
    """The loss of a model the script does not train (an EMA copy's, a frozen branch's), backwarded
    before or after the step's own, is no loss of the step: each step's loss is the model's own, no
    micro-step, and its NaN (at step 3, and at step 0 before any optimizer is known) changed no
    watched weight: the run is quiet. Before, it was the step's loss where it came after the model's
    (a micro-step, their mean the step's, its NaN the step's ``nonfinite_loss``; through
    ``Accelerator.backward`` too), or where the
    gradients were zeroed to zeros rather than None; dropped where it came first after a
    ``zero_grad`` to None: the outcome hung on the order and on ``set_to_none``."""
    (plain_losses, plain), (losses, watched), run = _plain_then_watched(
        tmp_path, lambda: _frozen_branch_loop(order, zero, nan_at)
    )
    assert losses == plain_losses and all(torch.equal(a, b) for a, b in zip(watched, plain))
    counts = run.summary["training"]
    assert (counts["total_steps"], counts["accumulating_micro_steps"]) == (5, 0)
    assert [row["loss"] for row in run.steps] == pytest.approx(plain_losses, rel=1e-6)
    assert run.anomalies == []


def _gan_loop(
    steps: int = 4, nan_at: int | None = None, by_hand: bool = False, nan_g_at: int | None = None, norms=None
) -> tuple[list, list]:
    """A GAN's loop that backwards the generator's loss first, then zeroes the discriminator's
    gradients (its share of ``loss_g``'s) before its own loss: ``loss_g.backward(); opt_d.zero_grad();
    loss_d.backward(); opt_d.step(); opt_g.step()`` (``by_hand``: the discriminator's gradients set to
    None, ``p.grad = None``); ``loss_d`` NaN at iteration ``nan_at``, ``loss_g`` at ``nan_g_at``. Each
    iteration's ``(loss_d, loss_g)``, and the final weights of both models; ``norms`` (a list) gets
    the gradient norm of each optimizer's own parameters before its step, as ``clip_grad_norm_`` gives it."""
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    discriminator = _model(1)
    opt_g = torch.optim.SGD(generator.parameters(), lr=0.05)
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=0.05)
    noise = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    losses = []
    for step in range(steps):
        opt_g.zero_grad()
        fake = generator(noise)
        loss_g = (discriminator(fake) - 1).pow(2).mean()
        if step == nan_g_at:
            loss_g = loss_g * float("nan")
        loss_g.backward()
        if by_hand:
            for p in discriminator.parameters():
                p.grad = None
        else:
            opt_d.zero_grad()
        loss_d = discriminator(X).sub(1).pow(2).mean() + discriminator(fake.detach()).pow(2).mean()
        if step == nan_at:
            loss_d = loss_d * float("nan")
        loss_d.backward()
        for model in (discriminator, generator) if norms is not None else ():
            norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))))
        opt_d.step()
        opt_g.step()
        losses.append((float(loss_d.detach()), float(loss_g.detach())))
    weights = [p.detach().clone() for model in (generator, discriminator) for p in model.parameters()]
    return losses, weights


@pytest.mark.parametrize("by_hand", [False, True], ids=["zero_grad", "grad_none"])
def test_a_gan_step_that_zeroes_the_discriminator_after_the_generators_backward_gives_each_optimizer_its_loss(
    tmp_path, torch_own, by_hand
):
    """``loss_g.backward(); opt_d.zero_grad(); loss_d.backward(); opt_d.step(); opt_g.step()``: the
    discriminator's step steps on ``loss_d``'s gradients alone (its share of ``loss_g``'s was
    dropped) and the generator's on ``loss_g``'s: two training steps an iteration, the first with
    ``loss_d``, the second with ``loss_g``, from step 0 (before any optimizer is known) on, whether
    the script zeroes the discriminator or sets its gradients to None. A NaN ``loss_d`` is the
    discriminator's step's ``nonfinite_loss``. Before, ``loss_g`` was a micro-step of the
    discriminator's step (its loss their mean) and the generator's step none of its own (three
    steps where the run had six)."""
    (plain_losses, plain), (losses, watched), run = _plain_then_watched(
        tmp_path, lambda: _gan_loop(3, nan_at=2, by_hand=by_hand)
    )
    assert [repr(v) for pair in losses for v in pair] == [repr(v) for pair in plain_losses for v in pair]
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(watched, plain))
    counts = run.summary["training"]
    assert (counts["total_steps"], counts["accumulating_micro_steps"]) == (6, 0)
    expected = [loss for pair in losses[:2] for loss in pair]  # d, g, d, g: each optimizer's own
    assert [row["loss"] for row in run.steps[:4]] == pytest.approx(expected, rel=1e-6)
    assert run.steps[4]["loss"] == "nan"
    first = by_cause(run.anomalies)[0]
    assert (first.kind, first.step) == ("nonfinite_loss", 4)
    assert not [a for a in run.anomalies if a.step < 4]


def test_a_gan_steps_gradients_are_its_own_optimizers_and_a_nan_generator_loss_is_the_generators_steps(
    tmp_path, torch_own
):
    """Each optimizer's step of ``loss_g.backward(); opt_d.zero_grad(); loss_d.backward(); opt_d.step();
    opt_g.step()`` judges the gradients its optimizer steps: the discriminator's step those of
    ``loss_d`` in the discriminator, the generator's those of ``loss_g`` in the generator (their norm
    the step's, as ``clip_grad_norm_`` of each model's parameters gives it). A NaN ``loss_g`` at the
    last iteration is one error, the generator's step's ``nonfinite_loss`` (step 5), its NaN
    gradients following it. Before, each step read every watched gradient: the discriminator's step
    (4) was the headline, blamed for the generator's NaN gradients, and both steps had the norm of
    both models' gradients."""

    def loop():
        norms = []
        return (*_gan_loop(3, nan_g_at=2, norms=norms), norms)

    (plain_losses, plain, plain_norms), (losses, watched, _), run = _plain_then_watched(tmp_path, loop)
    assert [repr(v) for pair in losses for v in pair] == [repr(v) for pair in plain_losses for v in pair]
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(watched, plain))
    assert [row["loss"] for row in run.steps[:5]] == pytest.approx([v for pair in losses for v in pair][:5], rel=1e-6)
    assert run.steps[5]["loss"] == "nan"
    assert [row["grad_norm"] for row in run.steps[:5]] == pytest.approx(plain_norms[:5], rel=1e-5)
    errors = [(a.kind, a.step, a.component, a.details.get("follows")) for a in by_cause(run.anomalies)]
    assert errors == [
        ("nonfinite_loss", 5, "model", None),
        # the generator's: named first since its forward came first (before: the discriminator, stepped first)
        ("nonfinite", 5, "sequential", {"kind": "nonfinite_loss", "rank": 0}),
    ]


def _accelerate_accumulating(backward: str) -> list[float]:
    """Six calls of an Accelerate script under ``accumulate`` (two micro-steps a step), each backward
    ``accelerator.backward(loss)`` or the script's own ``(loss / 2).backward()``; each loss backwarded
    (the one Accelerate divides, for its own)."""
    import accelerate

    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    losses = []
    for i in range(6):
        with accelerator.accumulate(model):
            loss = model(X[i % 4 : i % 4 + 4]).pow(2).mean()
            if backward == "accelerator":
                accelerator.backward(loss)
            else:
                loss = loss / 2
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("backward", ["accelerator", "own"])
def test_a_prepared_script_accumulating_through_its_own_backward_has_the_mean_of_its_micro_steps(tmp_path, backward):
    """Under ``accelerator.accumulate``, a prepared script that backwards its loss itself (not through
    ``Accelerator.backward``) has each step's loss the mean of its two micro-steps', as through
    ``Accelerator.backward``; before, the step kept only its last backward's."""
    import accelerate

    own_prepare = accelerate.Accelerator.prepare
    watch = _installed_watch(tmp_path, "train.py")
    try:
        losses = _accelerate_accumulating(backward)
        watch.finish()
    finally:
        watch.uninstall()
        accelerate.Accelerator.prepare = own_prepare
    (run_dir,) = (tmp_path / "runs").iterdir()
    run = load_run(run_dir)
    counts = run.summary["training"]
    assert (counts["total_steps"], counts["accumulating_micro_steps"]) == (3, 3) and run.anomalies == []
    means = [(losses[i] + losses[i + 1]) / 2 for i in (0, 2, 4)]
    assert [row["loss"] for row in run.steps] == pytest.approx(means, rel=1e-6)


# -- DeepSpeed's engine class ----------------------------------------------------------------------


class _Base:
    """A stand-in of DeepSpeed's engine, its methods defined on a base class."""

    optimizer = None  # no ZeRO optimizer: launch's seams pass through

    def backward(self, loss):
        return ("backward", loss)

    def step(self):
        return "step"


class _Inherits(_Base):
    pass


class _Defines(_Base):
    def backward(self, loss):
        return ("own backward", loss)


class _UsersEngine(_Inherits):
    def backward(self, loss):
        return ("user's", super().backward(loss))


@pytest.mark.parametrize("engine_class", [_Inherits, _Defines], ids=["inherits", "defines"])
def test_the_engine_class_is_put_back_as_it_was_whether_it_defines_its_methods_or_inherits_them(engine_class):
    """``_patch_engine_class`` then its undo: the class's own methods back where it had them, and
    nothing in its dict where it inherited them (a copy of the base's left there hid the base's later
    changes); the script's subclass of it is untouched and runs through launch's while patched."""
    before = dict(vars(engine_class))
    users = dict(vars(_UsersEngine))
    undo = _patch_engine_class(LaunchWatch({}, "train.py"), engine_class)
    assert vars(engine_class)["backward"] is not before.get("backward")
    assert engine_class().step() == "step"
    if engine_class is _Inherits:
        assert engine_class().backward(1) == ("backward", 1)
        assert _UsersEngine().backward(2) == ("user's", ("backward", 2))
    else:
        assert engine_class().backward(1) == ("own backward", 1)
    undo()
    assert dict(vars(engine_class)) == before and dict(vars(_UsersEngine)) == users
    assert engine_class.backward is before.get("backward", _Base.backward)
    assert engine_class.step is _Base.step


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_a_users_subclass_of_deepspeeds_engine_is_put_back_with_nothing_of_ours_in_its_dict(tmp_path):
    """The same on DeepSpeed's own ``DeepSpeedEngine`` and a subclass of it (a process of its own:
    DeepSpeed's import sets process-wide state)."""
    code = """if True:
        import json
        from deepspeed.runtime.engine import DeepSpeedEngine
        from diffusion_debug.jobs.launch_deepspeed import _patch_engine_class
        from diffusion_debug.jobs.launched import LaunchWatch

        class UsersEngine(DeepSpeedEngine):
            pass

        own = dict(vars(DeepSpeedEngine))
        found = []
        for engine_class in (UsersEngine, DeepSpeedEngine):
            before = dict(vars(engine_class))
            undo = _patch_engine_class(LaunchWatch({}, "train.py"), engine_class)
            patched = vars(engine_class).get("backward") is not before.get("backward")
            undo()
            found.append([patched, dict(vars(engine_class)) == before])
        found.append(UsersEngine.backward is own["backward"] and dict(vars(DeepSpeedEngine)) == own)
        print(json.dumps(found))
    """
    done = subprocess.run(
        [sys.executable, "-c", code], env=cpu_launch_env(ROOT), cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [[True, True], [True, True], True]


# -- where a NaN made in backward is named ----------------------------------------------------------


def _unet_clipped_loop(steps: int, middle: str, mode: str, nan_at: int = 2, clip=None) -> list[float]:
    """A loop on the tiny SD UNet that clips its gradients with ``clip`` (None:
    ``torch.nn.utils.clip_grad_norm_`` as the loop finds it) before the optimizer steps (``mode``:
    plain, after ``scaler.unscale_`` under a GradScaler, or prepared by Accelerate); a NaN made in
    ``middle``'s backward at step ``nan_at``."""
    from diffusion_debug.testing import tiny_pipeline

    clip = clip or torch.nn.utils.clip_grad_norm_

    unet = tiny_pipeline("sd").unet.train()
    planted = [False]
    unet.get_submodule(middle).register_full_backward_pre_hook(
        lambda module, grad_output: (grad_output[0] * float("nan"),) if planted[0] else None
    )
    optimizer = torch.optim.SGD(unet.parameters(), lr=1e-3)
    amp = GradScaler("cpu", init_scale=4.0) if mode == "grad_scaler" else None
    accelerator = None
    if mode == "accelerate":
        import accelerate

        accelerator = accelerate.Accelerator(cpu=True)
        unet, optimizer = accelerator.prepare(unet, optimizer)
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(1, unet.config.in_channels, 8, 8, generator=generator)
    context = torch.randn(1, 4, unet.config.cross_attention_dim, generator=generator)
    losses = []
    for step in range(steps):
        planted[0] = step == nan_at
        loss = unet(sample, torch.tensor([500]), context).sample.pow(2).mean()
        if accelerator is not None:
            accelerator.backward(loss)
            clip(unet.parameters(), 1.0)
            optimizer.step()
        elif amp is None:
            loss.backward()
            clip(unet.parameters(), 1.0)
            optimizer.step()
        else:
            amp.scale(loss).backward()
            amp.unscale_(optimizer)
            clip(unet.parameters(), 1.0)
            amp.step(optimizer)
            amp.update()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _two_part_clip(parameters, max_norm) -> None:
    """torch's two-part clip (2.6 on), as FSDP2 scripts clip: the norm, then the clip by it."""
    parameters = list(parameters)
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)


TWO_PART = pytest.mark.skipif(
    not hasattr(torch.nn.utils, "clip_grads_with_norm_"), reason="torch before 2.6 has no two-part clip"
)

ALIASED = """from torch.nn.utils import clip_grad_norm_ as clip  # bound as the script starts

LOSSES = train(clip)
"""
"""A script that binds ``clip_grad_norm_`` under a name of its own at its top (``train``: the loop)."""


@pytest.mark.parametrize(
    ("mode", "nan_at", "clip"),
    [
        ("plain", 2, "torch"),
        ("grad_scaler", 2, "torch"),
        ("accelerate", 2, "torch"),
        ("plain", 0, "torch"),
        ("grad_scaler", 0, "torch"),
        ("plain", 0, "aliased"),
        pytest.param("plain", 2, "two_part", marks=TWO_PART),
        pytest.param("grad_scaler", 0, "two_part", marks=TWO_PART),
    ],
    ids=[
        "plain",
        "grad_scaler",
        "accelerate",
        "plain-step0",
        "grad_scaler-step0",
        "aliased-step0",
        "two_part",
        "two_part-grad_scaler-step0",
    ],
)
def test_a_nan_made_in_backward_is_named_where_it_was_made_though_the_script_clips_before_stepping(
    tmp_path, torch_own, mode, nan_at, clip
):
    """clip_grad_norm_ by a NaN norm makes every gradient NaN: read at the optimizer step (after the
    clip), the gradients named conv_out, the first backward reached, not the convolution whose
    backward made the NaN. Launch reads the gradients at torch's clip, as at Accelerate's (which a
    prepared script may skip for torch's); the run is the plain one, loss for loss. At step 0 too,
    before any optimizer stepped (a plain script's is found at its model's first forward, else at the
    clip; before, step 0 was read at the step, after the clip), and through a script's own name for
    the clip, bound at its top (as ``launched`` runs a script: after launch installed). And through
    torch's two-part clip, ``get_total_norm`` then ``clip_grads_with_norm_``: before, read after it (no
    seam), the NaN norm had made every gradient NaN and conv_out was named."""
    import runpy

    middle = "down_blocks.1.resnets.0.conv2"
    own_clip = torch.nn.utils.clip_grad_norm_
    own_two_part = [getattr(torch.nn.utils, name, None) for name in ("get_total_norm", "clip_grads_with_norm_")]
    script = tmp_path / "train.py"
    script.write_text(ALIASED)

    def run() -> list[float]:
        if clip != "aliased":
            return _unet_clipped_loop(nan_at + 2, middle, mode, nan_at, _two_part_clip if clip == "two_part" else None)
        train = lambda clip: _unet_clipped_loop(nan_at + 2, middle, mode, nan_at, clip)  # noqa: E731
        return runpy.run_path(str(script), init_globals={"train": train}, run_name="__main__")["LOSSES"]

    plain, losses, saved = _plain_then_watched(tmp_path, run, str(script))
    assert torch.nn.utils.clip_grad_norm_ is torch.nn.utils.clip_grad.clip_grad_norm_ is own_clip
    assert [
        getattr(torch.nn.utils, name, None) for name in ("get_total_norm", "clip_grads_with_norm_")
    ] == own_two_part
    assert [repr(v) for v in losses] == [repr(v) for v in plain]  # bitwise the plain run's, NaN after the step
    assert all(v == v for v in losses[: nan_at + 1])  # the planted step's loss is finite
    (made,) = [a for a in saved.anomalies if a.kind == "nonfinite" and a.step == nan_at]
    # step 0 too: the debugger is made as its forward begins (before, after it: the last registered was named)
    assert (made.module, made.parameter, made.details["order"]) == (middle, f"{middle}.weight", "last_in_forward")
    assert made.severity == ("info" if mode == "grad_scaler" else "error")


def test_a_failure_finding_the_optimizer_at_step_0s_clip_gives_up_and_the_clip_runs_as_torchs(
    torch_own, monkeypatch, capsys
):
    """The search for the optimizer of step 0's clipped parameters fails (planted): launch gives up
    with one line, and the script's clip returns torch's norm and clips as torch's does. (The
    optimizer is made after the forward: one made before it is found at the model's first forward.)"""
    from diffusion_debug.jobs import launched

    def fail(optimizer):
        raise RuntimeError("planted")

    def step0(model):
        loss = model(X).pow(2).mean()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        optimizer.step()
        return norm, [p.detach().clone() for p in model.parameters()]

    plain_norm, plain = step0(_model())
    monkeypatch.setattr(launched, "plain_models", fail)
    watch = LaunchWatch({}, "train.py")
    watch.install()
    try:
        norm, watched = step0(_model())
    finally:
        watch.uninstall()
    assert torch.equal(norm, plain_norm) and all(torch.equal(a, b) for a, b in zip(watched, plain))
    assert (
        watch.failed == "the debugger could not find the optimizer of the clipped parameters (RuntimeError: planted)"
    )
    assert capsys.readouterr().err == (
        "diffusion-debug launch: not watching train.py: the debugger could not find the optimizer of the clipped "
        "parameters (RuntimeError: planted); it runs unwatched, as under accelerate launch.\n"
    )


def test_a_script_that_clips_with_no_torch_optimizer_looks_for_one_once(torch_own, monkeypatch):
    """A script whose update is its own (no torch optimizer steps) clips three times: the clip looks
    for the optimizer of its parameters once (a walk of the garbage collector's list), not at every
    clip, and so does its ``model.zero_grad()`` (whether it dropped every gradient a step would step
    on: the live optimizers' parameters), not at every one; the script's gradients and weights are its
    own."""
    from diffusion_debug.training.judges import optimizer_coverage

    walks = []
    live_objects = optimizer_coverage.live_objects
    monkeypatch.setattr(optimizer_coverage, "live_objects", lambda kind: walks.append(kind) or live_objects(kind))

    def train(model):
        for _ in range(3):
            model(X).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
            model.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    plain = train(_model())
    watch = LaunchWatch({}, "train.py")
    watch.install()
    try:
        watched = train(_model())
    finally:
        watch.uninstall()
    assert all(torch.equal(a, b) for a, b in zip(watched, plain))
    assert walks == [torch.optim.Optimizer] * 2 and watch.debugger is None  # the clip's, the zero_grad's


def test_a_half_built_optimizer_kept_alive_does_not_stop_step_0s_clip_finding_the_script_s(tmp_path, torch_own):
    """The script's first optimizer raised in its ``__init__`` (AdamW's lr check, before it has
    ``param_groups``) and the script kept that error (its traceback holds the half-built AdamW);
    its SGD steps. Step 0's clip looks through the live optimizers for the one holding the clipped
    parameters: the half-built one is passed by, and every step is watched, the run the plain
    one's. Its missing ``param_groups`` made launch give up on the whole run."""

    def train() -> list[torch.Tensor]:
        model = _model()
        try:
            torch.optim.AdamW(model.parameters(), lr=-1.0)
        except ValueError as error:
            first_try = error  # noqa: F841 - kept, as a script that reports it later does
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(X).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    plain, watched, run = _plain_then_watched(tmp_path, train)
    assert all(torch.equal(a, b) for a, b in zip(watched, plain))
    assert [row["step"] for row in run.steps] == [0, 1, 2]


def test_launch_names_only_the_pipeline_runs_the_script_made_not_those_its_process_made_before(tmp_path):
    """launch run inside a process that had made pipeline runs already (a test worker, a notebook):
    its last line names the script's pipeline runs only. Before, it listed every run the process's
    debuggers had ever opened (408 of them in a test worker)."""
    from diffusion_debug import DebugConfig, DiffusionModelDebugger
    from diffusion_debug.jobs.launched import pipeline_runs
    from diffusion_debug.testing import tiny_pipeline

    pipe = tiny_pipeline("sd")
    DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path / "before"), log_level="error")).close()
    watch = LaunchWatch({"output_dir": str(tmp_path / "runs")}, "train.py")
    assert pipeline_runs(watch.runs_before) is None
    for _ in range(2):
        DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path / "val"), log_level="error")).close()
    said = pipeline_runs(watch.runs_before)
    opening = "the script's own DiffusionModelDebugger wrote its pipeline calls to 2 runs apart from this one"
    assert said.startswith(f"{opening}: 2 in {tmp_path / 'val'} (the last ")
    assert "before" not in said


def test_a_trained_text_encoders_nan_update_is_the_cause_of_the_nan_it_feeds_the_unet_not_the_batch(
    tmp_path, torch_own
):
    """diffusers' train_dreambooth_lora.py with ``--train_text_encoder`` (rank 1 of two there): a NaN
    gradient in the text encoder's LoRA at step 1 makes its weights NaN in that step's update, and
    at step 2 the UNet's ``encoder_hidden_states`` hold NaN. That was a second root, "The training
    batch holds 8 NaN/Inf value(s) ... check the data pipeline", with the step's NaN loss and
    gradients following it: the weights were not checked on a step with a NaN input. A NaN seen
    first at a trained model's argument (not the batch, not a frozen model's output) now follows
    the non-finite weights' update."""
    import accelerate

    from diffusion_debug.jobs.launch_end import describe_end

    watch = _installed_watch(tmp_path, "train_dreambooth_lora.py")
    try:
        accelerator = accelerate.Accelerator(cpu=True)
        text_encoder, unet = torch.nn.Sequential(torch.nn.Linear(4, 8)), _model()
        unet[0] = torch.nn.Linear(8, 8)
        params = [*unet.parameters(), *text_encoder.parameters()]
        unet, text_encoder, optimizer = accelerator.prepare(unet, text_encoder, torch.optim.AdamW(params, lr=1e-2))
        for step in range(4):
            if step == 1:
                hook = []

                def nan_once(grad):
                    hook[0].remove()
                    grad = grad.clone()
                    grad[0, 0] = float("nan")
                    return grad

                hook.append(text_encoder[0].weight.register_hook(nan_once))
            encoder_hidden_states = text_encoder(X)
            accelerator.backward(unet(encoder_hidden_states).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
        watch.end = describe_end(None, None)
        watch.finish()
    finally:
        watch.uninstall()
    (run_dir,) = (tmp_path / "runs").iterdir()
    first, *rest = by_cause(load_run(run_dir).anomalies)
    assert (first.kind, first.component, first.parameter, first.step) == ("nonfinite", "sequential_2", "0.weight", 1)
    assert [(a.kind, a.step, a.details["cause"]["kind"], a.details["cause"]["step"]) for a in rest] == [
        ("nonfinite_input", 2, "nonfinite", 1),
        ("nonfinite_loss", 2, "nonfinite", 1),
        ("nonfinite", 2, "nonfinite", 1),
    ]
    assert rest[0].message == (
        "The input unet(input) of the trained model holds 8 NaN/Inf value(s) at step 2 on rank 0, and the loss and "
        "the gradients of this step follow from it: the weights went non-finite in the optimizer step of step 1 (1 "
        "parameter(s) hold NaN/Inf, first sequential_2.0.weight); it follows the nonfinite at sequential_2 0.weight, "
        "step 1: fix that first."
    )
