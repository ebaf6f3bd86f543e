"""One process's losses for train_script.py: what every launched job must reproduce."""

import torch

from launch.train_script import global_batch, make_model, make_optimizer


def reference_losses(steps: int) -> list[float]:
    model = make_model()
    opt = make_optimizer(model)
    out = []
    for step in range(steps):
        x, y = global_batch(step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out
