"""A torchrun-style DDP script, in the flow of pytorch/examples'
distributed/ddp-tutorial-series/multigpu_torchrun.py, on CPU (gloo).

``init_process_group`` from the environment (env://: MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE), ``LOCAL_RANK`` read as the tutorial does, the model wrapped in
``DistributedDataParallel``, a toy data set of random (20 -> 1) pairs through a
``DistributedSampler``, a snapshot written by local rank 0 every ``save_every`` epochs and
loaded again when it exists at the start (the tutorial's resume).

Usage: ddp_torchrun.py OUT_DIR TOTAL_EPOCHS SAVE_EVERY [--batch-size N]
Writes OUT_DIR/rank.N.json: the torchrun variables this process saw, its losses, the sample
indices of its last epoch, and a checksum of its weights.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "MASTER_ADDR", "MASTER_PORT")


class ToyData(Dataset):
    def __init__(self, size):
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(size, 20, generator=generator)
        self.targets = self.inputs @ torch.randn(20, 1, generator=generator)

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, index):
        return self.inputs[index], self.targets[index], index


def main(out_dir, total_epochs, save_every, batch_size):
    dist.init_process_group(backend="gloo")  # the tutorial's nccl, on CPU
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.manual_seed(dist.get_rank())  # different starting weights: DDP must broadcast rank 0's
    model = torch.nn.Linear(20, 1)
    snapshot_path = os.path.join(out_dir, "snapshot.pt")
    epochs_run = 0
    if os.path.exists(snapshot_path):
        snapshot = torch.load(snapshot_path)
        model.load_state_dict(snapshot["MODEL_STATE"])
        epochs_run = snapshot["EPOCHS_RUN"] + 1
    model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = ToyData(256)
    loader = DataLoader(data, batch_size=batch_size, shuffle=False,
                        sampler=DistributedSampler(data))
    losses, seen = [], []  # seen: the sample indices of the last epoch
    for epoch in range(epochs_run, total_epochs):
        loader.sampler.set_epoch(epoch)
        total, seen = 0.0, []
        for source, targets, index in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(source), targets)
            loss.backward()
            optimizer.step()
            total += loss.item()
            seen += index.tolist()
        losses.append(total / len(loader))
        if local_rank == 0 and epoch % save_every == 0:
            torch.save({"MODEL_STATE": model.module.state_dict(), "EPOCHS_RUN": epoch},
                       snapshot_path)
    weights = [p.detach().double().sum().item() for p in model.module.parameters()]
    report = {"env": {name: os.environ.get(name) for name in TORCHRUN},
              "rank": dist.get_rank(), "size": dist.get_world_size(), "losses": losses,
              "seen": seen, "weights": weights, "epochs_run": epochs_run}
    with open(os.path.join(out_dir, f"rank.{dist.get_rank()}.json"), "w") as f:
        json.dump(report, f)
    print(f"rank {dist.get_rank()} losses {losses}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a torchrun-style DDP job on CPU")
    parser.add_argument("out_dir")
    parser.add_argument("total_epochs", type=int)
    parser.add_argument("save_every", type=int)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    main(args.out_dir, args.total_epochs, args.save_every, args.batch_size)
