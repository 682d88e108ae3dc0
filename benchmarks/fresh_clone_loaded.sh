#!/bin/bash
# Started as: rm -rf /tmp/fresh /tmp/fresh-venv; git clone -q <repo> /tmp/fresh;
#             (nohup benchmarks/fresh_clone_loaded.sh > log 2>&1 &)   (SIGINT then ignored, as for any
#             job started with & from a script)
# Issue 53: a fresh clone and a fresh venv, command 1 then command 2 of the README, timed, with a
# CPU hog beside them (the box: 2 cores; other work runs too).
cd /tmp/fresh
python3 -c "while True: pass" & hog=$!
echo "hog pid $hog; load: $(cat /proc/loadavg)"
python3 -m venv /tmp/fresh-venv && . /tmp/fresh-venv/bin/activate
start=$SECONDS
python3 -m pip install -q ".[tensorflow-cpu]" scikit-learn && mgpu-train -np 2 examples/keras_digits.py
echo "=== command 1: exit $? after $((SECONDS - start)) s; load: $(cat /proc/loadavg)"
start=$SECONDS
scripts/test.sh
echo "=== command 2: exit $? after $((SECONDS - start)) s; load: $(cat /proc/loadavg)"
kill $hog
