"""Test worker: a Horovod elastic loop whose whole state is an ObjectState (no model).

    mgpu-train -np 2 [--max-restarts 1] hvd_object_state.py STATE_DIR OUT_DIR [FAIL_STEP]

Every rank declares the state with values of its own (run()'s sync must give every rank rank
0's). Steps state.step..9 each add the sum over ranks of (step + 1) * (rank + 1) (an
allreduce) to state.total and append the step to state.seen; state.step counts the steps done
and a commit follows every second step. After each commit the loop spoils state.total and
puts it back with state.restore(). With FAIL_STEP (0-based), rank 1 raises after that step in
the first attempt (MGPU_RESTART_COUNT 0). Writes OUT_DIR/rank.N.json: what train() started
from, the steps this attempt did, the final attributes, whether the state folder is left.
"""

import json
import os
import sys

import numpy as np

import mgpu_launch.keras as hvd  # was: import horovod.tensorflow.keras as hvd

hvd.init()
import keras  # noqa: E402

state_dir, out = sys.argv[1], sys.argv[2]
fail = int(sys.argv[3]) if len(sys.argv) > 3 else None
if os.environ.get("MGPU_RESTART_COUNT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) != "0":
    fail = None  # the restart: the fault happened already
STEPS = 10
done, started = [], {}


@hvd.elastic.run
def train(state):
    started.update(step=state.step, note=state.note, total=state.total)
    for step in range(state.step, STEPS):
        mine = np.array([(step + 1) * (hvd.rank() + 1)], "float64")
        state.total += float(keras.ops.convert_to_numpy(hvd.allreduce(mine, op=hvd.Sum))[0])
        state.seen.append(step)
        done.append(step)
        if step == fail and hvd.rank() == 1:
            raise RuntimeError(f"injected fault after step {step}")
        state.step = step + 1
        if state.step % 2 == 0:
            state.commit()
            kept = state.total
            state.total = -1.0
            state.restore()
            assert state.total == kept, (state.total, kept)


state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, backup_dir=state_dir, step=0,
                                total=0.0, seen=[], note=f"rank {hvd.rank()}")
train(state)
with open(os.path.join(out, f"rank.{hvd.rank()}.json"), "w") as f:
    json.dump({"started": started, "done": done, "step": state.step, "total": state.total,
               "seen": state.seen, "note": state.note,
               "state_dir_left": os.path.exists(state_dir)}, f)
