"""Compare an exactness job's files as tests/test_exactness_matrix.py does, case by case.

    PYTHONPATH=tests python3 benchmarks/multi_gpu/check4.py DIR '<json case list>' NP

Prints one line per case: ok, or the first assertion that failed (a missing file included).
"""
import json
import pathlib
import sys

import test_exactness_matrix as matrix

directory, cases, np_ = pathlib.Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
failed = 0
for case in cases:
    try:
        matrix.check_case(directory, case, np_)
        print(f"{case}: ok")
    except (AssertionError, OSError) as error:
        failed += 1
        print(f"{case}: FAILED {' '.join(str(error).split())[:300] or type(error).__name__}")
print(f"{len(cases) - failed} passed, {failed} failed")
