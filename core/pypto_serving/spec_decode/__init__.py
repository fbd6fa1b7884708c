"""Speculative decoding building blocks: rejection sampling of drafts against the target's
distributions (:mod:`.rejection`) and the n-gram prompt-lookup drafter (:mod:`.ngram`)."""

from __future__ import annotations

from .ngram import NgramDrafter, propose_ngram
from .rejection import DeviceVerdict, SpecRow, SpecRows, Verdict, draft_uniforms, read, rejection_sample

__all__ = [
    "DeviceVerdict",
    "NgramDrafter",
    "SpecRow",
    "SpecRows",
    "Verdict",
    "draft_uniforms",
    "propose_ngram",
    "read",
    "rejection_sample",
]
