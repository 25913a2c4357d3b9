"""forward_replay: launch's replay of a trained model's kept forward computes the call's own values (its
dropout masks, its autocast) and leaves the run as it was (generators, BatchNorm's statistics)."""

import contextlib

import torch

from diffusion_debug.training.judges.forward_replay import KeptForward, replay_forwards


class Flaky(torch.nn.Module):
    """NaN where its input is exactly 0: after a dropout, only where the mask dropped the first value."""

    def forward(self, x):
        return torch.where(x[:, :1] == 0, torch.full_like(x, float("nan")), x)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5), Flaky(), torch.nn.Linear(8, 2)
    ).train()


def _kept_call(model, x, autocast=None):
    """``model(x)`` under grad, kept as launch's pre-hook keeps it; the call's output per module."""
    kept, outputs = [], {}
    model.register_forward_pre_hook(  # launch keeps a call under grad (the replay's runs without)
        lambda m, args, kwargs: (
            kept.append(KeptForward.of("net", m, args, kwargs, [x])) if torch.is_grad_enabled() else None
        ),
        with_kwargs=True,
    )
    for name, module in model.named_children():
        module.register_forward_hook(
            lambda m, a, out, name=name: outputs.setdefault(name, []).append(out.detach().clone())
        )
    with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
        model(x)
    return kept, outputs


def _first_nan_seed(model, x):
    """A seed whose dropout drops the first value of sample 0 (the call's NaN), not the next draw's."""
    for seed in range(100):
        torch.manual_seed(seed)
        with torch.no_grad():
            first = model[2](torch.ones(2, 8))
            second = model[2](torch.ones(2, 8))
        if first[0, 0] == 0 and second[:, 0].all():
            return seed
    raise AssertionError("no seed")


def test_the_replay_draws_the_call_s_dropout_masks_and_names_the_module_its_mask_broke():
    model, x = _model(), torch.randn(2, 4)
    seed = _first_nan_seed(model, x)
    torch.manual_seed(seed)
    kept, outputs = _kept_call(model, x)
    assert outputs["3"][0].isnan().any()  # the call's NaN: its mask dropped the first value
    statistics = [b.clone() for b in model[1].buffers()]
    rng = torch.get_rng_state()
    assert replay_forwards(kept) == {"component": "net", "module": "3", "micro_step": 0}
    # the replay's own values are the call's (hooks above saw them again), bitwise
    assert all(torch.equal(a, b) for a, b in zip(outputs["2"][0].flatten(), outputs["2"][1].flatten()))
    assert torch.equal(outputs["2"][0], outputs["2"][1])
    assert torch.equal(torch.get_rng_state(), rng)  # the user's generator as it was
    assert all(torch.equal(a, b) for a, b in zip(model[1].buffers(), statistics))  # BatchNorm's statistics too


def test_the_replay_runs_under_the_call_s_autocast_and_skips_an_argument_changed_in_place():
    model, x = _model().eval(), torch.randn(2, 4)
    kept, outputs = _kept_call(model, x, autocast=torch.bfloat16)
    assert kept[0].autocast == (("cpu", torch.bfloat16),)
    assert replay_forwards(kept) is None  # finite: nothing named
    assert outputs["4"][1].dtype == torch.bfloat16 and torch.equal(outputs["4"][0], outputs["4"][1])
    x.add_(1.0)  # the script changed the argument after the call: its values are not the call's
    assert replay_forwards(kept) == {"skipped": ["changed"]}


def test_a_model_compiled_in_place_is_replayed_eagerly_without_a_recompile():
    """``model.compile()``: the replay's probes would be hooks inside compiled code (a recompile, counting
    nothing); it runs the model's Python under ``set_stance("force_eager")`` and names the module."""
    from torch._dynamo.utils import counters

    from diffusion_debug.installed import HAS_SET_STANCE

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    with torch.no_grad():
        model[1].weight[0, 0] = float("inf")
    model.compile(backend="eager")
    x = torch.randn(2, 4)
    kept = [KeptForward.of("net", model, (x,), {}, [x])]  # as launch's pre-hook keeps it (none here: no guard of its)
    model(x)
    frames = counters["stats"]["unique_graphs"]
    if not HAS_SET_STANCE:  # torch 2.5: not replayed (its hooks would recompile it)
        assert replay_forwards(kept) == {"skipped": ["compiled"]}
        return
    assert replay_forwards(kept) == {"component": "net", "module": "1", "micro_step": 0}
    model(x)
    assert counters["stats"]["unique_graphs"] == frames  # no graph made by the replay, nor after it


class _NeedsGrad(torch.nn.Module):
    """A model whose forward asserts grad mode (a gradient penalty's): its replay under no_grad raises."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x):
        if not torch.is_grad_enabled():
            raise RuntimeError("needs grad")
        return self.linear(x)


def test_a_replay_that_raises_is_recorded_as_the_forward_replay_s_and_the_step_goes_on(tmp_path):
    from diffusion_debug import DebugConfig, TrainingDebugger
    from diffusion_debug.training.measure.loss import CountedInputs

    torch.manual_seed(0)
    model, x = _NeedsGrad(), torch.randn(2, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kept = KeptForward.of("model", model, (x,), {}, [x])
    loss = model(x).sum() * float("nan")  # made by the loss: the replay is asked, and raises
    loss.backward()
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), log_level="error"))
    tdbg.monitor_training_step(
        loss, optimizer=optimizer, step=0, inputs=CountedInputs({"x": torch.tensor(0)}, {}, [kept])
    )
    errors = [a for a in tdbg.report().anomalies if a.kind == "debugger_error"]
    tdbg.close()
    assert [(a.details["where"], a.message) for a in errors] == [
        (
            "forward replay",
            "Rank 0 failed to replay the trained model's forward of step 0 (RuntimeError: needs grad) and training "
            "went on; set strict=True to see the traceback.",
        )
    ]


def test_the_call_s_cuda_generator_is_set_only_on_a_device_the_replay_puts_back(monkeypatch):
    """The replay sets the generator of the device current at the call to its state then: that device is
    among those ``fork_rng`` restores, also when the current device moved since (torch.cuda's calls recorded:
    no GPU needed), so the run's CUDA random stream is as before."""
    forked, set_on = [], []

    @contextlib.contextmanager
    def fork_rng(devices=(), **kwargs):
        forked.append(sorted(devices))
        yield

    monkeypatch.setattr(torch.random, "fork_rng", fork_rng)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: set_on.append(device))
    model, x = torch.nn.Linear(2, 2), torch.ones(1, 2)
    kept = KeptForward.of("net", model, (x,), {}, [x])
    kept.cuda_rng = (1, torch.zeros(16, dtype=torch.uint8))  # the call ran with cuda:1 current, the judge on another
    assert replay_forwards([kept]) is None
    assert set_on == [1] and 1 in forked[0]


def test_a_model_with_a_training_sync_batch_norm_is_not_replayed_under_a_process_group(monkeypatch):
    """SyncBatchNorm in training mode gathers the batch statistics of every rank in its forward: replayed on
    the one rank whose loss is NaN, it would wait for ranks that never join (a hang). Under an initialised
    process group such a model is not replayed, and the NaN loss says why."""
    from diffusion_debug.record import make_anomaly

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.SyncBatchNorm(8)).train()
    x = torch.randn(2, 4)
    kept = [KeptForward.of("net", model, (x,), {}, [x])]
    assert replay_forwards(kept) == {"skipped": ["collective"]}
    assert make_anomaly(
        "nonfinite_loss",
        component="model",
        step=3,
        rank=1,
        details={"loss": float("nan"), "forward_replay": "collective"},
    ).message.endswith(
        "check the forward pass (the trained model's forward was not replayed: its SyncBatchNorm gathers every "
        "rank's statistics in training mode, and a replay on this rank alone would wait for the others), or lower "
        "the learning rate."
    )
    model.eval()  # no exchange in eval mode: replayed
    assert replay_forwards(kept) is None


class _NanAbove(torch.nn.Module):
    """NaN where its input exceeds 1: a micro-batch of large values breaks it, a small one does not."""

    def forward(self, x):
        return torch.where(x > 1, torch.full_like(x, float("nan")), x)


def test_the_micro_step_named_is_the_model_s_own_call_count_not_the_place_among_every_model_s_calls():
    """DreamBooth with ``--train_text_encoder`` and accumulation: each micro-step keeps the text encoder's
    call, then the UNet's. A NaN made in the UNet's second call is micro-step 1, not the fourth call's 3."""
    encoder, unet = torch.nn.Identity(), torch.nn.Sequential(torch.nn.Identity(), _NanAbove())
    small, large = torch.full((1, 2), 0.5), torch.full((1, 2), 2.0)
    calls = [
        KeptForward.of(name, model, (x,), {}, [x])
        for name, model, x in [("text_encoder", encoder, small), ("unet", unet, small)]
        + [("text_encoder", encoder, small), ("unet", unet, large)]
    ]
    assert replay_forwards(calls) == {"component": "unet", "module": "1", "micro_step": 1}
    assert replay_forwards(calls[1:2] + calls[3:])["micro_step"] == 1  # the UNet's calls alone: the same


def test_the_replay_keeps_the_weight_cache_of_an_autocast_turned_on_without_a_region():
    """A script that turned autocast on with ``torch.set_autocast_enabled`` (no region, nesting count 0) keeps its
    cache of cast weights from call to call: the replay's ``torch.autocast`` region, left at count 0, cleared it,
    and the script's next call cast the weight and bias of each Linear again (5 ``_to_copy`` where it made 1)."""
    from diffusion_debug.op_count import count_aten_ops

    model, x = _model().eval(), torch.randn(2, 4)
    torch.set_autocast_enabled("cpu", True)
    try:
        torch.set_autocast_dtype("cpu", torch.bfloat16)
        kept, _ = _kept_call(model, x)
        with count_aten_ops() as warm:
            model(x)
        assert kept[0].autocast == (("cpu", torch.bfloat16),)
        assert replay_forwards(kept) is None  # finite: nothing named
        with count_aten_ops() as after:
            model(x)
    finally:
        torch.set_autocast_enabled("cpu", False)
        torch.clear_autocast_cache()
    assert warm.counts["aten._to_copy.default"] == after.counts["aten._to_copy.default"] == 1
    assert warm.counts == after.counts


def test_the_replay_under_another_dtype_than_the_scripts_autocast_casts_for_itself():
    """The cache of cast weights is keyed by the weight alone: a call kept under bfloat16 autocast, replayed while
    the script's float16 autocast is on without a region, read its float16 casts ('mat1 and mat2 must have the same
    dtype'), and its bfloat16 casts, left in the cache, raised in the script's next call. The replay casts for
    itself and finds the call's NaN; the script's next call casts what it did before."""
    from diffusion_debug.op_count import count_aten_ops

    model, x = _model(), torch.randn(2, 4)
    torch.manual_seed(_first_nan_seed(model, x))
    kept, _ = _kept_call(model, x, autocast=torch.bfloat16)
    torch.set_autocast_enabled("cpu", True)
    try:
        torch.set_autocast_dtype("cpu", torch.float16)
        model(x)
        with count_aten_ops() as warm:
            model(x)
        named = replay_forwards(kept)
        with count_aten_ops() as after:
            dtype = model(x).dtype
    finally:
        torch.set_autocast_enabled("cpu", False)
        torch.clear_autocast_cache()
    assert named == {"component": "net", "module": "3", "micro_step": 0}
    assert (dtype, warm.counts) == (torch.float16, after.counts)
