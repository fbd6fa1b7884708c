"""The DeepSeek-V4 executor on a fake CUDA device: every tensor of a step lives on the executor's
device, and ``execute`` (prefill, chunked prefill mixed with decode) and ``propose_drafts`` read
nothing back to the host except drafting's single final read (:func:`read_drafts`).

The model's weights, caches, compressor rings and batch tensors are empty fake ``cuda`` tensors (see
``fake_cuda``): a CPU tensor mixed in raises a device mismatch, and any host read of a value
(``.item()``, ``.tolist()``, ``int(t)``, boolean masks, data-dependent shapes) raises, since fake
tensors hold no values. Values are checked elsewhere (test_parity, test_mtp); here only placement,
shapes and the absence of syncs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorDeviceMismatchError,
)

import pypto_serving_deepseek_mtp.executor as executor_mod
from pypto_serving.sampler import RowParams
from pypto_serving.spec_decode import DraftRow, DraftSampler, verify_sampled
from pypto_serving.spec_decode.rejection import SpecRow

from .fake_cuda import CUDA, CudaBindings, HostReads, fake_cuda, fake_mode
from .helpers import FakeCore

K = 2
BLOCKS = 64


def _executor(path: Any) -> Any:
    from pypto_serving.config import ServingSettings

    settings = ServingSettings(
        model=str(path),
        dtype="bfloat16",  # the grouped MoE path takes bf16 on CUDA (float32 falls back to a syncing loop)
        device="cpu",
        block_size=4,
        speculative_config={"method": "mtp", "num_speculative_tokens": K},
        max_num_seqs=4,
    )
    ex = executor_mod.DeepseekMTPExecutor(settings)
    return ex, ex.load()


def _fake_batch(batch: Any) -> Any:
    tensors = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return dataclasses.replace(
        batch, **{k: fake_cuda(v) for k, v in tensors.items() if isinstance(v, torch.Tensor | dict)}
    )


@dataclasses.dataclass
class Setup:
    ex: Any
    vocab: int
    batches: list[Any]
    more: list[Any]  # steps after ``batches``: the batched emission and drafting paths
    hit: Any  # after ``more``: a request's first step at a prefix-cache hit, beside a decode


@pytest.fixture(scope="module")
def release_copy(checkpoints: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``mixed_yarn`` in DeepSeek's release layout, kept in its stored precision at run time: FP8
    projections (8x16 blocks, which ``wo_a``'s output groups meet whole) and MXFP4 routed experts
    (``release``), or block-FP8 routed experts (``release-fp8-experts``); or msModelSlim's W8A8
    (``w8a8``: int8 projections and experts, per-token int8 activations)."""
    from pypto_serving_deepseek_mtp.release import write_release_layout

    from .test_w8a8 import w8a8_copy

    out = {}
    for name, experts in (("release", "fp4"), ("release-fp8-experts", "fp8")):
        out[name] = tmp_path_factory.mktemp(name)
        write_release_layout(checkpoints["mixed_yarn"].path, out[name], (8, 16), expert_dtype=experts)
    root = tmp_path_factory.mktemp("w8a8")
    w8a8_copy(checkpoints["mixed_yarn"].path, root / "w8a8", root / "plain")
    out["w8a8"] = root / "w8a8"
    return out


@pytest.fixture(params=["mixed_yarn", "csa_heavy"])
def fake_executor(checkpoints: Any, release_copy: Any, request: pytest.FixtureRequest) -> Iterator[Setup]:
    """The executor on fake cuda plus four prebuilt steps (batches are laid out on the host first)."""
    path = release_copy[request.param] if request.param in release_copy else checkpoints[request.param].path
    ex, info = _executor(path)
    core = FakeCore(ex, info, num_blocks=BLOCKS)
    a = list(range(3, 12))  # request a: 9 prompt tokens, prefilled in two chunks (4 + 5)
    b = list(range(20, 26))  # request b: 6 prompt tokens, then a decode step verifying K drafts
    steps = [
        core.batch([("a", a[:4], 0, 0), ("b", b, 0, 1)]),
        core.batch([("a", a[4:], 4, 1), ("b", [40, 41, 42], len(b), 1 + K)]),
        core.batch([("a", [50], len(a), 1), ("b", [43, 44], len(b) + 2, 2)]),
        # Decodes on both sides of a new prefill: the decode group's rows are not consecutive.
        core.batch([("a", [51], len(a) + 1, 1), ("c", list(range(60, 65)), 0, 1), ("b", [45], len(b) + 3, 1)]),
    ]
    more = [
        # Three requests at different positions whose windows close in this step (a decode, two
        # verifications of K drafts), next to a non-sampling prefill chunk of a new request.
        core.batch(
            [
                ("b", [46, 47, 48], len(b) + 4, 1 + K),
                ("a", [52], len(a) + 2, 1),
                ("d", [70, 71, 72], 0, 0),
                ("c", [66, 67, 68], 5, 1 + K),
            ]
        ),
        # d's next chunk reads the MTP input its first chunk left in the carry ring.
        core.batch([("d", list(range(73, 85)), 3, 1), ("a", [53], len(a) + 3, 1)]),
    ]
    # After ``more``: a request first seen at a prefix-cache hit (position 16) beside a decode.
    hit = core.batch([("h", list(range(90, 96)), 16, 1), ("a", [54], len(a) + 4, 1)])
    with fake_mode(), CudaBindings():
        model, memo = ex.model, {}
        for name in ("embed", "head", "norm", "hc_head", "layers", "inv_freq"):
            setattr(model, name, fake_cuda(getattr(model, name), memo))
        ex.mtp_layers = fake_cuda(ex.mtp_layers, memo)
        ex.device = model.device = torch.device("cuda")
        ex.init_kv_cache({g.name: BLOCKS for g in info.cache_groups})
        batches, later = [_fake_batch(s) for s in steps], [_fake_batch(s) for s in more]
        yield Setup(ex, info.vocab_size, batches, later, _fake_batch(hit))


def test_fake_cuda_catches_host_reads_and_device_mixing() -> None:
    """The check has teeth: each read and mix this test forbids raises as a data-dependent read or a
    device mismatch (not as the missing CUDA support of a CPU-only torch, which harmless calls would
    hit too); indexing without a read works."""
    with fake_mode(), CudaBindings():
        x = torch.empty(4, 3, device="cuda")
        with pytest.raises(DataDependentOutputException):
            x.max().item()
        with pytest.raises(DataDependentOutputException):
            x.argmax(-1).tolist()
        with pytest.raises(DataDependentOutputException):
            int(x[0, 0])
        with pytest.raises(DataDependentOutputException):
            float(x.sum())
        with pytest.raises(DynamicOutputShapeException):  # boolean-mask indexing needs the mask's values
            _ = x[x > 0]
        with pytest.raises(DynamicOutputShapeException):
            (x > 0).nonzero()
        with pytest.raises(DynamicOutputShapeException):  # an output size that only the values give
            torch.repeat_interleave(torch.arange(3, device="cuda"), torch.ones(3, dtype=torch.long, device="cuda"))
        with pytest.raises(FakeTensorDeviceMismatchError):
            _ = x + torch.ones(3)
        assert x[torch.zeros(2, dtype=torch.long, device="cuda"), 1:].shape == (2, 2)  # indexing itself works
        with HostReads() as reads:
            assert x.argmax(-1).tolist() == [0, 0, 0, 0]
            with pytest.raises(DataDependentOutputException):
                x.max().item()
        assert reads.shapes == [(4,)]


def test_execute_and_drafting_stay_on_the_device(fake_executor: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    ex = fake_executor.ex
    reads: list[torch.Tensor] = []

    def read_drafts(drafts: torch.Tensor) -> list[int]:
        reads.append(drafts)
        return [0] * drafts.shape[0]  # what the host read would return, without reading

    monkeypatch.setattr(executor_mod, "read_drafts", read_drafts)
    accepted = [
        [[], [7]],  # a's first chunk samples nothing; b's prefill samples one token
        [[8], [40, 9]],  # a's last chunk samples; b accepts its first draft
        [[10], [43]],
        [[11], [12], [13]],
    ]
    for batch, acc in zip(fake_executor.batches, accepted):
        logits = ex.execute(batch)
        assert logits.device.type == "cuda"
        assert logits.shape == (sum(batch.num_logits), fake_executor.vocab)
        drafts = ex.propose_drafts(batch, acc)
        assert [len(d) for d in drafts] == [K if n else 0 for n in batch.num_logits]
    # One read per step, of every sampling request's K drafts at once.
    assert [tuple(t.shape) for t in reads] == [(K,), (2 * K,), (2 * K,), (3 * K,)]
    assert all(t.device == CUDA and t.dtype == torch.long for t in reads)


def test_batched_emission_and_drafting_stay_on_the_device(
    fake_executor: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Windows closing for several requests in one step, a row-wise attention group of decodes and
    verifications, a non-sampling chunk and the carry ring read after it, then a request starting at a
    prefix-cache hit: still no host read."""
    ex = fake_executor.ex
    reads: list[torch.Tensor] = []

    def read_drafts(drafts: torch.Tensor) -> list[int]:
        reads.append(drafts)
        return [0] * drafts.shape[0]

    monkeypatch.setattr(executor_mod, "read_drafts", read_drafts)
    accepted = [
        [[], [7]],
        [[8], [40, 9]],
        [[10], [43]],
        [[11], [12], [13]],
        [[46, 47, 14], [15], [], [66, 16]],
        [[17], [18]],
    ]
    for batch, acc in zip(fake_executor.batches + fake_executor.more, accepted):
        logits = ex.execute(batch)
        assert logits.device.type == "cuda" and logits.shape == (sum(batch.num_logits), fake_executor.vocab)
        drafts = ex.propose_drafts(batch, acc)
        assert [len(d) for d in drafts] == [K if n else 0 for n in batch.num_logits]
    assert [tuple(t.shape) for t in reads[4:]] == [(3 * K,), (2 * K,)]
    assert all(c.device.type == "cuda" for c in ex.carry)
    assert ex.mtp_state["d"].carried[0][1] >= 0  # the ring did hold d's carried input
    # A request starting at a prefix-cache hit: its CSA rings refilled from the compressor snapshot
    # and its MTP carry rings from the MTP input snapshot (the tables' entries gathered on the device).
    logits = ex.execute(fake_executor.hit)
    assert logits.device.type == "cuda" and logits.shape == (2, fake_executor.vocab)
    assert ex.hit_starts == {"h": 16}
    drafts = ex.propose_drafts(fake_executor.hit, [[19], [14]])
    st = ex.mtp_state["h"]
    if 16 % ex.hit_unit == 0:  # a position a hit can start at: h drafts every depth at once
        assert st.origin == 16 and st.restored and [len(d) for d in drafts] == [K, K]
    else:  # not one (no snapshot ends there): h rebuilds its MTP KV, drafting only what is exact
        assert st.origin == 16 and not st.restored and len(drafts[0]) < K and len(drafts[1]) == K


def test_caches_and_rings_live_on_the_device(fake_executor: Setup) -> None:
    model = fake_executor.ex.model
    assert model.caches and model.rings
    assert all(c.device.type == "cuda" for c in model.caches.values())
    assert all(r.kv.device.type == "cuda" and r.gate.device.type == "cuda" for r in model.rings.values())


def test_sampled_drafting_and_rejection_verification_stay_on_the_device(
    fake_executor: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampled requests: ``propose_sampled_drafts`` draws each depth's drafts from the MTP head's
    processed softmax through a :class:`DraftSampler` (one with top-p, so the sorted path runs too),
    keeping their ``q`` on the device; the next step's logits and those ``q`` go through the runner's
    rejection-sampled verification (:func:`verify_sampled`, penalties and bans included). Drafting
    reads only its drafts, and verification exactly once, its verdict."""
    ex = fake_executor.ex
    reads: list[torch.Tensor] = []

    def read_drafts(drafts: torch.Tensor) -> list[int]:
        reads.append(drafts)
        return [40 + i for i in range(drafts.shape[0])]

    monkeypatch.setattr(executor_mod, "read_drafts", read_drafts)
    first, second = fake_executor.batches[:2]
    ex.execute(first)
    # a's first chunk samples nothing; b's prefill samples and drafts K tokens at temperature 0.7.
    sampler = DraftSampler({1: DraftRow(temperature=0.7, top_k=0, top_p=0.9, min_p=0.0, seed=5, first_index=1)})
    drafts = ex.propose_sampled_drafts(first, [[], [7]], sampler)
    assert drafts == [[], [40, 41]] and [tuple(t.shape) for t in reads] == [(K,)]
    q = sampler.probs(1, K)
    assert q is not None and q.device == CUDA and tuple(q.shape) == (K, fake_executor.vocab)
    assert sampler.probs(0, 1) is None  # a row the sampler was not given drafts nothing sampled

    logits = ex.execute(second)  # b verifies its K drafts: rows 1..1+K of the logits are b's
    b_rows = logits.narrow(0, 1, 1 + K)
    params = [
        RowParams(temperature=0.7, seed=5, draw_index=1 + j, top_p=0.9, presence_penalty=0.5, banned=(3,))
        for j in range(1 + K)
    ]
    with HostReads() as host:
        verdict = verify_sampled(
            b_rows, params, [drafts[1]], q, [SpecRow(seed=5, first_index=1, num_drafts=K, greedy=False)]
        )
    assert host.shapes == [(2 + (1 + K),)]  # emitted count, bad flag, then the 1 + K token slots
    assert verdict == [[]]  # the zeros HostReads answered: nothing emitted, logits finite


@pytest.mark.parametrize("fake_executor", ["release", "release-fp8-experts", "w8a8"], indirect=True)
def test_stored_precision_weights_stay_on_the_device(fake_executor: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """The release copies on the fake device: FP8 projections (``quant_linear``) and packed MXFP4
    or block-FP8 experts (the CUDA path that gathers and dequantises the routed experts) run a
    prefill chunk and a verification step with drafting, reading nothing on the host but the drafts."""
    import pypto_kernels.quant_moe as mx
    from pypto_serving.quantization import QuantizedWeight

    ex = fake_executor.ex
    params = [*ex.model.layers, *ex.mtp_layers]
    stored = [(k, v) for p in params for k, v in p.items() if isinstance(v, QuantizedWeight)]
    experts = ex.model.layers[0]["experts.down"].scheme
    assert {v.scheme for _, v in stored} == ({"w8a8_dynamic"} if experts == "w8a8_dynamic" else {"fp8_block", experts})
    assert all(isinstance(p[k], QuantizedWeight) for p in params for k in ("experts.gate_up", "experts.down"))
    projections = {k for k, _ in stored if not k.startswith("experts.")}
    assert projections >= {"attn.wo_a.weight", "shared.gate_up", "e_proj.weight"}
    assert all(t.device == CUDA for _, v in stored for t in v.tensors())
    chunks: list[int] = []
    grouped = mx.moe_experts

    def spy(x: torch.Tensor, gate_up: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        chunks.append(gate_up.shape[0])
        return grouped(x, gate_up, *args, **kwargs)

    monkeypatch.setattr(mx, "moe_experts", spy)
    monkeypatch.setattr(executor_mod, "read_drafts", lambda drafts: [0] * drafts.shape[0])
    for batch, acc in zip(fake_executor.batches[:2], [[[], [7]], [[8], [40, 9]]]):
        logits = ex.execute(batch)
        assert logits.device.type == "cuda" and logits.shape == (sum(batch.num_logits), fake_executor.vocab)
        ex.propose_drafts(batch, acc)
    assert chunks and max(chunks) <= len(ex.model.experts)  # the gathered path ran (the reference reads counts)
