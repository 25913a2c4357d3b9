"""launch_inputs: what `diffusion-debug launch` counts on its way to the trained model (the batch,
a frozen text encoder's output, the trained model's arguments), in-process with a real tiny CLIP
text encoder; the launched scripts themselves are in test_launch.py. Long because each way a script
holds its models (compiled before or after launch watched them, DDP, validation) is checked here on
the same fixtures, in-process."""

import pytest
import torch
from transformers import CLIPTextConfig, CLIPTextModel

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.jobs.launch_inputs import InputWatch, frozen_models, script_modules
from diffusion_debug.record import by_cause, folded
from diffusion_debug.stats.host import count_host_transfers
from diffusion_debug.testing.features import clip_name
from diffusion_debug.training.measure.loss import CountedInputs


class Denoiser(torch.nn.Module):
    """The trained model: a noisy sample and the text embedding in, a prediction out."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 8)
        self.out = torch.nn.Linear(8, 8)

    def forward(self, sample, encoder_hidden_states):
        return self.out(sample + self.proj(encoder_hidden_states).mean(1))


@pytest.fixture
def models():
    torch.manual_seed(0)
    config = CLIPTextConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=8,
    )
    text_encoder = CLIPTextModel(config).requires_grad_(False)
    return text_encoder, Denoiser()


def _batches(steps, nan_pixel_at=None):
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(steps):
        pixels, ids = torch.randn(2, 8, generator=g), torch.randint(0, 64, (2, 8), generator=g)
        batch = {"pixel_values": pixels, "input_ids": ids}
        if step == nan_pixel_at:
            batch["pixel_values"][1, 3] = float("nan")
        out.append(batch)
    return out


class Loader:
    """A DataLoader stand-in whose class ``watch_loader`` patches (and restores)."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        yield from self.batches


def _watched(unet, tmp_path, **frozen):
    """An InputWatch of the trained ``unet`` and the ``frozen`` models (by name), an SGD of the UNet and its
    TrainingDebugger: what launch readies for a script training one model."""
    watch = InputWatch()
    watch.watch_trained(unet, "unet")
    for name, model in frozen.items():
        watch.watch_frozen(model, name)
    optimizer = torch.optim.SGD(unet.parameters(), lr=0.01)
    tdbg = TrainingDebugger(unet, config=DebugConfig(output_dir=str(tmp_path), log_level="error"))
    return watch, optimizer, tdbg


def _train(text_encoder, unet, tmp_path, *, steps=4, nan_pixel_at=None, nan_token_at=None, counted=True):
    watch, optimizer, tdbg = _watched(unet, tmp_path, text_encoder=text_encoder)
    loader = Loader(_batches(steps, nan_pixel_at))
    watch.watch_loader(loader)
    predictions = []
    try:
        for step, batch in enumerate(loader):
            if step == nan_token_at:
                with torch.no_grad():
                    text_encoder.get_input_embeddings().weight[batch["input_ids"][0, 2]] = float("nan")
            embedding = text_encoder(batch["input_ids"], return_dict=False)[0]
            prediction = unet(batch["pixel_values"], embedding)
            predictions.append(prediction.detach().clone())
            loss = prediction.pow(2).mean()
            loss.backward()
            tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, inputs=watch.take() if counted else None)
            optimizer.step()
            optimizer.zero_grad()
    finally:
        watch.remove()
    report = tdbg.report()
    tdbg.close()
    return report, predictions


def test_a_nan_pixel_is_the_headline_as_the_input_at_its_step(models, tmp_path):
    report, _ = _train(*models, tmp_path, nan_pixel_at=2)
    first = by_cause(report.anomalies)[0]
    assert (first.kind, first.component, first.step, first.parameter) == (
        "nonfinite_input",
        "input",
        2,
        'batch["pixel_values"]',
    )
    assert first.details["inputs"] == ['batch["pixel_values"]', "unet(sample)"]
    assert first.message == (
        'The training batch holds 1 NaN/Inf value(s) at step 2 on rank 0, in batch["pixel_values"] (then in '
        "unet(sample)): the loss and the gradients of this step follow from it; check the data pipeline "
        "(decoding, normalisation, cached latents)."
    )
    loss = next(a for a in report.anomalies if a.kind == "nonfinite_loss")
    assert (loss.step, loss.details["follows"]) == (2, {"kind": "nonfinite_input", "rank": 0})


def test_a_nan_token_embedding_names_the_frozen_text_encoder_and_its_weight(models, tmp_path):
    report, _ = _train(*models, tmp_path, nan_token_at=1)
    first = by_cause(report.anomalies)[0]
    # at the weight that holds the NaN: one token's embedding row, 16 wide
    assert (first.kind, first.component, first.module, first.parameter, first.step) == (
        "nonfinite_input",
        "text_encoder",
        clip_name("embeddings.token_embedding"),
        clip_name("embeddings.token_embedding.weight"),
        1,
    )
    assert first.details["inputs"] == ["text_encoder(...)[0]", "text_encoder(...)[1]", "unet(encoder_hidden_states)"]
    # attention (0 x NaN) spreads the row to the 8 positions of its prompt
    assert (first.details["first_input_values"], first.details["nonfinite_weight_values"]) == (128, 16)
    assert first.message == (
        "text_encoder, which is not trained, made 128 NaN/Inf value(s) from finite inputs at step 1 on rank 0, in "
        "text_encoder(...)[0] (then in text_encoder(...)[1], unet(encoder_hidden_states)): the loss and the "
        f"gradients of this step follow from it; its weight {clip_name('embeddings.token_embedding.weight')} "
        "holds 16 NaN/Inf "
        "value(s): check the checkpoint it was loaded from and any code that changes it."
    )
    loss = next(a for a in report.anomalies if a.kind == "nonfinite_loss" and a.step == 1)
    assert loss.details["follows"] == {"kind": "nonfinite_input", "rank": 0, "component": "text_encoder"}
    assert loss.message == "The loss is nan at step 1 on rank 0, from the NaN/Inf output of text_encoder of this step."


def test_a_clean_run_is_quiet_and_the_hooks_change_nothing(models, tmp_path):
    text_encoder, unet = models
    state = {k: v.clone() for k, v in unet.state_dict().items()}
    watched, watched_predictions = _train(text_encoder, unet, tmp_path / "a")
    unet.load_state_dict(state)
    plain_report, plain_predictions = _train(text_encoder, unet, tmp_path / "b", counted=False)
    assert [a.kind for a in watched.anomalies] == []
    assert all(torch.equal(a, b) for a, b in zip(watched_predictions, plain_predictions))
    assert Loader.__iter__.__qualname__ == "Loader.__iter__"  # the class's own, given back


def _compiled_steps(text_encoder, unet, watched):
    """Three forwards and backwards of ``torch.compile(unet)`` (aot_eager) fed by a frozen text encoder
    (an embedding: a CLIP's compile costs seconds), compiled too; with ``watched``, both models' calls
    watched (registered before the first call, as launch registers them when the script prepares):
    the outputs, the gradients and dynamo's graph count and graph breaks."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    trained, frozen = torch.compile(unet, backend="aot_eager"), torch.compile(text_encoder, backend="aot_eager")
    watch = InputWatch()
    if watched:
        watch.watch_trained(unet, "unet")
        watch.watch_frozen(text_encoder, "text_encoder")
    out = []
    try:
        for batch in _batches(3):
            prediction = trained(batch["pixel_values"], frozen(batch["input_ids"]))
            prediction.square().mean().backward()
            watch.end_backward()
            out.append(prediction.detach())
    finally:
        watch.remove()
    graphs = counters["stats"]["unique_graphs"]
    return out + [p.grad.clone() for p in unet.parameters()], graphs, dict(counters["graph_break"])


def test_a_compiled_model_s_calls_get_no_graph_break_or_recompile_from_the_watch(models):
    """A model the script compiled runs the watch's hooks inside the compiled code: they count nothing
    there and add no graph or graph break, and the run is bitwise the plain one. Before, dynamo traced
    the hooks' Python (the watch's sets and dicts): 5 graphs for the plain run's 2 on these models; on a
    compiled DDP UNet under launch (2 processes), graph breaks whose functions fell back to eager and
    final weights an ulp off the unwatched run's."""
    _, unet = models
    text_encoder = torch.nn.Embedding(64, 16).requires_grad_(False)
    state = {k: v.clone() for k, v in unet.state_dict().items()}
    plain, plain_graphs, plain_breaks = _compiled_steps(text_encoder, unet, watched=False)
    unet.load_state_dict(state)
    unet.zero_grad(set_to_none=True)
    watched, graphs, breaks = _compiled_steps(text_encoder, unet, watched=True)
    assert (graphs, breaks) == (plain_graphs, plain_breaks)
    assert all(torch.equal(a, b) for a, b in zip(watched, plain))


def test_validation_on_the_model_inside_a_compiled_ddp_wrapper_is_inference(models, one_rank_group):
    """``torch.compile`` around DDP (what Accelerate's prepare returns for a compiled model, or with its
    ``dynamo_backend``) is the trained model launch watches; a validation at a step's start calls the
    unwrapped model eagerly under ``no_grad`` (``accelerator.unwrap_model``): inference, so the NaN the
    text encoder made for its prompt is no input of the step (what fed the step before it is forgotten, as
    for any watched model). Before, only the wrapper was hooked: the validation's NaN embedding was
    counted into the step as ``text_encoder(...)``, a false ``nonfinite_input``."""
    text_encoder, unet = models
    torch._dynamo.reset()
    trained = torch.compile(torch.nn.parallel.DistributedDataParallel(unet), backend="aot_eager")
    watch = InputWatch()
    watch.watch_trained(trained, "unet")
    watch.watch_frozen(text_encoder, "text_encoder")
    loader = Loader(_batches(2))
    watch.watch_loader(loader)
    embeddings = text_encoder.get_input_embeddings().weight
    counted = []
    try:
        for step, batch in enumerate(loader):
            if step == 1:  # validation: a prompt whose token's embedding is NaN, the unwrapped model
                saved = embeddings[5].clone()
                with torch.no_grad():
                    embeddings[5] = float("nan")
                    unet(torch.zeros(1, 8), text_encoder(torch.tensor([[5, 1, 2]]))[0])
                    embeddings[5] = saved
            trained(batch["pixel_values"], text_encoder(batch["input_ids"])[0]).square().mean().backward()
            watch.end_backward()
            counted.append({path: int(count) for path, count in watch.take().items()})
    finally:
        watch.remove()
    encoded = [f'text_encoder(...)["{key}"]' for key in ("last_hidden_state", "pooler_output")]
    arguments = ["unet(sample)", "unet(encoder_hidden_states)"]
    assert counted == [dict.fromkeys(['batch["pixel_values"]', *encoded, *arguments], 0), dict.fromkeys(arguments, 0)]


def test_a_compiled_ddp_model_of_torch_s_own_class_stays_uncompiled_as_in_the_plain_run(one_rank_group):
    """DDP calls its module from code dynamo skips; torch compiles the forward of one of its own classes
    there only when it has hooks (``trace_rules.check_verbose``): the watch hooks no ``nn.Sequential``
    inside a compiled wrapper (the plain run compiles none of it: with inductor, weights an ulp off)."""
    from torch._dynamo.utils import counters

    graphs = []
    for watched in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        trained = torch.compile(torch.nn.parallel.DistributedDataParallel(model), backend="aot_eager")
        watch = InputWatch()
        if watched:
            watch.watch_trained(trained, "model")
        trained(torch.ones(2, 8)).sum().backward()
        watch.remove()
        graphs.append((counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())))
    assert graphs[1] == graphs[0] and graphs[0][0] == 0


def _compiled_after_watch(unet, watched, one_rank_group):
    """Two steps of a DDP UNet compiled (aot_eager) after launch watched it (the script's
    ``model = accelerator.prepare(model); model = torch.compile(model)``): the outputs and gradients,
    dynamo's graph count, its graph breaks, and the counts of the watched run's steps."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ddp = torch.nn.parallel.DistributedDataParallel(unet)
    watch = InputWatch()
    if watched:
        watch.watch_trained(ddp, "unet")  # at prepare
    trained = torch.compile(ddp, backend="aot_eager")
    out, counted = [], []
    try:
        for batch in _batches(2, nan_pixel_at=1):
            prediction = trained(batch["pixel_values"], torch.ones(2, 3, 16))
            prediction.square().mean().backward()
            watch.end_backward()
            out.append(prediction.detach())
            counted.append({path: int(count) for path, count in (watch.take() or {}).items()})
    finally:
        watch.remove()
    graphs = counters["stats"]["unique_graphs"]
    return out + [p.grad.clone() for p in unet.parameters()], graphs, dict(counters["graph_break"]), counted


def test_a_ddp_model_compiled_after_it_was_watched_gets_no_graph_break_and_is_counted_at_the_wrapper(
    models, one_rank_group
):
    """DDP prepared, then compiled by the script: the watch, told of the wrapper as ``torch.compile``
    makes it (before its first call), moves the trained model's hook from DDP to the wrapper, whose
    hooks run before the compiled code: the arguments are counted there, by the UNet's names, and
    dynamo's graphs and graph breaks are the plain run's, the run bitwise. Before, the pre-hook on DDP
    made dynamo trace DDP's own Python: 4 graph breaks for the plain run's 3."""
    _, unet = models
    state = {k: v.clone() for k, v in unet.state_dict().items()}
    plain, plain_graphs, plain_breaks, _ = _compiled_after_watch(unet, False, one_rank_group)
    unet.load_state_dict(state)
    unet.zero_grad(set_to_none=True)
    watched, graphs, breaks, counted = _compiled_after_watch(unet, True, one_rank_group)
    assert (graphs, breaks) == (plain_graphs, plain_breaks)
    assert all(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(watched, plain))  # bitwise
    assert counted == [
        {"unet(sample)": 0, "unet(encoder_hidden_states)": 0},
        {"unet(sample)": 1, "unet(encoder_hidden_states)": 0},
    ]


class _Encoder(torch.nn.Module):
    """A frozen text encoder of the script's class (torch's own would have its hooks traced)."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(64, 16).requires_grad_(False)

    def forward(self, ids):
        return self.embedding(ids)


def test_models_compiled_after_they_were_watched_are_counted_with_the_plain_run_s_graphs(models):
    """The script compiles its trained and its frozen model after ``prepare`` (launch watched both):
    the trained model's hook moves to its wrapper as torch.compile makes it, the frozen one keeps its
    own (it runs before the compiled ``forward``) and its wrapper gets none, so what the watch adds
    after the first call (launch's look at the script's models at the first ``backward``) adds nothing
    dynamo guards on: the plain run's graphs and breaks, bitwise, both models' calls counted. Before,
    the frozen model's wrapper got hooks on the model's children there: a recompile (3 graphs for 2)."""
    from torch._dynamo.utils import counters

    _, unet = models
    text_encoder = _Encoder()
    state = {k: v.clone() for k, v in unet.state_dict().items()}
    runs = []
    for watched in (False, True):
        unet.load_state_dict(state)
        unet.zero_grad(set_to_none=True)
        torch._dynamo.reset()
        counters.clear()
        watch = InputWatch()
        if watched:  # at prepare
            watch.watch_trained(unet, "unet")
            watch.watch_frozen(text_encoder, "text_encoder")
        trained, frozen = torch.compile(unet, backend="aot_eager"), torch.compile(text_encoder, backend="aot_eager")
        out, counted = [], []
        try:
            for step, batch in enumerate(_batches(3)):
                prediction = trained(batch["pixel_values"], frozen(batch["input_ids"]))
                prediction.square().mean().backward()
                if watched and step == 0:  # at the first backward: what the script holds now
                    watch.watch_trained(trained, "unet")
                    watch.watch_frozen(frozen, "text_encoder")
                watch.end_backward()
                out.append(prediction.detach())
                counted.append(sorted(watch.take() or {}))
        finally:
            watch.remove()
        grads = [p.grad.clone() for p in unet.parameters()]
        runs.append((out + grads, counters["stats"]["unique_graphs"], dict(counters["graph_break"]), counted))
    (plain, plain_graphs, plain_breaks, _), (watched, graphs, breaks, counted) = runs
    assert (graphs, breaks) == (plain_graphs, plain_breaks)
    assert all(torch.equal(a, b) for a, b in zip(watched, plain))
    assert counted == [["text_encoder(...)", "unet(encoder_hidden_states)", "unet(sample)"]] * 3


def test_a_trained_model_compiled_for_validation_keeps_its_training_calls_counted(models):
    """The script trains the model it prepared and compiles it only to validate (``torch.compile``'s
    wrapper called under ``no_grad``, the model itself still trained): its training arguments stay
    counted at every step, as before the compile."""
    _, unet = models
    text_encoder = _Encoder()
    watch = InputWatch()
    counted = []
    try:
        watch.watch_trained(unet, "unet")
        for step, batch in enumerate(_batches(3)):
            unet(batch["pixel_values"], text_encoder(batch["input_ids"])).square().mean().backward()
            watch.end_backward()
            counted.append(sorted(watch.take() or {}))
            if step == 0:  # validation: a compiled copy of the trained model, run without grad
                validated = torch.compile(unet, backend="aot_eager")
                with torch.no_grad():
                    validated(batch["pixel_values"], text_encoder(batch["input_ids"]))
                watch.take()
    finally:
        watch.remove()
    assert counted == [["unet(encoder_hidden_states)", "unet(sample)"]] * 3


class UNet2DConditionModel(torch.nn.Linear):
    """Named by its class as launch names the script's models (``launched._model_names``)."""


def test_models_compiled_after_they_were_watched_keep_their_names_in_launch_s_debugger(one_rank_group):
    """Launch gives its debugger ``torch.compile``'s wrapper of a model compiled after ``prepare``
    (:meth:`InputWatch.compiled_as`): its component keeps the model's name (``unet``), as without the
    compile, on one process (the model itself inside) and under DDP. Before: ``optimizedmodule``."""
    from torch.nn.parallel import DistributedDataParallel

    from diffusion_debug.jobs.launched import _model_names

    unet, text_encoder = UNet2DConditionModel(2, 2), _Encoder()
    for trained in (unet, DistributedDataParallel(unet)):
        watch = InputWatch()
        try:
            watch.watch_trained(trained, "unet")
            watch.watch_trained(text_encoder, "text_encoder")
            compiled = torch.compile(trained, backend="aot_eager")
            given = _model_names([watch.compiled_as(m) for m in (trained, text_encoder)])
        finally:
            watch.remove()
        assert given == {"unet": compiled, "_encoder": text_encoder}


def test_ddp_around_a_compiled_model_names_its_arguments_by_the_model_s_forward(models, one_rank_group):
    """DDP around ``torch.compile(model)`` (Accelerate's prepare of a model the script compiled first):
    the arguments are counted at DDP, named by the trained model's ``forward``. Before, by the compile
    wrapper's ``(*args, **kwargs)``: ``unet(args)[0]``."""
    _, unet = models
    torch._dynamo.reset()
    trained = torch.nn.parallel.DistributedDataParallel(torch.compile(unet, backend="aot_eager"))
    watch = InputWatch()
    watch.watch_trained(trained, "unet")
    batch = _batches(1, nan_pixel_at=0)[0]
    try:
        trained(batch["pixel_values"], encoder_hidden_states=torch.ones(2, 3, 16)).sum().backward()
    finally:
        watch.remove()
    watch.end_backward()
    assert {path: int(count) for path, count in watch.take().items()} == {
        "unet(sample)": 1,
        "unet(encoder_hidden_states)": 0,
    }


class _TinyVAE(torch.nn.Module):
    """A frozen VAE's shape: the script calls ``vae.encode``, which calls its ``encoder`` child."""

    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(8, 4)

    def encode(self, x):
        return self.encoder(x)

    def forward(self, x):
        return self.encode(x)


@pytest.mark.parametrize("in_place", [False, True], ids=["wrapper", "in_place"])
def test_a_compiled_frozen_model_the_script_holds_is_counted_at_its_wrapper_and_its_weight_named(in_place):
    """``vae = torch.compile(vae)``: the script holds the wrapper (launch watches what it holds).
    ``vae.encode`` runs eagerly (torch.compile compiles ``forward`` only): its child's call is counted,
    and the NaN weight is named as in the model, not the wrapper (``_orig_mod.``); ``vae(x)`` runs the
    compiled code, counted at the wrapper, with the graphs of the unwatched call. Before, ``encode``
    counted nothing (the wrapper's one child is ``_orig_mod``) and the weight read
    ``_orig_mod.encoder.weight``. ``vae.compile()`` (``in_place``: a frozen text encoder or VAE compiled
    where it is, no wrapper) is counted as its uncompiled twin, with the unwatched call's graphs, graph
    breaks and output: torch compiles the model's ``_call_impl``, a frame dynamo skips, and traces each
    hook as a frame of its own; its call's hooks now run eagerly there (as a trained model's), where
    before they were traced and ``vae(x)`` counted nothing."""
    from torch._dynamo.utils import counters

    from diffusion_debug.probes.tracing import compile_callback

    if in_place and compile_callback is None:
        pytest.skip("no dynamo frame callback to ask on this torch (2.5): model.compile()'s calls count nothing")
    seen, outputs = [], []
    for watched in (False, True):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        vae = _TinyVAE().requires_grad_(False)
        with torch.no_grad():
            vae.encoder.weight[1] = float("nan")
        if in_place:
            vae.compile(backend="aot_eager")
        else:
            vae = torch.compile(vae, backend="aot_eager")
        watch = InputWatch()
        if watched:
            watch.watch_frozen(vae, "vae")
        vae.encode(torch.ones(2, 8))
        encoded = watch.take()
        outputs.append([vae(torch.full((2, 8), float(i))) for i in (1, 2)])  # a second call: no recompile
        called = watch.take()
        watch.remove()
        seen.append((counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())))
    assert seen == [(1, 0), (1, 0)]
    same = [torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(*outputs)]
    assert same == [True, True]
    assert {path: int(count) for path, count in encoded.items()} == {"vae.encoder(input)": 0, "vae.encoder(...)": 2}
    assert encoded.producers["vae.encoder(...)"][2]() == ("encoder.weight", 8)
    assert {path: int(count) for path, count in called.items()} == {"vae(x)": 0, "vae(...)": 4}


def test_counting_reads_nothing_on_the_host_and_the_step_keeps_its_one_transfer(models, tmp_path):
    text_encoder, unet = models
    watch = InputWatch()
    watch.watch_trained(unet, "unet")
    watch.watch_frozen(text_encoder, "text_encoder")
    optimizer = torch.optim.SGD(unet.parameters(), lr=0.01)
    tdbg = TrainingDebugger(unet, config=DebugConfig(output_dir=str(tmp_path), memory_tracking=False))
    for step, batch in enumerate(_batches(3)):
        with count_host_transfers() as forward_reads:
            loss = unet(batch["pixel_values"], text_encoder(batch["input_ids"], return_dict=False)[0]).pow(2).mean()
            inputs = watch.take()
        assert forward_reads.calls == []
        assert isinstance(inputs, CountedInputs) and list(inputs) == [
            "text_encoder(...)[0]",
            "text_encoder(...)[1]",
            "unet(sample)",
            "unet(encoder_hidden_states)",
        ]
        loss.backward()
        with count_host_transfers() as reads:
            tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, inputs=inputs)
        if step:  # the first step compares the optimizer with the model once
            assert reads.calls == ["tolist"], (step, reads.calls)
        optimizer.step()
        optimizer.zero_grad()
    watch.remove()
    tdbg.close()


def test_frozen_models_are_the_script_s_modules_that_train_nothing(models):
    text_encoder, unet = models
    vae = torch.nn.Conv2d(3, 4, 1).requires_grad_(False)  # noqa: F841 (the script's locals are what is read)
    loss_fn = torch.nn.MSELoss()  # noqa: F841 (no parameters: not a model)
    part_of_unet = unet.proj  # noqa: F841 (shares the trained parameters)
    held = script_modules()
    assert {name for name, _ in held.values()} >= {"text_encoder", "unet", "vae", "loss_fn", "part_of_unet"}
    assert [name for name, _ in frozen_models([unet], held)] == ["text_encoder", "vae"]


def test_a_nan_made_in_validation_is_not_the_next_step_s_input(models, tmp_path):
    """No DataLoader to start each step: validation (the trained model under no_grad, then a frozen
    decoder that overflows, as an fp16 VAE does) comes between two training steps and stays out."""
    text_encoder, unet = models
    decoder = torch.nn.Linear(8, 8).requires_grad_(False)
    with torch.no_grad():
        decoder.weight[0, 0] = float("inf")
    watch, optimizer, tdbg = _watched(unet, tmp_path, text_encoder=text_encoder, vae=decoder)
    for step, batch in enumerate(_batches(3)):
        loss = unet(batch["pixel_values"], text_encoder(batch["input_ids"], return_dict=False)[0]).pow(2).mean()
        loss.backward()
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, inputs=watch.take())
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():  # validation, as a pipeline runs it
            image = decoder(unet(batch["pixel_values"], text_encoder(batch["input_ids"], return_dict=False)[0]))
        assert not torch.isfinite(image).all()
    watch.remove()
    assert [a.kind for a in tdbg.report().anomalies] == []
    tdbg.close()


def test_a_frozen_model_that_overflows_with_finite_weights_is_named_by_its_call(models, tmp_path):
    """fp16 overflow, not a bad weight: the model and its output are named, and no weight."""
    text_encoder, unet = models
    with torch.no_grad():
        text_encoder.get_input_embeddings().weight.mul_(1e38)  # finite, but the layer norm's square overflows
    report, _ = _train(text_encoder, unet, tmp_path, steps=1)
    first = by_cause(report.anomalies)[0]
    assert (first.kind, first.component, first.module, first.parameter) == (
        "nonfinite_input",
        "text_encoder",
        "",
        "text_encoder(...)[0]",
    )
    assert "nonfinite_weight_values" not in first.details and "check that model's weights and dtype" in first.message


def test_a_failing_count_stops_the_watch_and_never_the_forward(models, monkeypatch):
    import diffusion_debug.jobs.launch_inputs as launch_inputs

    text_encoder, unet = models
    batch = _batches(1)[0]
    expected = unet(batch["pixel_values"], text_encoder(batch["input_ids"], return_dict=False)[0])
    watch = InputWatch()
    watch.watch_trained(unet, "unet")
    watch.watch_frozen(text_encoder, "text_encoder")

    def broken(t):
        raise RuntimeError("no kernel for this dtype")

    monkeypatch.setattr(launch_inputs, "_nonfinite", broken)
    got = unet(batch["pixel_values"], text_encoder(batch["input_ids"], return_dict=False)[0])
    watch.remove()
    assert torch.equal(got, expected)
    assert repr(watch.error) == "RuntimeError('no kernel for this dtype')" and watch.take() is None


def test_a_loader_class_gets_its_own_iter_back_and_a_running_iteration_counts_nothing_after_remove():
    class Inherited(Loader):  # its __iter__ is Loader's: after remove the class holds none of its own again
        pass

    batch = {"pixel_values": torch.full((1, 2), float("nan"))}
    watch = InputWatch()
    loader = Inherited([batch, batch])
    watch.watch_loader(loader)
    running = iter(loader)
    next(running)
    assert watch.take() is not None  # the first batch was counted (and the next micro-step begins)
    watch.remove()
    assert "__iter__" not in vars(Inherited) and Inherited.__iter__ is Loader.__iter__
    next(running)  # the iteration already running goes on, counting nothing
    assert not watch.counts


def test_a_loader_iter_the_script_set_over_launchs_stays_at_remove_and_launchs_inside_passes_through():
    """The script (or a library) wrapped the loader class's ``__iter__`` after launch did: remove
    leaves theirs (it was set back to the class's own, taking theirs off), and launch's inside
    it counts nothing."""

    class Wrapped(Loader):
        def __iter__(self):
            yield from self.batches

    batch = {"pixel_values": torch.full((1, 2), float("nan"))}
    watch = InputWatch()
    loader = Wrapped([batch, batch])
    watch.watch_loader(loader)
    launchs, seen = Wrapped.__iter__, []

    def theirs(self):
        for item in launchs(self):
            seen.append(item)
            yield item

    Wrapped.__iter__ = theirs
    try:
        watch.remove()
        assert vars(Wrapped)["__iter__"] is theirs
        assert list(loader) == [batch, batch] and seen == [batch, batch] and not watch.counts
    finally:
        del Wrapped.__iter__


def test_a_nan_seen_first_at_a_frozen_models_argument_is_the_input_though_the_trained_weights_went_nan(
    models, tmp_path
):
    """Review of the merge that has a NaN seen first at a trained model's argument follow the trained
    weights' non-finite update (a trained text encoder feeding the UNet): a frozen model's argument
    (no DataLoader counted the batch: ``vae(x)`` is the first to see the data) is counted only before
    any trained forward of the micro-step, so a trained model's weights never made it. With the
    UNet's weights made NaN by step 1's update and a NaN pixel at step 2, that NaN was listed under
    the update as "The input vae(input) of the trained model ..."; it is the data's, a root."""
    text_encoder, unet = models
    vae = _TinyVAE()
    vae.encoder = torch.nn.Linear(8, 8)
    vae.requires_grad_(False)
    watch, optimizer, tdbg = _watched(unet, tmp_path, text_encoder=text_encoder, vae=vae)
    for step, batch in enumerate(_batches(3, nan_pixel_at=2)):
        if step == 1:
            handle = unet.out.weight.register_hook(lambda grad: grad.index_fill(0, torch.tensor([0]), float("nan")))
        latents = vae.encode(batch["pixel_values"])
        loss = unet(latents, text_encoder(batch["input_ids"], return_dict=False)[0]).pow(2).mean()
        loss.backward()
        if step == 1:
            handle.remove()
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, inputs=watch.take())
        optimizer.step()
        optimizer.zero_grad()
    watch.remove()
    anomalies = tdbg.report().anomalies
    tdbg.close()
    (found,) = [a for a in anomalies if a.kind == "nonfinite_input"]
    assert (found.step, found.component, found.parameter) == (2, "input", "vae.encoder(input)")
    assert "cause" not in found.details and "weights" not in found.details
    assert found.message.startswith("The training batch holds 1 NaN/Inf value(s) at step 2 on rank 0, in vae.encoder")


def test_a_model_compiled_before_step_0_stays_at_its_wrapper_when_another_trained_model_is_called_first():
    """DreamBooth's ``--train_text_encoder`` with ``unet = torch.compile(unet)`` before step 0: the text
    encoder's training call comes first, and says nothing of which of the UNet and its wrapper trains
    (:meth:`InputWatch._settle` waits for the UNet's own first training call). It took that call for the
    UNet's: the wrapper was a copy to validate, the UNet's own hook kept inside the compiled code, and
    launch's debugger given the UNet (its hooks then traced there), not the wrapper."""
    unet, text_encoder = UNet2DConditionModel(2, 2), UNet2DConditionModel(2, 2)
    watch = InputWatch()
    try:
        watch.watch_trained(unet, "unet")
        watch.watch_trained(text_encoder, "text_encoder")
        compiled = torch.compile(unet, backend="aot_eager")
        text_encoder(torch.ones(1, 2))
        given = watch.compiled_as(unet)
    finally:
        watch.remove()
    assert given is compiled
    assert {path: int(count) for path, count in watch.take().items()} == {"text_encoder(input)": 0}


def _train_text_encoder(tmp_path, *, nan_at=None, watched=True, steps=4, nan_loss_at=None):
    """Textual inversion's loop: the text encoder's token embeddings trained (its attention dropout on), the
    denoiser frozen and called after it; a forward hook on ``encoder.layers.0.mlp.fc1`` makes its output NaN
    at step ``nan_at``. The report (None unwatched), the trained weights and the CPU generator's state after."""
    torch.manual_seed(0)
    config = CLIPTextConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=8,
        attention_dropout=0.5,
    )
    text_encoder = CLIPTextModel(config).train().requires_grad_(False)
    text_encoder.get_input_embeddings().weight.requires_grad_(True)
    unet = Denoiser().requires_grad_(False)
    fc1 = text_encoder.get_submodule(clip_name("encoder.layers.0.mlp.fc1"))
    at = [None]
    fc1.register_forward_hook(lambda module, args, output: output * float("nan") if at[0] == nan_at else None)
    optimizer = torch.optim.SGD([text_encoder.get_input_embeddings().weight], lr=0.1)
    watch, tdbg = InputWatch(), None
    if watched:
        watch.watch_trained(text_encoder, "text_encoder")
        watch.watch_frozen(unet, "unet")
        tdbg = TrainingDebugger(text_encoder, config=DebugConfig(output_dir=str(tmp_path), log_level="error"))
    loader = Loader(_batches(steps))
    if watched:
        watch.watch_loader(loader)
    try:
        for step, batch in enumerate(loader):
            at[0] = step
            embedding = text_encoder(batch["input_ids"], return_dict=False)[0]
            loss = unet(batch["pixel_values"], embedding).pow(2).mean()
            if step == nan_loss_at:  # made by the loss, after the forward
                loss = loss * float("nan")
            loss.backward()
            if watched:
                tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, inputs=watch.take())
            optimizer.step()
            optimizer.zero_grad()
    finally:
        watch.remove()
    report = tdbg.report() if watched else None
    if watched:
        tdbg.close()
    return report, text_encoder.state_dict(), torch.get_rng_state()


def _same_bytes(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_nan_made_in_a_trained_text_encoder_s_forward_is_named_at_its_module_and_step(tmp_path):
    """Launch has no closure=: the trained model's kept forward of a NaN-loss step is replayed with every module
    probed (its dropout drawing the same masks), and the module that made the NaN is the headline; the replay
    changes nothing: the trained weights (NaN from the next step on) and the generator are the unwatched run's."""
    report, weights, rng = _train_text_encoder(tmp_path / "a", nan_at=2)
    first = by_cause(report.anomalies)[0]
    assert (first.kind, first.component, first.module, first.step, first.rank) == (
        "nonfinite",  # DESIGN's stable kind: the producer, first module with finite inputs and a non-finite output
        "text_encoder",
        clip_name("encoder.layers.0.mlp.fc1"),
        2,
        0,
    )
    assert first.details["localized_by"] == "forward replay" and first.parameter is None
    assert first.message == (
        f"text_encoder.{clip_name('encoder.layers.0.mlp.fc1')} made NaN/Inf from finite inputs in the forward of "
        "step 2 on rank 0 (found by replaying that forward with every module probed): the loss and the gradients "
        "of this step follow from it; check that module's forward and dtype (fp16 overflow: bf16 or fp32), and any "
        "division, log or square root in it."
    )
    loss = next(a for a in report.anomalies if a.kind == "nonfinite_loss")
    assert loss.details["follows"] == {
        "kind": "nonfinite",
        "rank": 0,
        "component": "text_encoder",
        "module": clip_name("encoder.layers.0.mlp.fc1"),
    }
    assert loss.message == (
        f"The loss is nan at step 2 on rank 0, from the NaN/Inf made in the forward of text_encoder."
        f"{clip_name('encoder.layers.0.mlp.fc1')} of this step."
    )
    made = [a for a in report.anomalies if a.kind == "nonfinite" and "localized_by" in a.details]
    assert [(a.step, a.module) for a in made] == [(2, first.module)]
    # the step's NaN gradients (the same kind, rank and step) follow the loss, not the other way round
    grads = [a for a in report.anomalies if a.kind == "nonfinite" and a.step == 2 and a.parameter]
    assert grads and all(a.details["follows"]["kind"] == "nonfinite_loss" for a in grads)
    assert [a for a, _ in folded(report.anomalies)][0] is first
    # the next step's NaN loss (its weights went NaN in step 2's update) names the module as its root
    later = next(a for a in report.anomalies if a.kind == "nonfinite_loss" and a.step == 3)
    assert (later.details["cause"]["kind"], later.details["cause"]["place"]) == ("nonfinite", first.place())
    assert later.message.endswith(
        f"it follows the nonfinite at text_encoder {clip_name('encoder.layers.0.mlp.fc1')}, step 2: fix that first."
    )
    _, plain_weights, plain_rng = _train_text_encoder(tmp_path / "b", nan_at=2, watched=False)
    assert all(_same_bytes(weights[k], plain_weights[k]) for k in plain_weights)
    assert torch.equal(rng, plain_rng)


def test_a_clean_trained_text_encoder_run_is_quiet_and_its_weights_are_the_unwatched_run_s(tmp_path):
    report, weights, rng = _train_text_encoder(tmp_path / "a")
    _, plain_weights, plain_rng = _train_text_encoder(tmp_path / "b", watched=False)
    assert [a.kind for a in report.anomalies] == []
    assert all(_same_bytes(weights[k], plain_weights[k]) for k in plain_weights)
    assert torch.equal(rng, plain_rng)


def test_the_replay_of_a_kept_forward_is_no_call_of_the_script_s(models):
    """The replay runs the trained model without grad, as validation does: the watch does not take it for
    one (the next micro-step's frozen calls are still counted) and keeps no call of it."""
    from diffusion_debug.training.judges.forward_replay import replay_forwards

    text_encoder, unet = models
    watch = InputWatch()
    watch.watch_trained(unet, "unet")
    try:
        unet(torch.randn(2, 8), torch.randn(2, 3, 16))
        taken = watch.take()
        assert [(kept.name, kept.model) for kept in taken.forwards] == [("unet", unet)]
        assert replay_forwards(taken.forwards) is None  # finite
        assert (watch.open, watch.forwards, watch.counts) == (True, [], {})
    finally:
        watch.remove()


def test_a_nan_made_after_the_trained_forward_says_its_replay_stayed_finite(tmp_path):
    """launch has no closure= to suggest: a NaN made in the loss is said to come after the forward it replayed."""
    report, _, _ = _train_text_encoder(tmp_path, nan_loss_at=1, steps=2)
    first = by_cause(report.anomalies)[0]
    assert (first.kind, first.step, first.details["forward_replay"]) == ("nonfinite_loss", 1, "finite")
    assert first.message == (
        "The loss is nan at step 1 on rank 0; the input batch was finite, so the forward pass or the loss made it: "
        "check the forward pass (a replay of the trained model's forward with every module probed stayed finite: "
        "the loss computation after it made it), or lower the learning rate."
    )
