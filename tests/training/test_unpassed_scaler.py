"""A plain loop's ``torch.amp.GradScaler`` not given to ``monitor_training_step`` (``scaler=``): read without it, its
gradients were each its scale (65536) times too large (a gradient explosion, an lr spike as the headline) and each
step it skipped a NaN gradient error. Found in the loop at the first step, it is read as if given, and named."""

import math

import torch

from diffusion_debug import DebugConfig, TrainingDebugger


def _scaled_run(model, tmp_path, passed: bool):
    """12 steps of SGD on a GradScaler's scaled loss (init scale 65536), the gradients overflowing at steps 3 and 4
    (the scaler skips them); ``passed``: ``scaler=`` given. The debugger (closed) and each step's grad norm read."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path)))
    generator, norms = torch.Generator().manual_seed(1), []
    for step in range(12):
        x = torch.randn(8, 4, generator=generator)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        scaler.scale(loss * (math.inf if step in (3, 4) else 1.0)).backward()
        given = {"scaler": scaler} if passed else {}
        norms.append(tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, **given)["grad_norm"])
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    tdbg.close()
    return tdbg, norms


def test_a_grad_scaler_not_passed_is_found_in_the_loop_read_as_if_given_and_named(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    twin = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    twin.load_state_dict(model.state_dict())
    given, given_norms = _scaled_run(twin, tmp_path / "given", passed=True)
    found, norms = _scaled_run(model, tmp_path / "found", passed=False)
    assert norms[:3] + norms[5:] == given_norms[:3] + given_norms[5:]  # unscaled, as with scaler= given
    assert all(norms[:3]) and max(norms) < 1000  # (read scaled they were above 1e5: gradient_explosion)
    kinds = [(a.kind, a.severity, a.step) for a in found.report().anomalies]
    assert kinds == [
        ("scaler_not_passed", "info", 0),
        *[(a.kind, a.severity, a.step) for a in given.report().anomalies],
    ]
    assert kinds[1:] == [("nonfinite", "info", 3), ("skipped_step", "info", 3)]  # (read scaled: a NaN *error*)
    named = found.report().anomalies[0]
    assert named.message == (
        "A GradScaler (scale 6.554e+04) scales this loop's loss but monitor_training_step was not given it: "
        "read without it, every gradient norm is that many times too large and every step it skips is a NaN "
        "gradient error. It was found in the loop and is read as given; pass scaler=scaler."
    )
