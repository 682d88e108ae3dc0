"""The native reference for the torch numbers: torchvision ResNet-50 + plain DDP.

    mgpu-train -np 2 benchmarks/torch_native_resnet50.py --precision bf16 --out result.json

No Keras: channels_last, data resident on the GPU (one random batch reused), SGD momentum 0.9,
bf16 by autocast (or fp32). mgpu-launch is used only to start the processes and share the
rendezvous address (``MGPU_ENGINE=none``: no Keras engine); the training loop is textbook
DistributedDataParallel. Timing as in keras_resnet50.py: CUDA synchronize every ``--window``
steps, median window rate after ``--warmup-steps``, img/s summed over ranks (rank 0 writes it).
"""

import argparse
import datetime
import json
import os
import statistics
import time

os.environ.setdefault("MGPU_ENGINE", "none")

import mgpu_launch as mgpu  # noqa: E402
from mgpu_launch import runtime  # noqa: E402
from mgpu_launch.engines import rendezvous_address  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--batch-per-gpu", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    mgpu.init()
    import torch
    import torch.distributed as dist
    import torchvision

    device = torch.device("cuda", 0 if torch.cuda.device_count() == 1 else mgpu.local_rank())
    torch.cuda.set_device(device)
    if mgpu.size() > 1:
        address = rendezvous_address(runtime.state, "MGPU_TORCH_ADDRESS")
        dist.init_process_group("nccl", init_method=f"tcp://{address}", rank=mgpu.rank(),
                                world_size=mgpu.size(), device_id=device,
                                timeout=datetime.timedelta(minutes=10))
    model = torchvision.models.resnet50().to(device, memory_format=torch.channels_last)
    if mgpu.size() > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0125 * mgpu.size(), momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    images = torch.randn(args.batch_per_gpu, 3, 224, 224, device=device).to(
        memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (args.batch_per_gpu,), device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.precision == "bf16")

    stamps = []
    for step in range(args.warmup_steps + args.steps):
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = loss_fn(model(images), labels)
        loss.backward()
        optimizer.step()
        if (step + 1) % args.window == 0:
            torch.cuda.synchronize()
            stamps.append((step + 1, time.perf_counter()))
    rates = [args.window * args.batch_per_gpu / (t1 - t0)
             for (s0, t0), (_, t1) in zip(stamps, stamps[1:]) if s0 >= args.warmup_steps]
    per_rank = mgpu.allgather_object(statistics.median(rates))
    if mgpu.is_chief():
        with open(args.out, "w") as f:
            json.dump({"precision": args.precision, "gpus": mgpu.size(),
                       "img_per_sec": sum(per_rank), "per_rank_img_per_sec": per_rank,
                       "torch": torch.__version__, "device": torch.cuda.get_device_name()}, f)
        print(f"native torch {args.precision} np={mgpu.size()}: {sum(per_rank):.0f} img/s "
              f"({', '.join(f'{r:.0f}' for r in per_rank)})")
    if mgpu.size() > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
