"""Numbers, times and byte counts in words, for the reports mgpu prints (the efficiency report's
lines): a few significant digits, never in exponent notation, a unit a reader scales at a glance.
"""

import math


def plain(value: float, digits: int = 3) -> str:
    """`value` to `digits` significant digits, never in exponent notation (``.3g`` prints
    1060 as ``1.06e+03``): 1060 -> "1060", 16.94 -> "16.9", 6.0 -> "6", 0.01234 -> "0.0123".

    Example:
        >>> plain(1062.4), plain(6.0), plain(0.0123456)
        ('1062', '6', '0.0123')
    """
    if value == 0 or not math.isfinite(value):
        return f"{value:.0f}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def duration(seconds: float) -> str:
    """A time in ms, or in s from one second up: "0.85 ms", "6 ms", "16.9 ms", "1.06 s".

    Example:
        >>> duration(1.0624), duration(0.006), duration(0.00085)
        ('1.06 s', '6 ms', '0.85 ms')
    """
    if abs(seconds) >= 0.9995:  # what would round to "1000 ms"
        return f"{plain(seconds)} s"
    return f"{plain(1e3 * seconds)} ms"


def size_words(nbytes: float) -> str:
    """A byte count in GB / MB / KB: "16.9 MB", "1.07 GB", "512 bytes"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= 0.9995 * scale:  # what would round to "1000" of the unit below
            return f"{plain(nbytes / scale)} {unit}"
    return f"{nbytes:.0f} bytes"
