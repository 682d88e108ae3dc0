"""One rank of mgpu-bench's native reference: torchvision ResNet-50 + DistributedDataParallel.

    MGPU_ENGINE=none mgpu-train -np 2 -m mgpu_launch.bench.native --result r.json \\
        --precision mixed_bfloat16

No Keras: what the GPUs do with a textbook torch loop. ``--data-format channels_last`` (the
default) keeps the model and the batch in ``torch.channels_last`` memory format (NHWC in memory),
``channels_first`` in contiguous NCHW; torch's logical shape is NCHW either way. One random batch
resident on the device, SGD momentum 0.9; the Keras policy names map to autocast (bfloat16 / float16
with a GradScaler) or plain float32. mgpu-launch only starts the processes and shares the
rendezvous address. Timing and the result file are the Keras worker's (``worker.py``).
"""

import datetime
import json
import platform
import statistics
import time

import mgpu_launch as mgpu
from mgpu_launch import runtime
from mgpu_launch.bench.worker import parse_args, progress
from mgpu_launch.runtime import folders
from mgpu_launch.runtime.rendezvous import rendezvous


def main(argv=None) -> None:
    args = parse_args(argv)
    mgpu.init()
    import torch
    import torch.distributed as dist
    import torchvision

    batch = args.batch_per_gpu or 128
    device = torch.device("cuda", 0 if torch.cuda.device_count() == 1 else mgpu.local_rank())
    torch.cuda.set_device(device)
    if mgpu.size() > 1:
        with rendezvous(runtime.state, "MGPU_TORCH_ADDRESS") as address:
            dist.init_process_group("nccl", init_method=f"tcp://{address}", rank=mgpu.rank(),
                                    world_size=mgpu.size(), device_id=device,
                                    timeout=datetime.timedelta(minutes=10))
    layout = {"channels_last": torch.channels_last,
              "channels_first": torch.contiguous_format}[args.data_format]
    model = torchvision.models.resnet50().to(device, memory_format=layout)
    if mgpu.size() > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0125 * mgpu.size(), momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    images = torch.randn(batch, 3, 224, 224, device=device).to(memory_format=layout)
    labels = torch.randint(0, 1000, (batch,), device=device)
    half = {"mixed_bfloat16": torch.bfloat16, "mixed_float16": torch.float16}.get(args.precision)
    scaler = torch.amp.GradScaler("cuda", enabled=half is torch.float16)
    total = args.warmup_steps + args.steps
    progress(f"native torchvision resnet50 {args.precision} {args.data_format}: {total} steps")

    stamps = []
    for step in range(total):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=half or torch.float32, enabled=half is not None):
            loss = loss_fn(model(images), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        done = step + 1 - args.warmup_steps
        if done >= 0 and done % args.window == 0:
            torch.cuda.synchronize()
            stamps.append(time.perf_counter())
    per_rank = mgpu.allgather_object(statistics.median(
        args.window * batch / (t1 - t0) for t0, t1 in zip(stamps, stamps[1:])))
    progress(f"native: {sum(per_rank):.0f} img/s")
    if mgpu.is_chief():
        row = {"model": "resnet50", "data": "device", "prefetch": None, "batch_per_gpu": batch,
               "data_format": args.data_format,
               "params": sum(p.numel() for p in model.parameters()),
               "img_per_sec": round(sum(per_rank), 1),
               "per_rank_img_per_sec": [round(r, 1) for r in per_rank]}
        folders.replace_file(args.result, json.dumps(
            {"rows": [row], "device": torch.cuda.get_device_name(),
             "versions": {"python": platform.python_version(), "torch": torch.__version__,
                          "torchvision": torchvision.__version__}}).encode())
    if mgpu.size() > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
