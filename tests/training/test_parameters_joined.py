"""Parameters that start training mid-run join the watch: a text encoder the optimizer holds frozen and
unfreezes at step N, a module given to a new optimizer. From then on their gradients are read as those
trained from the start: a NaN or an explosion in them names their module and step."""

from __future__ import annotations

import copy
import gc
import weakref

import torch

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.record import severity_rank


def _config(tmp_path):
    return DebugConfig(output_dir=str(tmp_path), log_level="error")


def _warnings(anomalies):
    return [a for a in anomalies if severity_rank(a.severity) >= severity_rank("warning")]


def _sd_loop(tmp_path, tiny_sd, steps, plant=None):
    """The UNet and the CLIP text encoder watched together, one AdamW over both (DreamBooth's
    ``--train_text_encoder``), the text encoder frozen until step 3 (``requires_grad_(True)`` then);
    ``plant(step, text_encoder)`` runs after backward, before monitoring."""
    unet = copy.deepcopy(tiny_sd.unet).train()
    text_encoder = copy.deepcopy(tiny_sd.text_encoder).train().requires_grad_(False)
    optimizer = torch.optim.AdamW([*unet.parameters(), *text_encoder.parameters()], lr=1e-4)
    tdbg = TrainingDebugger({"unet": unet, "text_encoder": text_encoder}, config=_config(tmp_path))
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(1, unet.config.in_channels, 8, 8, generator=generator)
    ids = torch.randint(0, text_encoder.config.vocab_size, (1, 4), generator=generator)
    noise = torch.randn(sample.shape, generator=generator)
    for step in range(steps):
        if step == 3:
            text_encoder.requires_grad_(True)
        loss = ((unet(sample, torch.tensor([500]), text_encoder(ids)[0]).sample - noise) ** 2).mean()
        loss.backward()
        if plant is not None:
            plant(step, text_encoder)
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        optimizer.step()
        optimizer.zero_grad()
    tdbg.close()
    return tdbg, text_encoder


def _fc1(text_encoder):
    """The first MLP layer of the first block and its name (its prefix differs between transformers 4 and 5)."""
    name = next(name for name, _ in text_encoder.named_modules() if name.endswith("layers.0.mlp.fc1"))
    return text_encoder.get_submodule(name), name


def test_a_nan_gradient_in_a_text_encoder_unfrozen_at_step_3_names_its_module_at_step_8(tmp_path, _tiny_sd):
    # before: the text encoder, frozen when the debugger was made, was named once as unwatched at step 3
    # and its NaN gradient at step 8 named no module of it (its gradients were never read)
    def plant(step, text_encoder):
        if step == 8:
            _fc1(text_encoder)[0].weight.grad[0, 0] = float("nan")

    tdbg, text_encoder = _sd_loop(tmp_path, _tiny_sd, 10, plant)
    module = _fc1(text_encoder)[1]
    found = [(a.kind, a.step, a.component, a.module, a.parameter) for a in _warnings(tdbg.report().anomalies)]
    assert found[0] == ("nonfinite", 8, "text_encoder", module, f"{module}.weight")
    assert not [f for f in found if f[0] == "unwatched_parameters"]


def test_an_exploding_gradient_in_a_text_encoder_unfrozen_at_step_3_names_its_module_at_step_8(tmp_path, _tiny_sd):
    def plant(step, text_encoder):
        if step == 8:
            _fc1(text_encoder)[0].weight.grad.mul_(1e9)

    tdbg, text_encoder = _sd_loop(tmp_path, _tiny_sd, 10, plant)
    explosions = [a for a in tdbg.report().anomalies if a.kind == "gradient_explosion"]
    assert [(a.step, a.component, a.module) for a in explosions] == [(8, "text_encoder", _fc1(text_encoder)[1])]


def test_a_clean_run_that_unfreezes_its_text_encoder_stays_quiet_and_reads_its_modules(tmp_path, _tiny_sd):
    tdbg, text_encoder = _sd_loop(tmp_path, _tiny_sd, 10)
    assert _warnings(tdbg.report().anomalies) == []
    # its modules are read as the UNet's: the per-module norms of a detailed step after step 3 name them
    modules = tdbg.params.module_names
    assert f"text_encoder.{_fc1(text_encoder)[1]}" in modules
    assert len(tdbg.params) == sum(1 for _ in tdbg.watched._named())


def test_a_module_given_to_a_new_optimizer_at_step_5_names_its_nan_at_step_6(tmp_path):
    # a head added to the watched model at step 5 and a new optimizer made over the whole model: before,
    # its NaN gradient at step 6 went unread (the new optimizer was compared with the watch within 100 steps)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    tdbg = TrainingDebugger(model, config=_config(tmp_path))
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for step in range(8):
        if step == 5:
            model.append(torch.nn.Linear(4, 1))
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        out = model(x)
        loss = ((out if out.shape[-1] == 1 else out[:, :1]) - y).pow(2).mean()
        loss.backward()
        if step == 6:
            model[3].bias.grad[0] = float("nan")
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        optimizer.step()
        optimizer.zero_grad()
    tdbg.close()
    found = [(a.kind, a.step, a.module, a.parameter) for a in _warnings(tdbg.report().anomalies)]
    assert found[0] == ("nonfinite", 6, "3", "3.bias")
    assert not [f for f in found if f[0] == "unwatched_parameters"]


def _refreeze_loop(tmp_path, *, strict, joins):
    """A 3-layer MLP, its middle layer frozen again at step 30 (``requires_grad_(False)``): trained from the
    start, or (``joins``) frozen until step 5 and joined then; a NaN planted at step 159 (the last) in the first layer,
    still trained. 160 steps: the backward-order hooks are registered again at the 100th."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    if joins:
        model[2].requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), log_level="error", strict=strict))
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for step in range(160):
        if joins and step == 5:
            model[2].requires_grad_(True)
        if step == 30:
            model[2].requires_grad_(False)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        if step == 159:
            model[0].weight.grad[0, 0] = float("nan")
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        optimizer.step()
        optimizer.zero_grad()
    tdbg.close()
    return [(a.kind, a.step, a.module, a.parameter) for a in _warnings(tdbg.report().anomalies)]


def test_a_watched_layer_frozen_again_breaks_neither_the_run_nor_the_watch(tmp_path):
    # before: registering the backward-order hooks again at step 99 raised "cannot register a hook on a tensor
    # that doesn't require gradient": a debugger_error, and with strict=True the user's training run ended there
    for strict in (True, False):
        for joins in (False, True):
            found = _refreeze_loop(tmp_path / f"{strict}{joins}", strict=strict, joins=joins)
            assert found == [("nonfinite", 159, "0", "0.weight")], (strict, joins, found)


def test_a_lora_adapter_added_then_deleted_is_let_go_and_not_judged(tmp_path, _tiny_unet):
    # a second LoRA adapter added at step 3 (it joins the watch), deleted at step 10 (delete_adapters) and a new
    # optimizer made. Before: the watch kept its 28 parameters alive, and their modules, never read again, were
    # judged dead (gradient_vanishing warnings at the to_v layers). A NaN planted at the last step in
    # the first adapter is still named at its parameter
    from peft import LoraConfig

    unet = copy.deepcopy(_tiny_unet).train().requires_grad_(False)
    torch.manual_seed(0)
    unet.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_k"]), adapter_name="first")
    optimizer = torch.optim.AdamW([p for p in unet.parameters() if p.requires_grad], lr=1e-3)
    tdbg = TrainingDebugger(unet, config=_config(tmp_path))
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(1, unet.config.in_channels, 8, 8, generator=generator)
    context = torch.randn(1, 3, unet.config.cross_attention_dim, generator=generator)
    first = next(name for name, _ in unet.named_parameters() if name.endswith("lora_A.first.weight"))
    refs = []
    for step in range(30):
        if step == 3:
            unet.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_v"]), adapter_name="second")
            unet.set_adapters(["first", "second"])
            added = [p.requires_grad_(True) for name, p in unet.named_parameters() if ".second." in name]
            optimizer.add_param_group({"params": added})
            refs = [weakref.ref(p) for p in added]
            del added
        if step == 10:
            unet.delete_adapters("second")
            optimizer = torch.optim.AdamW([p for p in unet.parameters() if p.requires_grad], lr=1e-3)
        loss = unet(sample, torch.tensor([10]), context).sample.pow(2).mean()
        loss.backward()
        if step == 29:
            unet.get_parameter(first).grad[0, 0] = float("nan")
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        optimizer.step()
        optimizer.zero_grad()
    tdbg.close()
    gc.collect()
    assert len(refs) == 28 and [r for r in refs if r() is not None] == []  # 14 to_v layers, lora_A and lora_B
    found = [(a.kind, a.step, a.module, a.parameter) for a in _warnings(tdbg.report().anomalies)]
    assert found == [("nonfinite", 29, first.rpartition(".")[0], first)]
