"""gradients: trainable parameters, backward order, module-norm bookkeeping."""

import pytest
import torch

from diffusion_debug.probes import BackwardOrder
from diffusion_debug.training.measure import gradients
from diffusion_debug.training.measure.gradients import ModuleNormBook, TrainableParameters


def test_backward_order_is_bounded_and_attach_is_undoable(mlp):
    params = TrainableParameters.of(mlp)
    order = BackwardOrder(params).attach()
    for _ in range(3):
        mlp(torch.randn(2, 4)).sum().backward()
    assert len(order.order) == len(params) == 4  # the last backward's order only
    assert order.first([0, 2]) == 2  # the last layer's weight is reached before the first layer's
    order.remove()
    order.remove()  # idempotent
    assert not any(p._post_accumulate_grad_hooks for p in mlp.parameters())
    order.attach()
    order.attach()  # idempotent
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in mlp.parameters())
    order.remove()


def test_first_without_a_recorded_backward_is_reverse_registration(mlp):
    order = BackwardOrder(TrainableParameters.of(mlp))
    assert order.first([0, 1]) == 1 and order.first([]) is None


def test_module_norms_and_update_ratios_equal_a_naive_reference(mlp):
    params = TrainableParameters.of(mlp)
    mlp(torch.randn(3, 4)).pow(2).sum().backward()
    book = ModuleNormBook(params.module_names, params.module_of, refresh_every=10)
    assert book.refresh_due(1) and book.refresh_due(11)
    grad_norms = params.module_norms(gradients.grad_norms(params, torch.device("cpu"))).tolist()
    book.weight_norms = params.module_norms(gradients.weight_norms(params, torch.device("cpu"))).tolist()
    assert not book.refresh_due(2)
    norms = book.update(grad_norms)
    groups = [{"params": list(mlp[0].parameters()), "lr": 0.1}, {"params": list(mlp[2].parameters()), "lr": 0.01}]
    ratios = book.update_ratios(norms, groups, params.params)
    for module, lr in (("0", 0.1), ("2", 0.01)):
        ps = list(mlp[int(module)].parameters())
        grad = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in ps])).item()
        weight = torch.linalg.vector_norm(torch.cat([p.detach().reshape(-1) for p in ps])).item()
        assert norms[module] == pytest.approx(grad, rel=1e-6)
        assert ratios[module] == pytest.approx(lr * grad / weight, rel=1e-6)
    book.update([x / 2 for x in grad_norms])
    summary = book.summary()
    assert summary["module_grad_norm_max"] == pytest.approx(dict(zip(["0", "2"], grad_norms)))
    assert summary["module_grad_norm_last"] == pytest.approx(dict(zip(["0", "2"], [x / 2 for x in grad_norms])))
    assert book.update_ratios(norms, None, params.params) == {}


def test_zero_gradients_keeps_the_tensors(mlp):
    mlp(torch.randn(3, 4)).sum().backward()
    grads = [p.grad for p in mlp.parameters()]
    gradients.zero_gradients(TrainableParameters.of(mlp))
    assert all(p.grad is g and torch.count_nonzero(g) == 0 for p, g in zip(mlp.parameters(), grads))


def test_nonfinite_mask_is_exact(mlp):
    mlp(torch.randn(3, 4)).sum().backward()
    mlp[2].bias.grad[0] = float("inf")
    assert gradients.nonfinite_mask(TrainableParameters.of(mlp)) == [False, False, False, True]
