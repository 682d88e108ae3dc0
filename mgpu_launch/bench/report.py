"""mgpu-bench's outputs: scaling figures, the console table, JSON, markdown and the plot."""

import io
import json
import os
from typing import Dict, List, Tuple

from mgpu_launch.bench import names
from mgpu_launch.runtime import folders

SERIES = ("backend", "model", "precision", "data_format", "data", "prefetch", "batch_per_gpu",
          "variant")


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def series_of(row: dict) -> Tuple:
    return tuple(row.get(key) for key in SERIES)


def label_of(key: Tuple) -> str:
    backend, model, precision, data_format, data, prefetch, batch, variant = key
    feed = "device-resident" if data == "device" and backend != "mirrored" else (
        f"{data}, prefetch {prefetch}" if prefetch is not None else data)
    feed += f", {variant}" if variant else ""  # --recorder, --steps-per-execution
    name = names.display(backend)
    layout = f" {data_format}" if data_format else ""  # rows of older results have none
    return f"{name} {model} {precision}{layout} ({feed}, batch {batch}/GPU)"


def rate_of(row: dict) -> Tuple[float, str]:
    """(the row's throughput, its unit): ``rate`` in ``unit``; rows of results older than the
    units give their img/s."""
    return row.get("rate", row["img_per_sec"]), row.get("unit", "img/s")


def rate_words(row: dict) -> str:
    """The row's throughput for the console: "812345 tokens/s (3173 sequences/s)"."""
    rate, unit = rate_of(row)
    if unit == "tokens/s":
        return f"{rate:.0f} tokens/s ({row['img_per_sec']:.0f} sequences/s)"
    return f"{rate:.0f} {unit}"


def _seconds(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if value < 10 else f"{value:.0f}"


def add_scaling(rows: List[dict]) -> None:
    """Set speedup = img/s(N) / img/s(1) and efficiency = speedup / N, per series, in place.

    Without a 1-process row in the series both are None (never from another invocation).
    """
    single = {series_of(r): r["img_per_sec"] for r in rows if r["gpus"] == 1}
    for row in rows:
        base = single.get(series_of(row))
        row["speedup"] = round(row["img_per_sec"] / base, 3) if base else None
        row["efficiency"] = round(row["speedup"] / row["gpus"], 4) if base else None


def _grouped(rows: List[dict]) -> Dict[Tuple, List[dict]]:
    groups: Dict[Tuple, List[dict]] = {}
    for row in rows:
        groups.setdefault(series_of(row), []).append(row)
    return groups


def console_table(rows: List[dict]) -> str:
    """One block per series, the seed study's columns: gpus | rate (img/s, tokens/s, ...) |
    speedup | efficiency, and the first step's seconds."""
    blocks = []
    for key, members in _grouped(rows).items():
        unit = rate_of(members[0])[1]
        lines = [label_of(key), f"  gpus | {unit:>11} | speedup | efficiency | first step s "
                                f"| warm-up s | step path",
                 "  -----+-------------+---------+------------+--------------+-----------+-"
                 "----------"]
        for r in sorted(members, key=lambda r: r["gpus"]):
            speedup = f"{r['speedup']:7.2f}" if r["speedup"] is not None else "      -"
            eff = f"{100 * r['efficiency']:9.1f}%" if r["efficiency"] is not None else "         -"
            lines.append(f"  {r['gpus']:4d} | {rate_of(r)[0]:11.1f} | {speedup} | {eff}  | "
                         f"{_seconds(r.get('first_step_s')):>12} | "
                         f"{_seconds(r.get('warmup_s')):>9} | {r.get('step_path') or '-'}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) if blocks else "(no results)"


def markdown(header: dict, rows: List[dict]) -> str:
    lines = [f"# mgpu-bench results, {header.get('date', '')}", ""]
    lines += [f"- {key}: `{value}`" if key == "command" else f"- {key}: {value}"
              for key, value in header.items()]
    lines += ["", "Rate: in the row's unit (tokens/s for the transformers, whose samples are "
                  "sequences); samples/s per rank; first step: its wall time in seconds, "
                  "compilation included; warm-up: seconds from the start of the first step to "
                  "the end of the first one that ran the row's step path as every later step "
                  "(tracing, compiling, capturing done; the torch engine compiles at the second "
                  "step); step path: what the step ran as (eager, graph, compiled, cuda_graph, "
                  "compiled+cuda_graph), a fallback included (mgpu_launch/bench/clock.py).", ""]
    lines += ["| backend | model | precision | data format | data | prefetch | variant | "
              "batch/GPU | gpus | rate | unit | samples/s | per rank | speedup | efficiency | "
              "first step s | warm-up s | step path |", "|" + "---|" * 18]
    for r in rows:
        eff = f"{100 * r['efficiency']:.1f}%" if r["efficiency"] is not None else "-"
        speedup = f"{r['speedup']:.2f}" if r["speedup"] is not None else "-"
        per_rank = ", ".join(f"{x:.0f}" for x in r["per_rank_img_per_sec"])
        prefetch = "-" if r["prefetch"] is None else r["prefetch"]
        rate, unit = rate_of(r)
        lines.append(f"| {r['backend']} | {r['model']} | {r['precision']} | "
                     f"{r.get('data_format', '-')} | {r['data']} | "
                     f"{prefetch} | {r.get('variant') or '-'} | {r['batch_per_gpu']} | "
                     f"{r['gpus']} | {rate:.0f} | {unit} | {r['img_per_sec']:.0f} | "
                     f"{per_rank} | {speedup} | {eff} | {_seconds(r.get('first_step_s'))} | "
                     f"{_seconds(r.get('warmup_s'))} | {r.get('step_path') or '-'} |")
    return "\n".join(lines + wait_table(rows) + profile_table(rows)) + "\n"


def wait_table(rows: List[dict]) -> List[str]:
    """Markdown lines: each row's warm-up against ``native+compile``'s of the same model,
    precision, data format and GPU count (issue 63: within 2x); none without such a row."""
    def key(row):
        return row["model"], row.get("precision"), row.get("data_format"), row["gpus"]
    native = {key(r): r["warmup_s"] for r in rows
              if r.get("backend") == "native+compile" and r.get("warmup_s")}
    paired = [r for r in rows if key(r) in native and r.get("backend") != "native+compile"
              and r.get("warmup_s") is not None]
    if not paired:
        return []
    lines = ["", "Warm-up against native torch.compile's (same model, precision, data format "
                 "and GPUs):", "", "| backend | model | precision | data | variant | gpus | "
                 "step path | warm-up s | native+compile s | ratio |", "|" + "---|" * 10]
    for r in paired:
        theirs = native[key(r)]
        lines.append(f"| {r['backend']} | {r['model']} | {r['precision']} | {r['data']} | "
                     f"{r.get('variant') or '-'} | {r['gpus']} | {r.get('step_path') or '-'} | "
                     f"{_seconds(r['warmup_s'])} | {_seconds(theirs)} | "
                     f"{r['warmup_s'] / theirs:.3g}x |")
    return lines


PROFILE_COLUMNS = ("input_ms", "wait_ms", "step_ms", "compute_ms", "comm_ms")


def profile_table(rows: List[dict]) -> List[str]:
    """Markdown lines of ``--profile``'s per-rank breakdown (none without profiled rows)."""
    profiled = [r for r in rows if r.get("per_rank_profile")]
    if not profiled:
        return []
    lines = ["", "Where the step time goes (`--profile`: every step waited for; medians, ms; "
             "see mgpu_launch/bench/profile.py):", "",
             "| backend | precision | data format | data | variant | gpus | rank | "
             + " | ".join(PROFILE_COLUMNS) + " |", "|" + "---|" * (7 + len(PROFILE_COLUMNS))]
    for r in profiled:
        for rank, p in enumerate(r["per_rank_profile"]):
            values = " | ".join(str(p.get(c, "-")) for c in PROFILE_COLUMNS)
            lines.append(f"| {r['backend']} | {r['precision']} | {r.get('data_format', '-')} | "
                         f"{r['data']} | {r.get('variant') or '-'} | {r['gpus']} | {rank} | "
                         f"{values} |")
    return lines


def plot(path, rows: List[dict], title: str) -> None:
    """Speedup and efficiency vs process count, one line per series, against the ideal."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scaled = [r for r in rows if r["speedup"] is not None]
    counts = sorted({r["gpus"] for r in rows}) or [1]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    left.plot(counts, counts, "k--", label="ideal")
    right.plot(counts, [100] * len(counts), "k--", label="ideal")
    for key, members in _grouped(scaled).items():
        members = sorted(members, key=lambda r: r["gpus"])
        gpus = [r["gpus"] for r in members]
        left.plot(gpus, [r["speedup"] for r in members], "o-", label=label_of(key))
        right.plot(gpus, [100 * r["efficiency"] for r in members], "o-", label=label_of(key))
    for axis, name in ((left, "speedup (x)"), (right, "scaling efficiency (%)")):
        axis.set_xlabel("GPUs (processes)")
        axis.set_ylabel(name)
        axis.set_xticks(counts)
        axis.grid(alpha=0.3)
    right.set_ylim(min([50] + [100 * r["efficiency"] - 5 for r in scaled]), 105)
    right.legend(fontsize=7, loc="lower left")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110, format="png")
    plt.close(figure)


def _devices(header: dict) -> str:
    names = header.get("gpus")
    if not names:
        return str(header.get("mode", ""))
    return ", ".join(f"{names.count(name)}x {name}" for name in dict.fromkeys(names))


def write(out: str, header: dict, rows: List[dict], with_plot: bool = True) -> List[str]:
    """results.json, results.md and results.png under `out`; returns the paths written."""
    paths = [os.path.join(out, name) for name in ("results.json", "results.md", "results.png")]
    # Each file whole and at once (a private new file renamed over the old one): a crash
    # leaves the old results, never a truncated file, and nothing is written through a link.
    folders.replace_file(paths[0], json.dumps({"header": header, "rows": rows},
                                              indent=1).encode())
    folders.replace_file(paths[1], markdown(header, rows).encode())
    if not with_plot:
        return paths[:2]
    try:
        image = io.BytesIO()
        plot(image, rows, f"mgpu-bench {header.get('date', '')}: {_devices(header)}")
        folders.replace_file(paths[2], image.getvalue())
    except ImportError:
        print("mgpu-bench: matplotlib is not installed, so no results.png: "
              "pip install 'mgpu-launch[bench]'")
        paths.pop()
    return paths
