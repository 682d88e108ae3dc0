"""The efficiency report at the end of ``fit``: why the job is not N times faster.

``fit`` of a model compiled with a DistributedOptimizer gets an
:class:`~mgpu_launch.training.efficiency_report.EfficiencyReport` callback on every rank
(``MGPU_EFFICIENCY_REPORT=0`` leaves it out; set it alike on every rank). It records the fit
with the timeline recorder (``mgpu_launch.runtime.timeline``), times the gradient allreduce
alone at its end, and rank 0 prints, when its ``verbose`` is 1 or more::

    mgpu: efficiency of fit, steps 2-60 on 2 ranks (3.1 s):
      throughput: 310 samples/s in total over the fit; per rank: 155, 155
      lost: 60% of the ranks' time
        input wait                    1%
        waiting for a slower rank    45%  rank 1, 52 ms a step behind the others (callbacks)
        communication                12%  the gradient allreduce (4.2 MB) takes 6.1 ms alone; ...
        the rest                      2%  callbacks, validation, Keras's loop
      advice: rank 1 arrives 52 ms a step after the others, in callbacks: ...

A job too small to judge gets one line instead (:func:`too_small`): its steps compute for
less time than the fixed costs every step pays (Keras's loop, validation and epoch ends, a
small allreduce's latency), which it names with their measured times. Where a median step is
much faster than the fit's average (ThroughputCallback's ``samples_per_sec`` is a median
step's), the throughput line gives both. Times print in ms or s, never in exponent notation.

This module is the analysis (pure functions of the recorded slices and the measured time);
``efficiency_report`` records, measures and prints. How each share is measured, from the
same slices the timeline file holds (so the two agree):

* **input wait**: the step waiting for its batch in the device prefetcher (``MGPU_PREFETCH``),
  plus the time between one step's end and the next step's callbacks (where JAX and torch
  read batches in Python). Without the prefetcher, TensorFlow reads its batches inside the
  compiled step: that wait then counts as the step's own time.
* **waiting for a slower rank**: every step ends in the gradient allreduce, which no rank
  leaves before the last one arrives. A rank's arrival is when it enters its train step plus
  its input wait there; the others wait ``latest arrival - their arrival``. The rank that
  arrives last the most is named, and its own extra time in callbacks and other host work
  (over the median of the others) counts here too: it is what the others waited for. A wait
  for a rank that was itself waiting for its batch counts as input wait. Limits: a rank that is slower
  *inside* the compiled step (a slower GPU) arrives on time and leaves late together with the
  others, so it is invisible here and counts as the step; and the arrivals are compared on
  clocks aligned to within half an MPI round trip (microseconds on one host).
* **communication**: the gradient allreduce itself, after the last rank arrived. Every engine
  reduces inside its compiled step, where the host cannot see it; so at the end of the fit
  every rank runs the engine's own reduction (its transport, fusion and compression) on zero
  gradients of the model's sizes, one warm-up and five timed runs, and the median is taken
  out of each step's own time (at most all of it: ``min(measured, the step's own time)``).
  An engine that reduces after the backward pass (TensorFlow; JAX on CPU) hides none of it;
  one that overlaps the two (torch's buckets, JAX on GPU) hides part, and the share is then an
  upper bound. Not measured (the line says why) in a fit of fewer than :data:`TIMED_STEPS`
  analysed steps, with the gradients reduced within a process set, or when the timing failed.
  The input restarting at an epoch boundary (the ``next`` that finds the epoch's end, the
  next epoch's first batch) is not: it is a cost of each epoch, counted with the epoch ends.
* **the rest**: callbacks (every rank's, the probes' phases), validation and epoch ends
  (with the input's restart there), and what no phase covers (Keras's loop).

What is left, the step's compute, is not lost. The first step of each fit (tracing and
compilation) is left out.
"""

import statistics
from typing import Dict, Optional, Sequence

from mgpu_launch.training import units

#: analysed steps a fit needs before the gradient allreduce is timed at its end
TIMED_STEPS = 20
_CALLBACKS = {"on_train_begin", "on_train_batch_begin", "on_train_batch_end", "on_epoch_end"}
#: phases that run once an epoch, not once a step (a fixed cost per epoch)
_EPOCH_PHASES = {"validation", "on_epoch_end"}
#: below this an allreduce costs its latency, a fixed cost per step, more than its bytes
#: (DESIGN: NCCL moves 1 MB at 23-62 GB/s of its 300; MPI on CPU ~1 ms for ~1 KB or 1 MB)
LATENCY_BYTES = 1_000_000


def _per_step(slices: Sequence[tuple]) -> Dict[int, Dict[str, float]]:
    """step -> {"begin", "ready", "input", "train", "callbacks", "other", "epoch", "restart"}
    of one rank (ns; "epoch": the part of callbacks and other that is validation and epoch
    ends; "restart": the part of the in-step input wait that is the epoch's first batch)."""
    steps: Dict[int, Dict[str, float]] = {}
    for thread, name, category, start, duration, step, parent in slices:
        if thread != 0:
            continue  # asynchronous callbacks run beside the loop, not in its time
        record = steps.setdefault(step, {"input": 0.0, "callbacks": 0.0, "other": 0.0,
                                         "train": 0.0, "in_step_input": 0.0, "epoch": 0.0,
                                         "epochs": 0})
        if name == "on_train_batch_begin" and not parent:
            record["begin"] = start
        if name == "train step":
            record["enter"], record["train"] = start, duration
        elif name == "input wait" and parent == "train step":
            record["in_step_input"] += duration
        elif parent:
            continue  # nested in a phase that is counted whole (a collective, a wait)
        elif category == "input":
            record["input"] += duration
        elif name in _CALLBACKS:
            record["callbacks"] += duration
        else:
            record["other"] += duration
        if name in _EPOCH_PHASES and not parent:
            record["epoch"] += duration
            record["epochs"] += name == "on_epoch_end"
    for step, record in steps.items():
        record["ready"] = record.get("enter", 0.0) + record["in_step_input"]
        # The input restarting at an epoch boundary: the iterator's `next` that finds the
        # epoch's end, and the next epoch's first batch. A cost of each epoch, whatever the
        # prefetch: counted with the epoch ends ("other"), not as input wait.
        record["restart"] = record["in_step_input"] if steps.get(step - 1, {}).get("epochs") \
            else 0.0
        if record["epochs"]:
            record["other"] += record["input"]
            record["epoch"] += record["input"]
            record["input"] = 0.0
    return steps


def analyse(ranks: Sequence[Sequence[tuple]], batch_size: Optional[int],
            communication: Optional[Dict] = None) -> Optional[Dict]:
    """The report's figures from every rank's slices of one fit (rank 0's clock), or None when
    fewer than three steps are common to all ranks.

    Args:
        ranks: every rank's slices of this fit (``timeline.since``), in rank order.
        batch_size: samples per step on one rank, or None.
        communication: the gradient allreduce timed alone: ``{"seconds": per step, "every":
            steps per reduction, "bytes", "overlaps": bool, "engine", "compression"}`` (as
            ``efficiency_report.time_communication`` returns it), or ``{"note": why it was
            not}``, or None (one rank).

    Returns:
        {"steps": (first, last), "seconds", "ranks": [per-rank {category: ns, "window"}],
        "shares": {category: fraction of the ranks' time; "epoch" (validation and epoch
        ends) is part of "callbacks" + "other"}, "late": (rank, ns per step, fraction
        slower, its largest category) or None, "rates": per-rank steps/s over the fit,
        "step_rates": per-rank steps/s of a median step (what ThroughputCallback reports),
        "epochs": epoch ends analysed, "batch_size", "communication"}.

    Example:
        >>> analyse(ranks, 32, {"seconds": 0.006, "bytes": 4e6, "overlaps": False,
        ...                     "engine": "tensorflow"})["shares"]["comm"]
        0.12
    """
    reduction = 1e9 * (communication or {}).get("seconds", 0.0)
    per_rank = [_per_step(slices) for slices in ranks]
    common = sorted(set.intersection(*[
        {step for step, record in steps.items() if "begin" in record and "enter" in record}
        for steps in per_rank]))
    if len(common) < 3:
        return None
    analysed, closing = common[1:-1], common[-1]  # cycles begin(k) -> begin(k+1)
    totals = []
    for steps in per_rank:
        window = steps[closing]["begin"] - steps[analysed[0]]["begin"]
        total = {name: sum(steps[k][name] for k in analysed)
                 for name in ("input", "in_step_input", "callbacks", "other", "train", "epoch",
                              "epochs", "restart")}
        cycles = [steps[b]["begin"] - steps[a]["begin"] for a, b in zip(common[1:], common[2:])]
        total.update(window=window, wait=0.0, waited=0.0, lateness=0.0, comm=0.0,
                     cycle=statistics.median(cycles))
        # what the phases cover; what they do not (Keras's loop between them) is "other"
        total["other"] += max(0.0, window - total["input"] - total["callbacks"] -
                              total["other"] - total["train"])
        total["input"] += total["in_step_input"] - total["restart"]
        total["other"] += total["restart"]
        total["epoch"] += total["restart"]
        totals.append(total)
    for k in analysed:
        ready = [steps[k]["ready"] for steps in per_rank]
        latest = max(ready)
        last = per_rank[ready.index(latest)]
        # What the last rank was itself waiting for: its batch (then the others' wait is the
        # input's cost too, e.g. every rank's loader is slow and rank 1's batch came last).
        its_input = (last[k]["in_step_input"] - last[k]["restart"]
                     + last.get(k - 1, {}).get("input", 0.0))
        for rank, steps in enumerate(per_rank):
            budget = steps[k]["train"] - steps[k]["in_step_input"]
            waited = min(max(0.0, latest - ready[rank]), max(0.0, budget))
            totals[rank]["waited"] += waited
            # the reduction once every rank arrived: at most what is left of the step
            totals[rank]["comm"] += min(reduction, max(0.0, budget - waited))
            if its_input >= 0.5 * waited:
                totals[rank]["input"] += waited
            elif its_input + last[k]["restart"] >= 0.5 * waited:  # its input restarting
                totals[rank]["other"] += waited
                totals[rank]["epoch"] += waited
            else:
                totals[rank]["wait"] += waited
            others = ready[:rank] + ready[rank + 1:]
            if others:
                totals[rank]["lateness"] += ready[rank] - statistics.median(others)
    late = None
    if len(totals) > 1:
        rank = max(range(len(totals)), key=lambda r: totals[r]["lateness"])
        behind = totals[rank]["lateness"] / len(analysed)
        others = [t for r, t in enumerate(totals) if r != rank]
        typical = statistics.median(t["window"] for t in others) / len(analysed)
        if behind > 0.1 * typical:  # below: the jitter of a sleep or a thread switch
            excess = {name: max(0.0, totals[rank][name] - statistics.median(
                t[name] for t in others)) for name in ("input", "callbacks", "other")}
            cause = max(excess, key=excess.get)
            if excess[cause] < 0.25 * totals[rank]["lateness"]:
                cause = "unknown"  # late without spending it in a phase: e.g. its clock
            del excess["input"]  # the others' wait for its batches is input wait already
            for name, extra in excess.items():  # what the others waited for
                totals[rank][name] -= extra
                totals[rank]["wait"] += extra
            late = (rank, behind, behind / max(1.0, typical - behind), cause)
    for total in totals:
        total["step"] = (total["train"] - total["in_step_input"] - total["waited"]
                         - total["comm"])
        total["epoch"] = min(total["epoch"], total["callbacks"] + total["other"])
    time_all = sum(t["window"] for t in totals) or 1.0
    shares = {name: sum(t[name] for t in totals) / time_all
              for name in ("input", "wait", "comm", "callbacks", "other", "epoch", "step")}
    return {"steps": (analysed[0], closing), "seconds": totals[0]["window"] / 1e9,
            "ranks": totals, "shares": shares, "late": late, "batch_size": batch_size,
            "communication": communication, "epochs": int(totals[0]["epochs"]),
            "rates": [len(analysed) / max(t["window"] / 1e9, 1e-9) for t in totals],
            "step_rates": [1e9 / max(t["cycle"], 1.0) for t in totals]}


_WORDS = {"input": "its input", "callbacks": "callbacks", "other": "other host work",
          "unknown": "no phase of its own"}


#: the input advice by what fit was given (``sharded.input_kind``); None: not known
_INPUT_ADVICE = {
    "shard tf.data": (
        "mgpu.data.shard's tf.data is prefetched already (AUTOTUNE) and its batches are copied "
        "to the device ahead (MGPU_PREFETCH): raise MGPU_PREFETCH, do per-sample work "
        "(tokenizing, map) once before the training, or give a plain keras.Model the arrays "
        "themselves (mgpu.data.shard((x, y), batch_size=...): batches sliced without tf.data)"),
    "tf.data": (
        "end the tf.data pipeline with .prefetch(tf.data.AUTOTUNE), map with "
        "num_parallel_calls=tf.data.AUTOTUNE, and raise MGPU_PREFETCH"),
    "PyDataset": (
        "raise MGPU_PREFETCH, or give the PyDataset workers (workers=4, "
        "use_multiprocessing=True)"),
    "arrays": "raise MGPU_PREFETCH (mgpu copies the batches to the device ahead)",
    None: ("raise MGPU_PREFETCH, give the PyDataset workers (workers=4, "
           "use_multiprocessing=True) or use tf.data with .prefetch(tf.data.AUTOTUNE)"),
}


def _measured(figures: Dict) -> bool:
    return "seconds" in (figures.get("communication") or {})


def _lost(figures: Dict) -> Dict[str, float]:
    shares = figures["shares"]
    return {"input": shares["input"], "wait": shares["wait"], "comm": shares.get("comm", 0.0),
            "rest": shares["callbacks"] + shares["other"]}


def advice(figures: Dict) -> str:
    """One line of advice for the largest lost share.

    Example:
        >>> advice({"shares": {"input": 0.0, "wait": 0.0, "comm": 0.6, "callbacks": 0.0,
        ...                    "other": 0.0}, "late": None,
        ...         "communication": {"seconds": 0.1}})[:14]
        'communication'
    """
    lost = _lost(figures)
    largest = max(lost, key=lost.get)
    if lost[largest] < 0.05:
        alone = len(figures.get("ranks", ())) == 1  # no allreduce runs
        what = "compute" if alone or _measured(figures) else "compute and gradient allreduce"
        hint = figures.get("step_hint")
        return f"no cause above 5%: the step itself ({what}) dominates" + (
            f"; {hint}" if hint else "")
    if largest == "comm":
        return "communication: the gradient allreduce dominates; " + _cheaper(
            figures["communication"])
    if largest == "input":
        return "input: the step waits for its batches; " + _INPUT_ADVICE.get(
            figures.get("input_kind"), _INPUT_ADVICE[None])
    if largest == "wait" and figures["late"] is not None:
        rank, behind, _, cause = figures["late"]  # ms, not a ratio to a step of a few ms
        return (f"rank {rank} arrives {units.duration(behind / 1e9)} a step after the others, in "
                f"{_WORDS[cause]}: another job on its GPU or CPU, or work only it does?")
    if largest == "wait":
        return "ranks take turns being late: look at the timeline (MGPU_TIMELINE=FILE)"
    if figures["shares"].get("epoch", 0.0) > 0.5 * lost["rest"]:
        return ("validation and epoch ends: validate less often (fit(validation_freq=N)) or on "
                "fewer samples, and make per-epoch callbacks (checkpoints) cheaper")
    return ("callbacks and Keras's loop: make per-batch callbacks cheaper or run them every N "
            "batches, and raise compile(steps_per_execution=)")


def too_small(figures: Dict) -> Optional[str]:
    """The one line that replaces the report when the job is too small to judge, else None.

    Too small: the largest loss is a fixed cost, one every step pays whatever its work
    (Keras's loop and callbacks, validation and epoch ends, or an allreduce of under
    :data:`LATENCY_BYTES`: its latency), and the step computes for less time than those fixed
    costs take a step (ns, averaged over ranks). Their share then says how small the job is,
    not what is wrong with it: the quick start's digits job is one. A slow input, a slower
    rank or an allreduce of many bytes is always reported.
    """
    lost, shares = _lost(figures), figures["shares"]
    small = _measured(figures) and figures["communication"]["bytes"] < LATENCY_BYTES
    largest = max(lost, key=lost.get)
    if largest in ("input", "wait") or (largest == "comm" and not small):
        return None
    steps = figures["steps"][1] - figures["steps"][0]
    per_step = sum(t["window"] for t in figures["ranks"]) / len(figures["ranks"]) / steps / 1e9
    epoch = shares.get("epoch", 0.0) * per_step
    loop, comm = lost["rest"] * per_step - epoch, lost["comm"] * per_step if small else 0.0
    step = shares.get("step", 0.0) * per_step
    if step >= loop + epoch + comm:
        return None
    parts = [(loop, f"Keras's loop and callbacks {units.duration(loop)}")]
    if comm:
        nbytes = figures["communication"]["bytes"]
        parts.append((comm, f"the allreduce of {units.size_words(nbytes)}"
                            f" {units.duration(comm)}"))
    if epoch:  # per epoch where the fit ended one in the steps analysed
        parts.append((epoch, "validation and epoch ends " + (
            f"{units.duration(epoch * steps / figures['epochs'])} an epoch" if figures.get("epochs")
            else f"{units.duration(epoch)} a step")))
    parts = ", ".join(words for _, words in sorted(parts, reverse=True))
    return (f"{_header(figures)} not judged, the fit is too small: a step computes "
            f"{units.duration(step)}, and fixed costs add "
            f"{units.duration(loop + epoch + comm)} a step ({parts}); a larger batch, model or "
            f"epoch makes them small. Throughput: "
            f"{_throughput(figures, short=True)}.")


def _header(figures: Dict) -> str:
    (first, last), ranks = figures["steps"], len(figures["rates"])
    return (f"mgpu: efficiency of fit, steps {first}-{last} on {ranks} "
            f"rank{'s' if ranks > 1 else ''} ({units.duration(figures['seconds'])}):")


def _throughput(figures: Dict, short: bool = False) -> str:
    """The fit's throughput, and a median step's where it differs (ThroughputCallback's
    samples_per_sec is a median step's: the time between steps is not in it)."""
    rates, batch = figures["rates"], figures["batch_size"]
    unit, scale = ("samples/s", batch) if batch else ("steps/s", 1)
    text = f"{units.plain(sum(rates) * scale, 4)} {unit}" + (" over the fit" if short else (
        " in total over the fit; per rank: " + ", ".join(units.plain(r * scale, 4) for r in rates)
        + ("" if batch else " (batch size unknown)")))
    step = sum(figures.get("step_rates", rates)) * scale
    if step > 1.2 * sum(rates) * scale:
        text += (f"; {units.plain(step, 4)} in a median step"
                 + (" (ThroughputCallback's samples_per_sec)" if batch else "")
                 + ("" if short else ": the rest of the time is between the steps "
                    "(validation, epoch ends, slower steps)"))
    return text


def render(figures: Dict) -> str:
    """The report's text (see the module docstring), or the one line of :func:`too_small`."""
    quiet = too_small(figures)
    if quiet:
        return quiet
    lines = [_header(figures), f"  throughput: {_throughput(figures)}"]
    if figures.get("optimizer_state"):
        lines.append(f"  optimizer state: {_optimizer_state(figures['optimizer_state'])}")
    shares = figures["shares"]
    lost = (shares["input"] + shares["wait"] + shares.get("comm", 0.0) + shares["callbacks"]
            + shares["other"])
    lines.append(f"  lost: {100 * lost:.0f}% of the ranks' time")
    late = figures["late"]
    who = (f"rank {late[0]}, {units.duration(late[1] / 1e9)} a step behind the others "
           f"({_WORDS[late[3]]})" if late else "")
    rows = [("input wait", shares["input"], ""), ("waiting for a slower rank", shares["wait"], who)]
    communication = figures.get("communication")
    if communication:  # None: one rank, no allreduce
        rows.append(("communication", shares["comm"] if _measured(figures) else None,
                     _communication(communication)))
    epoch = shares.get("epoch", 0.0)
    rows.append(("the rest", shares["callbacks"] + shares["other"],
                 "callbacks, validation, Keras's loop" + (
                     f" (validation and epoch ends: {100 * epoch:.0f}%)" if epoch >= 0.01
                     else "")))
    for label, share, detail in rows:
        amount = "  -" if share is None else f"{100 * share:3.0f}%"
        lines.append(f"    {label:<28}{amount}  {detail}".rstrip())
    lines.append(f"  advice: {advice(figures)}")
    return "\n".join(lines)


def _optimizer_state(state: Dict) -> str:
    """Bytes of optimizer state per rank, and whether they are sharded (issue 60)."""
    held = state["bytes_per_rank"]
    text = f"{units.size_words(max(held))} on the fullest rank"
    if state["sharded"]:
        return (text + f", {units.size_words(sum(held))} over all {len(held)} (sharded: each "
                f"rank updates its variables, and the new values are shared, as many bytes "
                f"again as the gradient allreduce)")
    return text + (" (every rank holds all of it; DistributedOptimizer(..., "
                   "shard_optimizer_state=True) keeps about 1/N per rank)" if len(held) > 1
                   else "")


def _communication(communication: Optional[Dict]) -> str:
    """The communication line's words: what was measured and how far it is exposed."""
    if not communication:
        return ""
    if "seconds" not in communication:
        return f"not measured: {communication['note']}"
    size = units.size_words(communication["bytes"])
    codec = communication.get("compression", "none")
    size += "" if codec == "none" else f", sent as {codec}"
    every = communication.get("every", 1)
    took = (f"the gradient allreduce ({size}) takes "
            f"{units.duration(communication['seconds'] * every)} alone"
            + (f", once every {every} steps" if every > 1 else ""))
    if communication["overlaps"]:
        return took + ", an upper bound: this engine overlaps it with the backward pass"
    return took + "; this engine reduces after the backward pass, so none of it overlaps"


def _cheaper(communication: Dict) -> str:
    """The ways to a cheaper allreduce that this fit does not use yet, as one phrase."""
    ways = ["fewer steps for the same samples (raise the batch per rank)"]
    if communication.get("compression", "none") == "none":
        ways.append("half the bytes (DistributedOptimizer(..., "
                    "compression=mgpu.Compression.fp16))")
    every = communication.get("every", 1)
    ways.append("one reduction every N batches (backward_passes_per_step=N)" if every == 1
                else f"a larger backward_passes_per_step (now {every})")
    if communication.get("hint"):
        ways.append(communication["hint"])
    return ", ".join(ways[:-1]) + " or " + ways[-1]
