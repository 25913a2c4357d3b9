"""A plain torch.optim loop that imports neither Accelerate nor diffusion-debug: what `launch`
watches through torch's optimizer step hook (run by test_launch.py). Rank 0 writes a NaN into
the last layer's weight gradient at step 3."""

import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(6):
    x = torch.randn(4, 8)
    loss = torch.nn.functional.mse_loss(model(x), x)
    loss.backward()
    if step == 3:
        model[2].weight.grad[0, 0] = float("nan")
    opt.step()
    opt.zero_grad()
print("done")
