"""One rank of mgpu-bench's native rows: the model in plain torch, + DistributedDataParallel.

    MGPU_ENGINE=none mgpu-train -np 2 -m mgpu_launch.bench.native --result r.json \\
        --model gpt2-small-lm --precision mixed_bfloat16 [--compile]

No Keras: what the hardware does with a textbook torch loop, for every mgpu-bench model (the
models: ``native_models.py``). ``--compile`` (the ``native+compile`` row) runs
``torch.compile`` of the whole step (zero_grad, forward, loss, backward, optimizer step; torch
splits it where it must, e.g. at backward); without it the step is eager (``native``). One
random batch resident on the device (a GPU when there is one, else the CPU), DDP at 2+
processes (NCCL on GPUs, gloo on CPU). Optimizer as the Keras rows': SGD momentum 0.9 for the
image and vector models, AdamW (weight decay 0.01; fused on GPUs) for the transformers. The
Keras policy names map to autocast (bfloat16 / float16 with a GradScaler) or plain float32.
``--data-format channels_last`` (the default) keeps image models and batches in
``torch.channels_last`` memory, ``channels_first`` in contiguous NCHW; torch's logical shape is
NCHW either way. mgpu-launch only starts the processes and shares the rendezvous address.
Timing and the result file are the Keras worker's (``worker.py``); ``first_step_s`` is the
first step's wall time, compilation included, synchronized; ``warmup_s`` the wall time to the
end of the last step in which ``torch.compile`` compiled a graph (dynamo's graph count rose:
a recompile at a later step counts), ``ready_step`` that step's number; eager: the first step.
"""

import datetime
import json
import platform
import statistics
import time

import mgpu_launch as mgpu
from mgpu_launch import runtime
from mgpu_launch.bench import native_models
from mgpu_launch.bench.clock import waits
from mgpu_launch.bench.models import MODELS
from mgpu_launch.bench.worker import parse_args, progress, throughput_fields
from mgpu_launch.runtime import folders
from mgpu_launch.runtime.rendezvous import rendezvous


def main(argv=None) -> None:
    args = parse_args(argv)
    mgpu.init()
    import torch
    import torch.distributed as dist

    spec = MODELS[args.model]
    batch = args.batch_per_gpu or spec.batch_per_gpu
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", 0 if torch.cuda.device_count() == 1 else mgpu.local_rank())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if mgpu.size() > 1:
        with rendezvous(runtime.state, "MGPU_TORCH_ADDRESS") as address:
            dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{address}",
                                    rank=mgpu.rank(), world_size=mgpu.size(),
                                    device_id=device if cuda else None,
                                    timeout=datetime.timedelta(minutes=10))
    layout = {"channels_last": torch.channels_last,
              "channels_first": torch.contiguous_format}[args.data_format]
    torch.manual_seed(mgpu.rank())
    model, make_batch = native_models.build(args.model)
    model = model.to(device)
    if len(spec.input_shape) == 3:
        model = model.to(memory_format=layout)
    params = native_models.parameters(model)
    if mgpu.size() > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if cuda else None)
    if spec.transformer is not None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4 * mgpu.size(),
                                      weight_decay=0.01, fused=cuda)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0125 * mgpu.size(), momentum=0.9)
    inputs, labels = make_batch(batch, device, layout)
    half = {"mixed_bfloat16": torch.bfloat16, "mixed_float16": torch.float16}.get(args.precision)
    scaler = torch.amp.GradScaler(device.type, enabled=half is torch.float16)

    def train_step(inputs, labels):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=half or torch.float32, enabled=half is not None):
            loss = native_models.loss(model(inputs), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss.detach()

    step = torch.compile(train_step) if args.compile else train_step
    total = args.warmup_steps + args.steps
    mode = "torch.compile of the step" if args.compile else "eager"
    progress(f"native {args.model} ({params / 1e6:.2f}M parameters) {args.precision} "
             f"{args.data_format}, {mode}, on {device.type}: {total} steps")

    def synchronize():
        if cuda:
            torch.cuda.synchronize()

    def graphs_compiled() -> int:  # dynamo's count of graphs it compiled (recompiles too)
        from torch._dynamo.utils import counters
        return counters["stats"]["unique_graphs"]

    stamps = []
    compiled_before = graphs_compiled()
    started = time.perf_counter()
    for number in range(total):
        step(inputs, labels)
        compiled_now = graphs_compiled()
        if number == 0 or compiled_now != compiled_before:  # a step that compiled: waited for
            synchronize()
            warmup, ready_step = time.perf_counter() - started, number + 1
            compiled_before = compiled_now
        if number == 0:
            first_step = warmup
            progress(f"native: first step {first_step:.1f} s")
        done = number + 1 - args.warmup_steps
        if done >= 0 and done % args.window == 0:
            synchronize()
            stamps.append(time.perf_counter())
    per_rank = mgpu.allgather_object(statistics.median(
        args.window * batch / (t1 - t0) for t0, t1 in zip(stamps, stamps[1:])))
    row = {"model": args.model, "data": "device", "prefetch": None, "batch_per_gpu": batch,
           "data_format": args.data_format, "params": params, "compiled": bool(args.compile),
           "step_path": "compiled" if args.compile else "eager", "step_fallback": None,
           "img_per_sec": round(sum(per_rank), 1),
           "per_rank_img_per_sec": [round(r, 1) for r in per_rank],
           **waits(first_step, warmup, ready_step, mgpu.allgather_object),
           "step_ms": round(1000 * batch * len(per_rank) / sum(per_rank), 2)}
    row.update(throughput_fields(spec, sum(per_rank)))
    progress(f"native: {row['rate']:.0f} {row['unit']}")
    if mgpu.is_chief():
        versions = {"python": platform.python_version(), "torch": torch.__version__}
        try:
            import torchvision
            versions["torchvision"] = torchvision.__version__
        except ImportError:
            pass
        folders.replace_file(args.result, json.dumps(
            {"rows": [row], "versions": versions,
             "device": torch.cuda.get_device_name() if cuda else "cpu"}).encode())
    if mgpu.size() > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
