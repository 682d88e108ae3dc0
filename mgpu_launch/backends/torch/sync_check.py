"""Finding where a torch step synchronises with the host (what a CUDA graph cannot contain).

:func:`run` runs a step under ``torch.cuda.set_sync_debug_mode("warn")`` and returns each place
that synchronised, as :func:`where` names it: the innermost frames outside torch and mgpu's own
step wrappers. ``torch_graph`` runs its last warm-up step this way before capture.
"""

import threading
import traceback
import warnings

#: the text of torch's warning for a synchronising call
_SYNC_MESSAGE = "synchronizing CUDA operation"


def run(step):
    """Run `step()` with torch's sync debug mode on; return its result and the syncs seen.

    Only this thread's warnings count (the prefetch thread synchronises its own stream).
    """
    import torch

    found, me = [], threading.get_ident()
    previous_mode = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if _SYNC_MESSAGE in str(message) and threading.get_ident() == me:
                found.append(where(traceback.extract_stack()[:-1], f"{filename}:{lineno}"))
            elif _SYNC_MESSAGE not in str(message):
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = step()
        finally:
            torch.cuda.set_sync_debug_mode(previous_mode)
    return result, found


def where(stack, fallback: str) -> str:
    """The innermost frames of `stack` outside torch, warnings and this module: where a
    synchronising call came from (the Keras function that made it, and its caller)."""
    skip = ("/torch/", "warnings.py", "torch_graph.py", "torch_sync_check.py",
            "patches/fit.py", "/keras/src/backend/torch/core.py")
    frames = [f for f in stack if not any(part in f.filename for part in skip)]
    if not frames:
        return fallback
    return " <- ".join(f"{f.filename.rsplit('/site-packages/', 1)[-1]}:{f.lineno} ({f.name})"
                       for f in reversed(frames[-2:]))
