"""The update the optimizer really applied (issue 21, item 2): ``||dw|| / ||w||`` per module from a
fixed block of each parameter, read before and after ``optimizer.step()``; AdamW at lr 0.1 on the
tiny UNet is flagged at its first step, and a run at 1e-4 is not."""

import copy
import math

import pytest
import torch

from diffusion_debug import DebugConfig
from diffusion_debug.training.measure.gradients import TrainableParameters
from diffusion_debug.training.measure.updates import SAMPLED, UpdateSketch
from diffusion_debug.training.ranks.processes import RankContext


def _one_adamw_step(unet, lr):
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(1, unet.config.in_channels, 8, 8, generator=generator)
    context = torch.randn(1, 4, unet.config.cross_attention_dim, generator=generator)
    noise = torch.randn(sample.shape, generator=generator)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=lr)
    ((unet(sample, torch.tensor([500]), context).sample - noise) ** 2).mean().backward()
    optimizer.step()


def test_the_sketch_equals_a_naive_reference_and_tracks_the_full_update(_tiny_unet):
    unet = copy.deepcopy(_tiny_unet).train()
    params = TrainableParameters.of(unet)
    sketch = UpdateSketch(params)
    before = {name: p.detach().clone() for name, p in zip(params.names, params.params)}
    assert sketch.measure(torch.device("cpu")) is None
    _one_adamw_step(unet, lr=0.1)
    ratios = sketch.ratios(sketch.measure(torch.device("cpu")).tolist())

    sketched: dict[str, list[float]] = {}  # module -> [scaled block change^2, scaled block weight^2]
    full: dict[str, list[float]] = {}  # module -> [change^2, weight^2] over every element
    for name, p in zip(params.names, params.params):
        module = name.rpartition(".")[0]
        old, new = before[name].double().reshape(-1), p.detach().double().reshape(-1)
        count = min(SAMPLED, old.numel())
        block = slice((old.numel() - count) // 2, (old.numel() - count) // 2 + count)
        scale = old.numel() / count
        s, f = sketched.setdefault(module, [0.0, 0.0]), full.setdefault(module, [0.0, 0.0])
        s[0] += scale * (new[block] - old[block]).square().sum().item()
        s[1] += scale * old[block].square().sum().item()
        f[0] += (new - old).square().sum().item()
        f[1] += old.square().sum().item()
    reference = {m: math.sqrt(c / w) if w > 0 else math.inf for m, (c, w) in sketched.items()}
    assert ratios == pytest.approx(reference, rel=1e-5)
    truth = {m: math.sqrt(c / w) for m, (c, w) in full.items()}
    assert len(truth) == 164 and sum(r > 1 for r in truth.values()) == 74  # the count
    # the sketch: the same largest module, every clear case on the right side of 1
    assert max(ratios, key=ratios.get) == max(truth, key=truth.get) == "up_blocks.0.resnets.0.conv1"
    assert ratios["up_blocks.0.resnets.0.conv1"] == pytest.approx(truth["up_blocks.0.resnets.0.conv1"], rel=0.1)
    assert all(ratios[m] > 1 for m, r in truth.items() if r > 1.2)
    assert all(ratios[m] < 1 for m, r in truth.items() if r < 0.8)


def test_adamw_at_lr_0_1_is_flagged_at_its_first_update(tmp_path, unet_loop):
    tdbg, losses = unet_loop(DebugConfig(output_dir=str(tmp_path), log_level="error"), 3, lr=0.1)
    assert losses[1] > 3 * losses[0]  # the loss jumps at step 1, before the spike detector judges
    (spike,) = [a for a in tdbg.report().anomalies if a.severity != "info"]
    assert (spike.kind, spike.step, spike.module, spike.component) == (
        "lr_spike",
        0,
        "up_blocks.0.resnets.0.conv1",
        "optimizer",
    )
    d = spike.details
    assert (d["reason"], d["detected_at_step"], d["modules_measured"], d["threshold"]) == (
        "applied_update",
        1,
        164,
        1.0,
    )
    assert d["modules_over"] > 60 and d["update_to_weight_ratio"] > 5
    assert spike.message == (
        f"The optimizer step of step 0 moved {d['modules_over']} of 164 modules by more than 1 times their own norm "
        f"(the most: up_blocks.0.resnets.0.conv1, {d['update_to_weight_ratio']:.3g}x; measured from the weights): "
        "lower the learning rate or warm it up."
    )
    steps = tdbg.report().steps
    assert "max_applied_update_ratio" not in steps[0]  # the first step has no update before it
    assert steps[1]["max_applied_update_ratio"] == d["update_to_weight_ratio"]


def test_a_clean_run_measures_small_updates_and_the_step_keeps_one_collective(tmp_path, unet_loop, monkeypatch):
    calls = []
    for name in ("gather", "gather_objects", "broadcast_object", "barrier"):
        original = getattr(RankContext, name)
        monkeypatch.setattr(
            RankContext,
            name,
            lambda self, *a, _name=name, _original=original: calls.append(_name) or _original(self, *a),
        )
    tdbg, _ = unet_loop(DebugConfig(output_dir=str(tmp_path), log_level="error"), 4, lr=1e-4)
    assert calls == ["gather"] * 4  # the update sketch rides in the step's one exchange
    ratios = [row["max_applied_update_ratio"] for row in tdbg.report().steps[1:]]
    assert all(0 < r < 0.05 for r in ratios), ratios
    assert [a for a in tdbg.report().anomalies if a.severity != "info"] == []


def test_a_module_that_starts_at_zero_is_not_judged():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    with torch.no_grad():
        model[1].weight.zero_()  # as LoRA's lora_B: it grows from nothing
        model[1].bias.zero_()
    sketch = UpdateSketch(TrainableParameters.of(model))
    sketch.measure(torch.device("cpu"))
    with torch.no_grad():
        model[1].weight.fill_(0.01)
    first = sketch.ratios(sketch.measure(torch.device("cpu")).tolist())
    assert first == {"0": 0.0, "1": math.inf} and sketch.grown_from_zero == {"1"}
    with torch.no_grad():
        model[1].weight.fill_(0.03)  # twice its norm: a ratio of 2, not judged
    assert sketch.ratios(sketch.measure(torch.device("cpu")).tolist())["1"] == pytest.approx(2.0)
    assert sketch.grown_from_zero == {"1"}


@pytest.mark.parametrize("padding_idx, block", [(0, "last"), (999, "middle")])
def test_an_embedding_whose_last_row_is_its_padding_row_is_sampled_in_its_middle(padding_idx, block):
    # the last rows are where a script's new tokens are; a padding row there is zero and never trained: its
    # block (128 elements, the row) read inf at the first comparison and the table was never judged
    torch.manual_seed(0)
    table = torch.nn.Embedding(1000, SAMPLED, padding_idx=padding_idx)
    optimizer = torch.optim.AdamW(table.parameters(), lr=1e-2)
    sketch = UpdateSketch(TrainableParameters.of(table))
    weights, read = [], []
    for _ in range(3):
        weights.append(table.weight.detach().double().reshape(-1).clone())
        read.append(sketch.measure(torch.device("cpu")))
        table(torch.arange(1000)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    start = 1000 * SAMPLED - SAMPLED if block == "last" else (1000 * SAMPLED - SAMPLED) // 2
    w = [x[start : start + SAMPLED] for x in weights]
    naive = [((w[k] - w[k - 1]).norm() / w[k - 1].norm()).item() for k in (1, 2)]
    assert [sketch.ratios(r.tolist())[""] for r in read[1:]] == pytest.approx(naive, rel=1e-6)
    assert all(0 < r < 1 for r in naive) and sketch.grown_from_zero == set()


def test_replaced_storage_starts_the_sketch_again_at_once_or_within_its_round(monkeypatch):
    # the first parameter's storage is checked at every step (model.to, a cast: every parameter
    # moves); a rotating STORAGE_ROUND-th of them each step, so a parameter replaced alone
    # (p.data = ...) is found within STORAGE_ROUND steps, and until then its block reads as unmoved
    from diffusion_debug.training.measure import updates

    model = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(6)])  # 12 parameters
    params = TrainableParameters.of(model)
    sketch = UpdateSketch(params)
    reads: list[int] = []
    data_ptr = torch.Tensor.data_ptr
    monkeypatch.setattr(torch.Tensor, "data_ptr", lambda t: reads.append(1) or data_ptr(t))
    cpu = torch.device("cpu")
    assert sketch.measure(cpu) is None  # the first call takes the blocks
    reads.clear()
    assert sketch.measure(cpu) is not None
    assert len(reads) == 1 + 2  # the first parameter and a round's share of 12 (every 8th), not 12
    # every parameter moved (the first among them): found at the next call
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    assert sketch.measure(cpu) is None
    assert sketch.measure(cpu) is not None
    # the last parameter replaced alone: found within the round, read as unmoved until then
    with torch.no_grad():
        model[5].bias.data = model[5].bias.data + 1.0
    found = []
    for _ in range(updates.STORAGE_ROUND):
        squares = sketch.measure(cpu)
        found.append(squares is None)
        if squares is not None:
            assert sketch.ratios(squares.tolist())["5"] == 0.0  # the old storage: no change seen
    assert found.count(True) == 1
    with torch.no_grad():
        model[5].bias.add_(1.0)  # the new storage is watched now: its update is seen
    assert sketch.ratios(sketch.measure(cpu).tolist())["5"] > 0


def test_without_segment_reduce_the_sketch_sums_its_blocks_as_with_it(_tiny_unet, monkeypatch):
    # some builds lack segment_reduce (Windows with CUDA 12.9+): the blocks, and then the modules,
    # are summed by an index_add_ instead, to the same squares (two per module: the tiny UNet's 286
    # sampled parameters are in 164 modules)
    readings = []
    for missing in (False, True):
        unet = copy.deepcopy(_tiny_unet).train()
        sketch = UpdateSketch(TrainableParameters.of(unet))
        sketch.measure(torch.device("cpu"))
        _one_adamw_step(unet, lr=0.1)
        if missing:

            def segment_reduce(*args, **kwargs):
                raise NotImplementedError("not built")

            monkeypatch.setattr(torch, "segment_reduce", segment_reduce)
        readings.append(sketch.measure(torch.device("cpu")).tolist())
        assert (sketch._groups[0].lengths is None) == missing
        assert (sketch._sums[torch.device("cpu")].lengths is None) == missing
    assert readings[0] == readings[1] and len(readings[0]) == 2 * 164


class _MixedDtypes(torch.nn.Module):
    """Modules in four dtype groups, one module over two of them (its blocks put in module order
    before the segmented sum), a parameter whose storage is not dense (no block: its module is
    not sampled) and a module that starts at zero."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(20, 30)  # 630 elements: a sampled block
        self.b = torch.nn.Linear(8, 8).to(torch.bfloat16)
        self.c = torch.nn.Linear(16, 16)
        self.c.bias = torch.nn.Parameter(torch.randn(16, generator=torch.Generator().manual_seed(1)).half())
        self.d = torch.nn.Linear(4, 4).double()
        self.e = torch.nn.Module()
        self.e.w = torch.nn.Parameter(torch.randn(6, 8)[:, ::2])
        self.z = torch.nn.Linear(3, 3)
        torch.nn.init.zeros_(self.z.weight)
        torch.nn.init.zeros_(self.z.bias)


@pytest.mark.parametrize("missing", [False, True], ids=["segment_reduce", "index_add"])
def test_blocks_of_several_dtypes_are_summed_per_module_as_a_naive_loop(missing, monkeypatch):
    torch.manual_seed(0)
    model = _MixedDtypes()
    params = TrainableParameters.of(model)
    sketch = UpdateSketch(params)
    before = {name: p.detach().clone() for name, p in zip(params.names, params.params)}
    assert sketch.measure(torch.device("cpu")) is None
    with torch.no_grad():
        for p in params.params:
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(p.dtype) / 10)
    if missing:

        def segment_reduce(*args, **kwargs):
            raise NotImplementedError("not built")

        monkeypatch.setattr(torch, "segment_reduce", segment_reduce)
    ratios = sketch.ratios(sketch.measure(torch.device("cpu")).tolist())
    assert sketch._sums[torch.device("cpu")].order is not None  # module c's blocks: two groups apart
    sums: dict[str, list[float]] = {}  # module -> [scaled change^2, scaled weight^2], block by block
    for name, p in zip(params.names, params.params):
        if not p.is_contiguous():
            continue
        kept, new = before[name].reshape(-1), p.detach().reshape(-1)
        count = min(SAMPLED, kept.numel())
        start, scale = (kept.numel() - count) // 2, kept.numel() / count
        dtype = torch.float64 if p.dtype == torch.float64 else torch.float32  # the blocks' buffer's
        old, now = kept[start : start + count].to(dtype), new[start : start + count].to(dtype)
        s = sums.setdefault(name.rpartition(".")[0], [0.0, 0.0])
        s[0] += scale * (now - old).square().sum().item()
        s[1] += scale * old.square().sum().item()
    reference = {m: math.sqrt(c / w) if w > 0 else math.inf for m, (c, w) in sums.items()}
    assert list(ratios) == ["a", "b", "c", "d", "z"] == list(reference)  # e: not sampled
    assert ratios == pytest.approx(reference, rel=1e-6) and ratios["z"] == math.inf
    assert ratios["d"] == reference["d"]  # float64 blocks: summed exactly as the loop


def _resumed_lora(tmp_path, _tiny_unet, *, spike_after=None):
    """A LoRA run on the tiny UNet (peft adapters, lora_B zero at the start) under diffusers' linear warmup
    (lr 0 at step 0, 1e-3 at step 20), stopped after step 1 and resumed from its state dicts (a new model,
    optimizer and scheduler) with a debugger made then, steps 2-9; ``spike_after``: after that step's
    optimizer step, one lora_B's weights are multiplied by 30 (an update of 29x its norm). The debugger
    (closed) and the lora_B module."""
    from diffusers.optimization import get_scheduler
    from peft import LoraConfig

    from diffusion_debug import TrainingDebugger

    def made():
        unet = copy.deepcopy(_tiny_unet).train().requires_grad_(False)
        torch.manual_seed(0)
        unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
        optimizer = torch.optim.AdamW([p for p in unet.parameters() if p.requires_grad], lr=1e-3)
        return unet, optimizer, get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=20)

    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(2, _tiny_unet.config.in_channels, 8, 8, generator=generator)
    context = torch.randn(2, 4, _tiny_unet.config.cross_attention_dim, generator=generator)
    noise = torch.randn(sample.shape, generator=generator)
    spiked = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_B.default"

    def train(unet, optimizer, scheduler, steps, tdbg=None):
        for step in steps:
            loss = ((unet(sample, torch.tensor([500, 100]), context).sample - noise) ** 2).mean()
            loss.backward()
            if tdbg is not None:
                tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if step == spike_after:
                with torch.no_grad():
                    unet.get_submodule(spiked).weight.mul_(30.0)

    first = made()
    train(*first, range(2))
    saved = copy.deepcopy([first[0].state_dict(), first[1].state_dict(), first[2].state_dict()])
    unet, optimizer, scheduler = made()  # the resume: a new process's objects, loaded
    for thing, state in zip((unet, optimizer, scheduler), saved):
        thing.load_state_dict(state)
    assert unet.get_submodule(spiked).weight.abs().amax() > 0  # lora_B grown a little: not zero
    with TrainingDebugger(unet, config=DebugConfig(output_dir=str(tmp_path), log_level="error")) as tdbg:
        train(unet, optimizer, scheduler, range(2, 10), tdbg)
    tdbg.close()
    return tdbg, spiked


def test_a_lora_resumed_early_under_a_warmup_is_quiet_and_a_real_spike_in_it_is_told(tmp_path, _tiny_unet):
    # a LoRA resumed at step 2 of a 20-step warmup: its lora_B weights have grown from zero for one update,
    # and each next update is larger (the lr rises) than the weight so far: 1-2x its norm, read as an
    # lr_spike on lora_B at the first comparison (updates.py: the skip was only for a weight still zero)
    tdbg, _ = _resumed_lora(tmp_path / "quiet", _tiny_unet)
    assert [(a.kind, a.step, a.module) for a in tdbg.report().anomalies if a.severity != "info"] == []
    ratios = [row["max_applied_update_ratio"] for row in tdbg.report().steps[1:]]
    assert ratios[0] > 1.0, ratios  # the reading that was told: growth, not a spike
    # the same run with one lora_B multiplied by 30 after step 6's update: told at step 6, on that module
    tdbg, spiked = _resumed_lora(tmp_path / "spike", _tiny_unet, spike_after=6)
    told = [a for a in tdbg.report().anomalies if a.severity != "info"]
    assert [(a.kind, a.step, a.module, a.details["reason"]) for a in told] == [
        ("lr_spike", 6, spiked, "applied_update")
    ]
    assert told[0].details["update_to_weight_ratio"] > 20  # 29x the weight, with that step's own update


def test_a_growing_module_whose_ratio_climbs_under_twice_a_step_is_told_when_it_rises():
    # growth from zero reads FALLING ratios (about 2/k after k updates): a module taken as growing at the
    # first comparison whose ratio then rises (3, 5, 9, 17, ... each under 2x its last) is no growth; before:
    # never told while each step stayed under GROWTH_MARGIN times its last
    from diffusion_debug.training.measure.updates import judge_applied_update

    growing: dict[str, float] = {}
    told = []
    ratios = [3.0, 5.0, 9.0, 17.0, 33.0, 65.0, 129.0, 257.0, 390.0]
    for i, ratio in enumerate(ratios):
        found = judge_applied_update(
            0, 3 + i, {"lora_B": ratio}, 1.0, detected_at=4 + i, growing=growing, first=i == 0, warming=True
        )
        told += [(a.kind, a.step, a.module, a.details["update_to_weight_ratio"]) for a in found]
    assert told[0] == ("lr_spike", 4, "lora_B", 5.0)
    # falling ratios (a weight grown from zero) stay quiet until under the threshold, judged as any other then
    growing, quiet = {}, []
    for i, ratio in enumerate([3.0, 1.7, 1.2, 1.1, 0.5]):
        quiet += judge_applied_update(
            0, 3 + i, {"lora_B": ratio}, 1.0, detected_at=4 + i, growing=growing, first=i == 0, warming=True
        )
    assert quiet == [] and growing == {}
