"""Test worker: rank `fail_rank` fails in the way asked while the others wait in a collective.

    fail.py raise|exit|signal RANK [TIME_FILE]   TIME_FILE: gets time.time() just before failing
    fail.py hang RANK PID_PREFIX                 every rank writes PID_PREFIX.<rank>, then sleeps
"""

import os
import signal
import sys
import time

import mgpu_launch as mgpu

how, fail_rank = sys.argv[1], int(sys.argv[2])
mgpu.init()
mgpu.barrier()
if mgpu.rank() == fail_rank:
    time.sleep(0.5)
    if how != "hang" and len(sys.argv) > 3:  # when it failed, for the tests that time the end
        with open(sys.argv[3], "w") as f:
            f.write(repr(time.time()))
    if how == "raise":
        raise RuntimeError(f"boom on purpose from rank {mgpu.rank()}")
    if how == "exit":
        sys.exit(7)
    if how == "signal":
        os.kill(os.getpid(), signal.SIGKILL)
if how == "hang":
    with open(sys.argv[3] + f".{mgpu.rank()}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
mgpu.barrier()  # the healthy ranks block here; the job must still end fast
