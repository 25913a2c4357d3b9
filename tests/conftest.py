"""Settings for the whole suite: torch runs one intra-op thread, here and in the processes the tests
start, unless whoever runs the suite set ``OMP_NUM_THREADS`` themselves.

The tiny pipelines' kernels are too small to gain from a second thread, and on a small shared CPU
torch's worker threads spin against other processes: a step of a tiny pipeline then takes seconds
instead of milliseconds (a fine-tuning job test: 14 s with two threads, 6 s with one, under load).
Results do not depend on it: every test compares runs made in one process, or with a tolerance.
"""

import gc
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch


def pytest_configure(config):
    # Bytecode written in the suite's processes whatever PYTHONDONTWRITEBYTECODE says (this machine sets
    # it): pytest reads its assertion-rewritten test modules back from __pycache__ only where it wrote
    # them, so each xdist worker rewrote all ~180 test modules at every run (collection 14.5 -> 8.0 CPU-s
    # a worker), and the helper modules and benchmarks/ were compiled anew in each worker. The processes
    # the tests start keep the environment they were given.
    sys.dont_write_bytecode = False
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by subprocesses (accelerate launch, the CLI)
        torch.set_num_threads(1)
    if pytest.version_tuple[:2] == (9, 1) and not config.option.pyargs:
        config.args[:] = sorted(config.args, key=lambda arg: _path_parts(config, arg))


def pytest_sessionstart(session):
    """Temporary files of this run (``tempfile``'s, in this process and in those it starts) go under the
    run's pytest base folder, which pytest prunes to the last three runs: tests, the benchmarks they call and
    the jobs they launch make folders with ``tempfile.mkdtemp`` (output folders, some at import) and nothing
    removed them, ~1,000 folders left in /tmp by each run of the suite. Inductor's cache keeps its usual place
    (its default is read from the temporary folder), so compiled tests stay warm from run to run."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # torch before 2.6 (the floor's 2.5.1)
        from torch._inductor.runtime.runtime_utils import default_cache_dir

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    scratch = session.config._tmp_path_factory.getbasetemp() / "tempfiles"
    scratch.mkdir(exist_ok=True)
    os.environ["TMPDIR"] = tempfile.tempdir = str(scratch)


def _path_parts(config, arg: str) -> tuple[str, ...]:
    """The folders and file of a command-line test argument, to sort them so that the arguments of
    one folder come one after the other. pytest 9.1 loses a folder's conftest fixtures for the
    files named after a file of the folder above it, when files of that folder came before
    (pytest#14964: ``pytest tests/diffusion/a.py tests/b.py tests/diffusion/c.py`` gave c.py's tests
    "fixture 'pipes' not found"). A sorted list runs the same tests, in path order; ``make test``
    names one folder, which is left as it is."""
    path = arg.split("::", 1)[0]
    return Path(os.path.abspath(os.path.join(config.invocation_params.dir, path))).parts


GROUPS_SPLIT = "_xdist_groups_split"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n 2 --dist loadgroup`` (the README's command) the tests of one
    ``xdist_group`` run on one worker, one after the other: the multi-process launches must not run
    two at a time on two shared cores, and a module's launch fixture must run once. xdist marks a
    grouped test by writing a suffixed id into ``item._nodeid``, which pytest 9.2 no longer reads
    (pytest-xdist#1386): the groups would split silently and the suite take minutes longer. A test
    whose written id did not take fails at once instead, saying why (before its module's launch).
    An xdist that passes groups another way writes no ``_nodeid``, and nothing fires."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        written = getattr(item, "_nodeid", None)
        if written is not None and written != item.nodeid:
            # a new list: the cases of a parametrized test share one
            item.fixturenames = [GROUPS_SPLIT, *item.fixturenames]


@pytest.fixture(scope="session", name=GROUPS_SPLIT)
def _groups_split():
    pytest.fail(
        f"--dist loadgroup does not group the tests under pytest {pytest.__version__} (pytest-xdist#1386): "
        "install the test extra's pytest (pip install -e '.[test]').",
        pytrace=False,
    )


@pytest.fixture(scope="module")
def one_rank_group():
    """A gloo process group of world size 1 in this process (made unless one is), for the checks
    that run on DDP's or FSDP2's hooks without launching processes."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hook = sys.excepthook  # init_process_group sets its own (torch 2.13), which destroy_process_group leaves:
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    sys.excepthook = hook  # put back at once, or the test asking first for the group is told it left it
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", autouse=True)
def _earlier_modules_objects_frozen():
    """The objects alive as a test module starts (torch's, diffusers', every collected module's, the
    session fixtures', the earlier modules' leftovers) frozen (``gc.collect()``, then ``gc.freeze()``):
    out of the garbage collector's later collections. In a suite worker they are a million objects or
    more, and each automatic full collection walked them all again: a tenth of a pipeline test's CPU
    (tests/diffusion's test_pipeline_patches, test_user_stacks_more and test_why: 5.0 s of 40.9 CPU-s in
    the collector, 3.7 with the collected modules frozen). What a test makes is collected as before;
    what is frozen stays alive or is freed by its reference count (only a cycle among frozen objects
    that dies later is kept). ``gc.get_objects()`` lists the module's own objects, as
    :func:`only_the_tests_objects` makes it list the test's."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture
def only_the_tests_objects():
    """The objects alive before the test frozen (``gc.freeze``) while it runs: out of the garbage
    collector's collections and its list of objects. A test's own ``gc.collect()`` (a check that
    something was freed) and the optimizer-coverage judge of a debugger made without launch (one walk
    of ``gc.get_objects()``, :mod:`~diffusion_debug.training.judges.live_objects`) then see the
    test's own objects only, as a script's process does; in a worker of the whole suite that is also
    every earlier test's leftovers, hundreds of thousands of objects, and an earlier test's optimizer
    not yet collected would be found too. Launch walks nothing (it notes what the script makes)."""
    gc.freeze()
    yield
    gc.unfreeze()


ROOT = Path(__file__).resolve().parents[1]

PIPELINE_IMPORTS = (
    "torch",
    "diffusers:StableDiffusionPipeline",
    "transformers:CLIPTextModel",
    "diffusion_debug.testing",
)
"""What the forked pipeline processes of test_op_count.py (its fresh-process counts) and
record/test_run_dir.py (its killed jobs) import first, imported once by :func:`pipeline_forks`: the
tiny pipelines' module, not the debugger (it loads in each child)."""


@pytest.fixture(scope="session")
def pipeline_forks(tmp_path_factory):
    """tests/fork_server.py's process for the session, which imported :data:`PIPELINE_IMPORTS` once: one
    server for test_op_count.py and record/test_run_dir.py, not one each (~5 CPU-s a server). The tests
    that use it are in the xdist group "pipeline_forks" (one worker under ``pytest -n 2 --dist
    loadgroup``: the server starts once). Started with this environment and the repository on
    ``PYTHONPATH``; each job's own environment is its child's from its first line."""
    from fork_server import Forks

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    server = Forks(tmp_path_factory.mktemp("pipeline-forks"), env, PIPELINE_IMPORTS)
    yield server
    server.close()


DEEPSPEED_JOB = Path(__file__).parent / "training" / "deepspeed_job.py"
DEEPSPEED_JOB_TIMEOUT = 780  # seconds: two processes importing DeepSpeed on two shared cores, 16 scenarios
MULTIPROCESS_JOB = Path(__file__).parent / "training" / "multiprocess_job.py"


def _scenarios_named(session: pytest.Session, attribute: str, ends_job: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The scenarios of a shared launch that the modules of the selected tests name in their
    ``attribute``, in that order, but the plain runs of a script (``plain_*``: no debugger) after the
    others and ``ends_job`` (a stall that ends the job) last."""
    modules = dict.fromkeys(getattr(item, "module", None) for item in session.items)
    named = dict.fromkeys(s for module in modules for s in getattr(module, attribute, ()))
    return tuple(sorted(named, key=lambda s: (s in ends_job, s.startswith("plain_"))))


@pytest.fixture(scope="session")
def deepspeed_job(request, tmp_path_factory) -> tuple[Path, dict[str, str], str]:
    """deepspeed_job.py's one ``torchrun`` launch (2 CPU processes, DS_ACCELERATOR=cpu) for the session:
    its output directory, each scenario's stdout lines (prefix removed) and the launch's stderr. It
    runs the scenarios the selected tests' modules name in ``DEEPSPEED_JOB_SCENARIOS`` (test_deepspeed.py's,
    test_deepspeed_stage0_launch.py's), the ZeRO-2 stall, which ends the job, last."""
    import importlib.util
    import shutil

    from diffusion_debug.testing.launch import by_scenario, cpu_launch_env, free_port, run_launch

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install 'diffusion-debug[deepspeed]'; make test tries it)")
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    scenarios = _scenarios_named(request.session, "DEEPSPEED_JOB_SCENARIOS", ends_job=("stall_rank1",))
    output_dir = tmp_path_factory.mktemp("deepspeed")
    env = {**cpu_launch_env(ROOT), "DS_ACCELERATOR": "cpu"}
    cmd = [torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()), str(DEEPSPEED_JOB), str(output_dir)]
    done = run_launch([*cmd, *scenarios], env, output_dir, DEEPSPEED_JOB_TIMEOUT)
    if done.returncode is None:
        pytest.fail(f"the DeepSpeed job {scenarios!r} hung:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    if done.stdout.startswith("NO_DEEPSPEED"):
        pytest.skip(f"deepspeed does not import: {done.stdout.splitlines()[0][len('NO_DEEPSPEED ') :]}")
    return output_dir, by_scenario(done.stdout, scenarios), done.stderr


@pytest.fixture(scope="session")
def multiprocess_job(request, tmp_path_factory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """multiprocess_job.py's one 2-process ``accelerate launch --multi_gpu`` (gloo) for the session: its
    output directory and, per scenario, the launch with only that scenario's stdout lines. It runs the
    scenarios the selected tests' modules name in ``MULTIPROCESS_JOB_SCENARIOS`` (test_multiprocess.py's;
    test_launch.py's plain run of launch_script.py; test_launch_engines.py's four launched scripts, DDP,
    FSDP2, ZeRO-2 and ZeRO-3, and the plain ZeRO-3 run; test_launch_deepspeed.py's script under Accelerate's
    DeepSpeed plugin, out of memory at step 0): one launch for the four modules (all in the xdist
    group "launches": one worker), not one each (~12 CPU-s; ~18 CPU-s a launched script)."""
    from diffusion_debug.testing.launch import accelerate_launcher, by_scenario, cpu_launch_env, free_port, run_launch

    accelerate = accelerate_launcher()
    if accelerate is None:
        pytest.skip("the accelerate launcher is not installed")
    scenarios = _scenarios_named(request.session, "MULTIPROCESS_JOB_SCENARIOS")
    timeout = 120 + 30 * (len(scenarios) - 1)  # seconds: two processes starting, then each scenario
    timeout += 60 * any("zero" in scenario for scenario in scenarios)  # and importing DeepSpeed
    output_dir = tmp_path_factory.mktemp("multiprocess")
    cmd = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    cmd += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]
    done = run_launch(
        [*cmd, str(MULTIPROCESS_JOB), str(output_dir), *scenarios], cpu_launch_env(ROOT), output_dir, timeout
    )
    if done.returncode is None:
        pytest.fail(
            f"the 2-process job {scenarios!r} hung (stopped after {timeout} s):\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )
    return output_dir, {
        scenario: subprocess.CompletedProcess(done.args, done.returncode, out, done.stderr)
        for scenario, out in by_scenario(done.stdout, scenarios).items()
    }


def _global_state() -> dict[str, object]:
    """What a test could leave behind for every later test of its worker: torch's global module and
    optimizer hooks (a leaked LaunchWatch's module-registration hook fired in every later test and
    raised test_op_count's hook counts by one), the functions the debugger's watches wrap, the
    torch-function and dispatch modes pushed, the process-wide autograd modes, the profiler and
    tracer, the cyclic collector's switch, diffusers' attention backend, the signal handlers, and
    ``nn.Module.__getstate__`` with ``probes.copies``' count of holders (every holder balanced: a
    debugger kept alive past its test keeps our patch in for every later test's copies)."""
    import signal

    import accelerate
    import torch.nn.modules.module as modules
    import torch.optim.optimizer as optimizers

    from diffusion_debug.probes import copies

    hooks = {
        name: getattr(modules, name) for name in dir(modules) if name.startswith("_global_") and name.endswith("hooks")
    }
    hooks |= {
        name: getattr(optimizers, name) for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
    }
    state: dict[str, object] = {name: tuple(hooks_dict) for name, hooks_dict in hooks.items()}
    state |= {
        "torch.Tensor.backward": torch.Tensor.backward,
        "torch.autograd.backward": torch.autograd.backward,
        "accelerate.Accelerator.prepare": accelerate.Accelerator.prepare,
        "torch-function modes": torch._C._len_torch_function_stack(),
        "grad mode": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "anomaly mode": torch.is_anomaly_enabled(),
        "default dtype": torch.get_default_dtype(),
        "sys.excepthook": sys.excepthook,
        "sys.setprofile": sys.getprofile(),
        "sys.settrace": sys.gettrace(),
        "gc enabled": gc.isenabled(),
        "torch-dispatch modes": torch._C._len_torch_dispatch_stack(),
        "nn.Module.__getstate__": torch.nn.Module.__getstate__,
        "probes.copies holders": copies.HELD[0],
    }
    state |= {f"signal {s.name}": signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:  # diffusers >= 0.35: the process-wide attention backend
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    except ImportError:
        return state
    state["diffusers attention backend"] = _AttentionBackendRegistry._active_backend
    return state


_HELD_BY_DEBUGGERS = ("nn.Module.__getstate__", "probes.copies holders")
"""What a debugger holds until it is closed or collected: one the cyclic collector has not reached yet is
no leak, one still referenced (a traceback kept past the test) is."""


@pytest.fixture(autouse=True)
def _nothing_global_leaked():
    """Fails the test that leaves global state changed (see :func:`_global_state`), naming what it
    left, so that the failure is its own and not a later test's on the same worker."""
    before = _global_state()
    yield
    after = _global_state()
    if any(after[name] != before[name] for name in _HELD_BY_DEBUGGERS):
        gc.collect()  # a debugger in a reference cycle, unreachable: its finalizer lets go (only then: no cost)
        after = _global_state()
        if after["probes.copies holders"] < before["probes.copies holders"]:
            # an earlier test's debugger, unreachable, collected during this one: its hold let go, no leak of this
            # test's (seen in the suite: the error fell on whichever test the collector ran in)
            before = {**before, **{name: after[name] for name in _HELD_BY_DEBUGGERS}}
    leaked = [name for name in before if after[name] != before[name]]
    if leaked:
        pytest.fail(f"the test left global state changed: {', '.join(leaked)}", pytrace=False)
