"""Single-process losses of train_script.py on the same global batches."""

import torch

from launch.train_script import global_batch, make_model


def reference_losses(world: int, steps: int) -> list[float]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = []
    for step in range(steps):
        x, y = global_batch(step, world)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out
