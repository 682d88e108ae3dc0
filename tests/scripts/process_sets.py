"""Test worker: the host collectives within process sets (4 ranks, MGPU_ENGINE=none).

Each rank writes OUT_DIR/rank.<N>.json: what the sets report, the collectives' results within
its sets, and the errors of calls that must fail. With MGPU_DYNAMIC_PROCESS_SETS=1 it also
adds and removes sets after init().
"""

import json
import os
import sys

import numpy as np
from reported import error_of

import mgpu_launch as mgpu


def value(rank):
    """Rank `rank`'s contribution (the test computes the same numbers by hand)."""
    return np.array([rank + 1.0, 10.0 * (rank + 1), -float(rank)])


def within(process_set):
    """Every collective of the runtime within `process_set` (this rank is a member)."""
    rank = mgpu.rank()
    root = process_set.ranks[-1]
    return {
        "sum": mgpu.allreduce(value(rank), op=mgpu.Sum, process_set=process_set).tolist(),
        "average": mgpu.allreduce(value(rank), process_set=process_set).tolist(),
        "max": mgpu.allreduce(rank, op=mgpu.Max, process_set=process_set),
        "gather": mgpu.allgather(np.full((rank + 1, 2), rank), process_set=process_set).tolist(),
        "broadcast": mgpu.broadcast(value(rank), root_rank=root,
                                    process_set=process_set).tolist(),
        "object": mgpu.broadcast_object({"from": rank}, root_rank=root, process_set=process_set),
        "objects": mgpu.allgather_object(rank * 100, process_set=process_set),
        "barrier": mgpu.barrier(process_set=process_set),
        "size_rank": [process_set.size(), process_set.rank(), process_set.included()],
    }


out_dir = sys.argv[1]
even, odd, first_three = mgpu.ProcessSet([2, 0]), mgpu.ProcessSet([1, 3]), mgpu.ProcessSet([0, 1, 2])
before = [even.process_set_id, even.size(), even.rank(), even.included()]
mgpu.init(process_sets=[even, odd, first_three])
rank = mgpu.rank()
mine, other = (even, odd) if rank % 2 == 0 else (odd, even)
report = {
    "before_init": before,
    "sets": [repr(s) for s in (mgpu.global_process_set, even, odd, first_three)],
    "global": [mgpu.global_process_set.size(), mgpu.global_process_set.rank(),
               mgpu.global_process_set.included()],
    "mine": within(mine),
    "first_three": within(first_three) if first_three.included() else None,
    "global_sum": mgpu.allreduce(value(rank), op=mgpu.Sum,
                                 process_set=mgpu.global_process_set).tolist(),
    "errors": {
        "outside_allreduce": error_of(lambda: mgpu.allreduce(1.0, process_set=other)),
        "outside_broadcast": error_of(lambda: mgpu.broadcast_object(1, process_set=other)),
        "outside_barrier": error_of(lambda: mgpu.barrier(process_set=other)),
        "outside_rank": error_of(other.rank),
        "root_outside": error_of(lambda: mgpu.broadcast(1.0, root_rank=other.ranks[0],
                                                        process_set=mine)),
        "not_registered": error_of(lambda: mgpu.allreduce(1.0, process_set=mgpu.ProcessSet([0]))),
        "not_a_set": error_of(lambda: mgpu.allreduce(1.0, process_set=[0, 2])),
        "late_init": error_of(lambda: mgpu.init(process_sets=[mgpu.ProcessSet([0, 3])])),
        "bad_ranks": error_of(lambda: mgpu.ProcessSet([0, 0])),
    },
}
report["errors"]["mismatch"] = error_of(
    lambda: mgpu.allreduce(np.zeros(rank + 1), process_set=mine))
if os.environ.get("MGPU_DYNAMIC_PROCESS_SETS") != "1":
    report["errors"]["add_static"] = error_of(lambda: mgpu.add_process_set([0, 1]))
    report["errors"]["remove_static"] = error_of(lambda: mgpu.remove_process_set(even))
else:
    added = mgpu.add_process_set([3, 1, 0])
    dynamic = {"added": repr(added),
               "within": within(added) if added.included() else None,
               "duplicate": error_of(lambda: mgpu.add_process_set([1, 3])),
               "same_as_global": error_of(lambda: mgpu.add_process_set([0, 1, 2, 3])),
               "mismatch": error_of(lambda: mgpu.add_process_set([0, 1] if rank else [0, 2])),
               "removed": mgpu.remove_process_set(added)}
    dynamic["after_remove"] = [added.process_set_id, added.size(),
                               error_of(lambda: mgpu.allreduce(1.0, process_set=added))]
    dynamic["removed_twice"] = mgpu.remove_process_set(added)
    dynamic["remove_global"] = mgpu.remove_process_set(mgpu.global_process_set)
    again = mgpu.add_process_set(mgpu.ProcessSet([0, 1, 3]))
    dynamic["again"] = [again.process_set_id, again.ranks]
    dynamic["still_even"] = mgpu.allreduce(rank, op=mgpu.Sum, process_set=mine)
    report["dynamic"] = dynamic
mgpu.barrier()
with open(os.path.join(out_dir, f"rank.{rank}.json"), "w") as f:
    json.dump(report, f)
