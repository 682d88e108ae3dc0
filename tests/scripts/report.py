"""Test worker: each rank writes OUT_DIR/rank.<N>.json with its placement and collective results."""

import json
import os
import socket
import sys

import numpy as np

import mgpu_launch as mgpu

out_dir = sys.argv[1]
mgpu.init()
rank = mgpu.rank()
result = {
    "argv": sys.argv[1:], "host": socket.gethostname(), "name": __name__, "rank": rank, "size": mgpu.size(),
    "local_rank": mgpu.local_rank(), "local_size": mgpu.local_size(),
    "cross_rank": mgpu.cross_rank(), "cross_size": mgpu.cross_size(), "chief": mgpu.is_chief(),
    "env": {k: v for k, v in os.environ.items() if k.startswith("MGPU_")},
    "average": mgpu.allreduce(float(rank + 1)),
    "sum": mgpu.allreduce(np.arange(3, dtype=np.int64) * (rank + 1), op=mgpu.Sum).tolist(),
    "max": mgpu.allreduce(rank, op=mgpu.Max),
    "gather": mgpu.allgather(np.full((rank + 1, 2), rank, dtype=np.float32)).tolist(),
    "broadcast": mgpu.broadcast(np.full(4, rank * 10, dtype=np.int32), root_rank=mgpu.size() - 1).tolist(),
    "object": mgpu.broadcast_object({"from": rank, "tag": "x" * rank}, root_rank=0),
}
try:
    mgpu.allreduce(np.zeros(rank + 1))
    result["mismatch"] = None
except mgpu.MismatchError as error:
    result["mismatch"] = str(error)
mgpu.barrier()
with open(os.path.join(out_dir, f"rank.{rank}.json"), "w") as f:
    json.dump(result, f)
print(f"rank {rank} done")
