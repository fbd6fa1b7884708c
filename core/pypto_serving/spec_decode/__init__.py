"""Speculative decoding building blocks: rejection sampling of drafts against the target's
distributions (:mod:`.rejection`), sampled drafts and their verification (:mod:`.sampled`) and the
n-gram prompt-lookup drafter (:mod:`.ngram`)."""

from __future__ import annotations

from .ngram import NgramDrafter, propose_ngram
from .rejection import DeviceVerdict, SpecRow, SpecRows, Verdict, draft_uniforms, read, rejection_sample
from .sampled import DraftRow, DraftSampler, processed_probs, verify_sampled

__all__ = [
    "DeviceVerdict",
    "DraftRow",
    "DraftSampler",
    "NgramDrafter",
    "SpecRow",
    "SpecRows",
    "Verdict",
    "draft_uniforms",
    "processed_probs",
    "propose_ngram",
    "read",
    "rejection_sample",
    "verify_sampled",
]
