"""Draw a few steps of an mgpu-launch timeline file as a PNG (for docs; needs matplotlib).

    python3 scripts/trace_png.py TIMELINE.json OUT.png [--steps 10-13]

One row per rank's training thread; a phase is a bar coloured by its category (step,
callbacks, input, other), a slice nested in a phase (a host collective, the input wait) a
thinner bar inside it. Perfetto (ui.perfetto.dev) shows the same file interactively.
"""

import argparse
import json
import sys

COLOURS = {"step": "#4c72b0", "callbacks": "#dd8452", "input": "#55a868", "other": "#8c8c8c",
           "collective": "#c44e52"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("out")
    parser.add_argument("--steps", default="10-13", help="first-last step to draw (default 10-13)")
    args = parser.parse_args(argv)
    try:
        first, last = (int(part) for part in args.steps.split("-"))
    except ValueError:
        parser.error(f"--steps {args.steps!r}: expected FIRST-LAST, e.g. 10-13")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.trace) as file:
        events = [e for e in json.load(file)["traceEvents"]
                  if e.get("ph") == "X" and e.get("tid") == 0
                  and first <= e.get("args", {}).get("step", -1) <= last]
    if not events:
        print(f"{args.trace}: no slices of steps {first}-{last} on a training thread",
              file=sys.stderr)
        return 1
    start = min(e["ts"] for e in events)
    ranks = sorted({e["pid"] for e in events})
    figure, axes = plt.subplots(figsize=(11, 1.4 + 0.7 * len(ranks)))
    for row, rank in enumerate(ranks):
        mine = sorted((e for e in events if e["pid"] == rank), key=lambda e: e["ts"])
        ends = []  # ends of the enclosing slices: depth = how many still contain this one
        for event in mine:
            while ends and ends[-1] <= event["ts"]:
                ends.pop()
            depth = len(ends)
            height = 0.6 / (1 + depth)
            axes.broken_barh([((event["ts"] - start) / 1e3, event["dur"] / 1e3)],
                             (row - height / 2, height),
                             facecolors=COLOURS.get(event["cat"], "#bbbbbb"),
                             edgecolors="white", linewidth=0.3)
            ends.append(event["ts"] + event["dur"])
    axes.set_yticks(range(len(ranks)), [f"rank {rank}" for rank in ranks])
    axes.invert_yaxis()
    axes.set_xlabel("ms")
    axes.set_title(f"{args.trace.rsplit('/', 1)[-1]}: steps {first}-{last}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour) for colour in COLOURS.values()]
    axes.legend(handles, list(COLOURS), loc="upper center", bbox_to_anchor=(0.5, -0.3),
                ncol=len(COLOURS), fontsize=8, frameon=False)
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    print(f"{args.out}: {len(events)} slices of {len(ranks)} ranks, steps {first}-{last}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
