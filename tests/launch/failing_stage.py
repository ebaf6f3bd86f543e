"""A pipeline whose stage raises on one rank: `partita run -n 4 failing_stage.py CASE DIR` (2 stages x 2 replicas).

In the third step rank 3's rows hold an id out of the model's embedding's range (CASE "tag": the stage holding the
embedding raises torch's IndexError in its forward) or a label out of the loss's classes (CASE "label": the last
stage raises in the loss, and owes the stage before it the gradients of its backward). Errors are not caught,
except under CASE "goes_on" ("tag"'s failure), where rank 1 catches it and calls the model again, and
"data_parallel_goes_on", where a one-stage plan (DDP) runs "tag" and rank 3 catches its own error and goes on; CASE
"sharded" is "tag" under sharding="parameters". The test reads what each rank printed, and the time of the failing step that rank 3 writes to DIR/failing.
"""

import os
import sys
import time

import torch
from torch import nn

import partita

CASE, DIR = sys.argv[1], sys.argv[2]


class Tagged(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        self.tags = nn.Embedding(4, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x, tag):
        return self.head(torch.relu(self.body(x) + self.tags(tag)))


def main() -> None:
    partita.init()
    rank = partita.get_rank()
    net = Tagged()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    layout = dict(stages=1) if CASE == "data_parallel_goes_on" else dict(stages=2, replicas=2, micro_batches=2)
    if CASE == "sharded":  # FSDP gathers and sums the stages' parameters over their replicas inside their compute
        layout["sharding"] = "parameters"
    model = partita.parallelize(net, opt, loss_fn=nn.CrossEntropyLoss(), **layout)
    g = torch.Generator().manual_seed(rank)
    for step in range(5):
        x, y = torch.randn(4, 8, generator=g), torch.randint(4, (4,), generator=g)
        tag = torch.zeros(4, dtype=torch.long)
        if step == 2 and rank == 3:
            open(os.path.join(DIR, "failing"), "w").write(str(time.time()))
            if CASE == "label":
                y[1] = 9  # out of the 4 classes
            else:
                tag[1] = 7  # out of the embedding's 4 rows
        try:
            loss = model(x, tag, y)
        except Exception:  # noqa: BLE001 - the model's own, or partita's
            if (CASE, rank) not in (("goes_on", 1), ("data_parallel_goes_on", 3)) or step != 2:
                raise
            print(f"rank {rank} caught the error and goes on", flush=True)
            continue
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    partita.shutdown()


if __name__ == "__main__":
    main()
