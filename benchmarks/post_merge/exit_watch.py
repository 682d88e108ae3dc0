"""Run a script as ``__main__``; 30 s after it returns, if the process is still alive (a hang in
an atexit hook such as ``destroy_process_group``), print every thread's stack and exit 1.

    mgpu-train -np 2 benchmarks/post_merge/exit_watch.py SCRIPT [ARGS...]
"""

import faulthandler
import runpy
import sys

script = sys.argv[1]
sys.argv = sys.argv[1:]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    faulthandler.dump_traceback_later(30, exit=True)
