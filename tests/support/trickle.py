"""A stranger that sends a greeting a byte at a time, to a greeter running in a thread."""

from __future__ import annotations

import threading
from collections.abc import Callable


def trickle(send: Callable[[bytes], object], data: bytes, greeter: threading.Thread, pace: float) -> int:
    """``data`` a byte every ``pace`` seconds while ``greeter`` lives (a refused send ends it),
    then wait for ``greeter`` to end: how many bytes went out."""
    sent = 0
    try:
        for byte in data:
            if not greeter.is_alive():
                break
            send(bytes([byte]))
            sent += 1
            greeter.join(timeout=pace)
    except OSError:  # ssl.SSLError too
        pass
    greeter.join(timeout=60)
    return sent
