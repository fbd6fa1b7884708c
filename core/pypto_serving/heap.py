"""The Python heap of a long-running process: what start-up leaves behind is kept out of the garbage
collector's way.

A full (generation 2) collection walks every tracked object while holding the GIL. A serving process
holds hundreds of thousands of them after start-up (modules, torch, the tokenizer, the executor), so
a full collection that a burst of allocation triggers (a response of many logprobs, a step of many
requests) is a pause of 100 ms and more, stalling every stream in that process. Once start-up is
done those objects live as long as the process, so they are moved to the permanent generation
(:func:`gc.freeze`), which collections skip; collection of everything created later is unchanged.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_startup_heap"]


def freeze_startup_heap() -> None:
    """Collect once, then freeze every surviving object (called when a process has finished starting
    up; calling it again freezes what has been created since)."""
    gc.collect()
    gc.freeze()
