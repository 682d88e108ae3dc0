"""Where the host's time goes in a TensorFlow profiler trace (issue 38).

    python3 benchmarks/tf_gpu/trace_summary.py TRACE.json.gz [--threads 6] [--top 12]

Reads the Chrome trace that benchmarks/tf_gpu/experiments (TFX_HOSTPROF) converts from
TensorFlow's xplane ("trace_viewer@" tool) and prints, for the host threads with the most
traced time, the event names with the most time: count, total and mean ms, and the share of
the thread's own time that is its own (not inside a child event on the same thread), so that a
wait (a stream synchronization, a lock) shows as the leaf it is.
"""

import argparse
import collections
import gzip
import json


def _self_times(events):
    """Inclusive and self (exclusive) time of each event of one thread (nested by time)."""
    events = sorted(events, key=lambda e: (e["ts"], -e["dur"]))
    own = [e["dur"] for e in events]
    stack = []
    for index, event in enumerate(events):
        while stack and events[stack[-1]]["ts"] + events[stack[-1]]["dur"] <= event["ts"]:
            stack.pop()
        if stack:
            own[stack[-1]] -= event["dur"]
        if event["dur"] > 0:
            stack.append(index)
    return events, own


def summarize(trace, threads: int, top: int) -> str:
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    by_thread = collections.defaultdict(list)
    for event in events:
        if event.get("ph") == "X" and "dur" in event:
            by_thread[(event["pid"], event.get("tid"))].append(event)
    ranked = sorted(by_thread, key=lambda k: -sum(e["dur"] for e in by_thread[k]
                                                  if not e["name"].startswith("$")))
    lines = []
    for key in ranked[:threads]:
        ordered, own = _self_times(by_thread[key])
        total = collections.defaultdict(lambda: [0, 0.0, 0.0])
        for event, mine in zip(ordered, own):
            entry = total[event["name"]]
            entry[0] += 1
            entry[1] += event["dur"]
            entry[2] += max(mine, 0.0)
        span = max(e["ts"] + e["dur"] for e in ordered) - min(e["ts"] for e in ordered)
        lines.append(f"== {processes.get(key[0], key[0])} / {names.get(key, key[1])}: "
                     f"{len(ordered)} events over {span / 1e3:.1f} ms")
        for name, (count, inclusive, exclusive) in sorted(
                total.items(), key=lambda item: -item[1][2])[:top]:
            lines.append(f"  {exclusive / 1e3:9.2f} ms self  {inclusive / 1e3:9.2f} ms total  "
                         f"{count:5d} x {inclusive / count / 1e3:8.3f} ms  {name[:90]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--threads", type=int, default=6)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as source:
        print(summarize(json.load(source), args.threads, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
