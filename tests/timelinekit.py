"""Checks of a trace-event file as Chrome's and Perfetto's JSON importers read it."""

from typing import Dict, List, Tuple

#: the fields every event of these kinds must carry (the Trace Event Format document)
REQUIRED = {"X": {"name", "cat", "ph", "ts", "dur", "pid", "tid"},
            "M": {"name", "ph", "pid", "tid", "args"}}


def check_trace(document) -> Dict[Tuple[int, int], List[dict]]:
    """Fail unless `document` is a valid trace whose slices nest properly on every track;
    returns (pid, tid) -> its "X" events, in time order."""
    events = document["traceEvents"]
    assert isinstance(events, list) and events
    tracks: Dict[Tuple[int, int], List[dict]] = {}
    for event in events:
        missing = REQUIRED[event["ph"]] - set(event)
        assert not missing, f"{event} lacks {missing}"
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int), event
        if event["ph"] == "X":
            assert isinstance(event["ts"], (int, float)) and event["ts"] >= 0, event
            assert isinstance(event["dur"], (int, float)) and event["dur"] >= 0, event
            tracks.setdefault((event["pid"], event["tid"]), []).append(event)
    for track, slices in tracks.items():
        starts = [e["ts"] for e in slices]
        assert starts == sorted(starts), f"track {track}: slices out of order"
        open_ends: List[float] = []  # ends of the slices that contain the current one
        for event in slices:
            end = event["ts"] + event["dur"]
            while open_ends and open_ends[-1] <= event["ts"] + 0.001:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1] + 0.001, (
                f"track {track}: {event} overlaps the slice before it without lying inside it")
            open_ends.append(end)
    return tracks
