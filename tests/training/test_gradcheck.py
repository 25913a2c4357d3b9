import torch

from diffusion_debug.training import check_gradients_numerically


class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 3 * x**2


class WrongCube(Cube):
    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 2 * x**2  # should be 3 x^2


def test_correct_function_passes():
    x = torch.linspace(-1.0, 1.0, 5)
    result = check_gradients_numerically(Cube.apply, x)
    assert result.ok and result.gradcheck_passed
    assert result.failed_input is None
    assert result.max_abs_error[0] < 1e-6


def test_wrong_function_fails_with_its_error():
    x = torch.linspace(-1.0, 1.0, 5, dtype=torch.float64)
    result = check_gradients_numerically(WrongCube.apply, x)
    assert not result.ok and not result.gradcheck_passed
    assert result.failed_input == 0
    # analytical 2x^2 vs numerical 3x^2: largest difference x^2 = 1 at x = +-1
    assert abs(result.max_abs_error[0] - 1.0) < 1e-5
    assert "input 0" in result.message


def test_second_input_named_and_module_untouched():
    def fn(a, b):
        return a * WrongCube.apply(b)

    result = check_gradients_numerically(fn, (torch.ones(3), torch.full((3,), 0.5)))
    assert result.failed_input == 1
    assert result.max_abs_error[0] < 1e-6
    layer = torch.nn.Linear(3, 2)
    assert check_gradients_numerically(layer, torch.randn(2, 3)).ok
    assert layer.weight.dtype == torch.float32
