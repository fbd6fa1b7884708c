"""uvicorn servers that end on SIGINT/SIGTERM by returning, not by dying of the signal.

uvicorn re-raises the signal after its graceful shutdown, so the process exits -15; a drained
shutdown is a success. The serving server and the router both take the signals this way (each adds
its own drain on top), from a module that imports nothing heavy, since the router never loads torch.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

import uvicorn

__all__ = ["ReturningServer"]


class ReturningServer(uvicorn.Server):
    """uvicorn whose SIGINT/SIGTERM start its graceful shutdown and end in a normal return (only the
    main thread can take signals: elsewhere, as in tests, none are taken)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
