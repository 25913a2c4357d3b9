"""`launch`'s seams never break the job they watch (in-process, each seam as a launched process
installs it): DeepSpeed's engine class is put back as it was, whether it defines the methods or
inherits them."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffusion_debug.jobs.launch_deepspeed import _patch_engine_class
from diffusion_debug.jobs.launched import LaunchWatch
from diffusion_debug.testing.launch import cpu_launch_env

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 60  # a thread waiting on the other one: ends at once but on a stuck test


@pytest.fixture
def torch_own():
    """torch's own ``backward`` functions, put back after the test whatever it left."""
    own = torch.Tensor.backward, torch.autograd.backward
    yield own
    torch.Tensor.backward, torch.autograd.backward = own


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
