"""The sampler on a fake CUDA device: every tensor it makes lives on the logits' device and it reads
nothing back before the step's single host read.

``FakeTensorMode`` traces tensors by shape, dtype and device only, so a CPU-only torch can run the
sampler with ``cuda`` logits: mixing in a CPU tensor raises ``FakeTensorDeviceMismatchError`` and
a host read of device data (``.tolist()``, ``.item()``, ``nonzero``, boolean-mask indexing) raises
too, since a fake tensor has no values to read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import pypto_serving.sampler as sampler_mod
from pypto_serving.sampler import RowParams, TokenCounts, packed, sample_on_device

VOCAB = 1000


def row(**kw: Any) -> RowParams:
    return RowParams(**{"temperature": 1.0, "seed": 3, "draw_index": 5, **kw})


def rows() -> list[RowParams]:
    """One row of every kind the sampler has a path for."""
    counts = TokenCounts(prompt=[1, 2, 3], outputs=[4, 4])
    return [
        row(temperature=0.0),  # greedy
        row(temperature=0.0, num_logprobs=3, banned=(7,)),
        row(top_k=20, top_p=0.8),  # sampled, Qwen3's defaults
        row(top_p=0.9, seed=2**62),  # bounded candidates
        row(min_p=0.1, num_logprobs=0),
        row(temperature=0.7),  # the whole vocabulary
        row(top_k=5, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.1, counts=counts),
        row(temperature=0.0, presence_penalty=0.3, counts=counts, drafts=(9, 10)),
    ]


@pytest.fixture
def fake() -> Iterator[FakeTensorMode]:
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        yield mode


def test_fake_cuda_catches_device_mixing_and_host_reads(fake: FakeTensorMode) -> None:
    logits = torch.empty(2, VOCAB, device="cuda")
    with pytest.raises(Exception, match="device"):
        _ = logits + torch.ones(VOCAB, device="cpu")
    with pytest.raises(Exception):  # noqa: B017 - the exception class differs between torch versions
        logits.argmax(-1).tolist()


def test_every_row_kind_samples_on_the_device_up_to_the_single_read(fake: FakeTensorMode) -> None:
    logits = torch.empty(8, VOCAB, device="cuda")
    dev = sample_on_device(logits, rows())
    tensors = [dev.tokens, dev.bad, dev.needs_full, dev.logits, packed(dev)]
    assert dev.raw is not None and dev.top is not None
    tensors += [dev.raw, *dev.top]
    assert all(t.device.type == "cuda" for t in tensors)
    assert dev.tokens.shape == (8,) and dev.tokens.dtype == torch.long


@pytest.mark.parametrize("vocab", [VOCAB, 151_936])
def test_unedited_greedy_and_sampled_rows_take_the_one_pass_argmax_on_the_device(
    fake: FakeTensorMode, vocab: int
) -> None:
    """Greedy rows that nothing edits (beside a sampled one): tokens and the non-finite check from
    :func:`pypto_serving.sampler.argmax_rows`, on the device, nothing read back."""
    logits = torch.empty(3, vocab, device="cuda")
    dev = sample_on_device(logits, [row(temperature=0.0), row(top_k=20), row(temperature=0.0)])
    assert all(t.device.type == "cuda" for t in (dev.tokens, dev.bad, dev.needs_full, packed(dev)))
    assert dev.tokens.shape == (3,) and dev.bad.shape == (3,)


def test_bfloat16_logits_and_the_full_vocabulary_fallback(
    fake: FakeTensorMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sampler_mod, "CANDIDATES", 16)
    params = rows()
    dev = sample_on_device(torch.empty(8, VOCAB, device="cuda", dtype=torch.bfloat16), params)
    # What ``sample`` runs for rows whose kept set reaches past the bounded candidates.
    tokens, _ = sampler_mod._draw_rows(dev.logits, params, [3, 4], dev.tokens, fallback=True)
    assert tokens.device.type == "cuda"
    assert sampler_mod._chosen(dev, [1, 4]).device.type == "cuda"


@pytest.mark.parametrize("num_constrained", [8, 2])  # every row (masked in place), and some rows
def test_grammar_masks_apply_on_the_device(fake: FakeTensorMode, num_constrained: int) -> None:
    from pypto_serving.structured import GrammarMask

    words = (VOCAB + 31) // 32
    grammar = GrammarMask(
        rows=torch.empty(num_constrained, dtype=torch.long, device="cuda"),
        bitmask=torch.empty(num_constrained, words, dtype=torch.int32, device="cuda"),
    )
    dev = sample_on_device(torch.empty(8, VOCAB, device="cuda"), rows(), grammar)
    assert all(t.device.type == "cuda" for t in (dev.tokens, dev.bad, dev.logits, packed(dev)))


def test_logit_bias_allowed_tokens_and_bad_words_apply_on_the_device(fake: FakeTensorMode) -> None:
    """The request's edits (made on the device at first use, kept across steps) and bad-word bans."""
    from pypto_serving.sampler import LogitEdits

    bias = LogitEdits(bias=((3, 5.0), (VOCAB + 7, 1.0)), allowed=None)
    allowed = LogitEdits(bias=((2, -100.0),), allowed=(1, 2, 3, 999))
    params = [
        *rows(),
        row(temperature=0.0, edits=bias),
        row(top_k=5, edits=allowed, banned=(2,)),  # a bad word's last token, banned for this row
        row(top_p=0.9, edits=allowed, counts=TokenCounts(prompt=[1], outputs=[]), repetition_penalty=1.3),
    ]
    for _ in range(2):  # the second step reuses the edits' device tensors
        dev = sample_on_device(torch.empty(len(params), VOCAB, device="cuda"), params)
        assert all(t.device.type == "cuda" for t in (dev.tokens, dev.bad, dev.logits, packed(dev)))


@pytest.mark.parametrize("greedy", [False, True, "checked", "unfiltered"])  # every row kind; an all-greedy
# step (argmax only); the same with the rows listed by disallowed id checked against their bitmasks
# instead; every row sampled without filters (drawn from the unmasked logits when listed by disallowed id)
@pytest.mark.parametrize(
    ("listed", "banned"), [((0, 2, 3, 5), (6,)), (tuple(range(8)), ()), ((), (1, 5)), ((), tuple(range(8)))]
)  # some rows listed each way; every row by allowed id; some or every row only by disallowed id
def test_grammar_rows_listed_by_id_sample_on_the_device(
    fake: FakeTensorMode, listed: tuple[int, ...], banned: tuple[int, ...], greedy: bool | str
) -> None:
    """Rows listed by allowed id (greedy, top-k/p, bounded, whole-vocabulary) or by disallowed id,
    beside rows masked through their bitmask: filled, scattered and drawn on the device, up to the
    single read."""
    from pypto_serving.structured import GrammarMask, SparseRows

    words, width = (VOCAB + 31) // 32, 40
    dense = [i for i in range(8) if i not in listed + banned]
    sparse = SparseRows(
        rows=listed,
        ids=torch.empty(len(listed), width, dtype=torch.long, device="cuda"),
        pad=torch.empty(len(listed), width, dtype=torch.bool, device="cuda"),
        banned_rows=banned,
        banned=torch.empty(len(banned), width, dtype=torch.long, device="cuda"),
        vocab=VOCAB - 10,  # the tokens past the tokenizer's are masked too
        max_id=VOCAB - 1,
        dense=torch.empty(len(dense), dtype=torch.long, device="cuda"),
        num_dense=len(dense),
    )
    if greedy == "checked":  # the rows listed by disallowed id are checked instead
        checked, plain = len(banned), len(dense)
        sparse = dataclasses.replace(
            sparse,
            banned_rows=(),
            banned=torch.empty(0, width, dtype=torch.long, device="cuda"),
            dense=torch.empty(checked + plain, dtype=torch.long, device="cuda"),
            num_dense=checked + plain,
            checked=torch.empty(checked, dtype=torch.long, device="cuda") if checked else None,
            unchecked=torch.empty(plain, dtype=torch.long, device="cuda") if checked else None,
        )
    grammar = GrammarMask(
        rows=torch.empty(8, dtype=torch.long, device="cuda"),
        bitmask=torch.empty(8, words, dtype=torch.int32, device="cuda"),
        sparse=sparse,
    )
    if greedy == "unfiltered":
        params = [row(temperature=0.7, seed=r) for r in range(8)]
    else:
        params = [row(temperature=0.0, num_logprobs=r % 2) for r in range(8)] if greedy else rows()
    dev = sample_on_device(torch.empty(8, VOCAB, device="cuda"), params, grammar)
    assert all(t.device.type == "cuda" for t in (dev.tokens, dev.bad, dev.logits, packed(dev)))
