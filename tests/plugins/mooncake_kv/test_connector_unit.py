"""The ``mooncake`` connector without a transfer engine: the read batch a pull hands the engine
(checked by carrying it out by hand: both sides' caches are views into one byte arena, so each
``(local, remote, length)`` entry is a slice copy), its settings, and its error without the engine."""

from __future__ import annotations

import sys

import pytest
import torch

from pypto_serving_mooncake_kv import MooncakeConnector, read_plan, regions, storages

BLOCKS = 10


def _caches(arena: torch.Tensor, at: int, padded: bool) -> tuple[dict[str, list[torch.Tensor]], int]:
    """Two groups carved from ``arena`` at byte ``at``: ``kv``, two layer views of one [layers, blocks,
    ...] allocation (DeepSeek's layout; ``padded``: each block followed by as many unused bytes), and
    ``swa``, one float64 tensor. Returns the caches and the next free byte."""
    per_block = 3 * 5 * 4  # float32 [3, 5]
    span = per_block * (2 if padded else 1)
    whole = arena[at : at + 2 * BLOCKS * span].view(torch.float32).view(2, BLOCKS, span // 4)
    kv = [t[:, : per_block // 4].view(BLOCKS, 3, 5) if not padded else t[:, : per_block // 4] for t in whole.unbind(0)]
    at += 2 * BLOCKS * span
    swa = arena[at : at + BLOCKS * 7 * 8].view(torch.float64).view(BLOCKS, 7)
    return {"kv": kv, "swa": [swa]}, at + BLOCKS * 7 * 8


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


@pytest.mark.parametrize("padded", [False, True])
def test_the_plan_copies_exactly_the_paired_blocks(padded: bool) -> None:
    arena = torch.randint(0, 256, (8192,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    src, at = _caches(arena, 0, padded)
    dst, _ = _caches(arena, at, padded)
    before = {g: [t.clone() for t in ts] for g, ts in dst.items()}
    local = {"kv": [0, 1, 2, 7, 8], "swa": [9, 3]}
    remote = {"kv": [4, 5, 6, 1, 2], "swa": [0, 1]}
    plan = read_plan(regions(dst), regions(src), local, remote)
    if not padded:
        assert len(plan[0]) == 2 * 2 + 2  # consecutive on both sides: one entry per run and tensor
    base = arena.data_ptr()
    for d, s, n in zip(*plan):
        arena[d - base : d - base + n] = arena[s - base : s - base + n].clone()
    for group, ts in dst.items():
        for t, old, source in zip(ts, before[group], src[group]):
            for b in range(BLOCKS):
                if b in local[group]:
                    expect = source[remote[group][local[group].index(b)]]
                else:
                    expect = old[b]
                assert _raw(t[b]) == _raw(expect), (group, b)  # bytes: random bits make NaNs


def test_views_of_one_allocation_register_once() -> None:
    arena = torch.zeros(8192, dtype=torch.uint8)
    caches, _ = _caches(arena, 0, False)
    assert storages(caches) == [(arena.data_ptr(), 8192)]
    separate = {"a": [torch.zeros(4, 2), torch.zeros(4, 2)]}
    assert len(storages(separate)) == 2


def test_a_block_must_be_contiguous() -> None:
    with pytest.raises(ValueError, match="not contiguous"):
        regions({"kv": [torch.zeros(4, 6, 5)[:, :, :2]]})


def test_settings_pass_through_kv_connector_extra_config() -> None:
    from pypto_serving.config import KVTransferConfig

    extra = {"protocol": "rdma", "device_name": "mlx5_0", "local_hostname": "10.0.0.2", "timeout": 3}
    conn = MooncakeConnector(
        KVTransferConfig(kv_connector="mooncake", kv_role="decode", kv_connector_extra_config=extra)
    )
    assert (conn.protocol, conn.device_name, conn.local_hostname, conn.timeout) == ("rdma", "mlx5_0", "10.0.0.2", 3.0)
    assert conn.metadata_server == "P2PHANDSHAKE"
    default = MooncakeConnector(KVTransferConfig(kv_connector="mooncake", kv_role="prefill", kv_ip="10.0.0.1"))
    assert (default.protocol, default.local_hostname) == ("tcp", "10.0.0.1")
    assert default.pull_threads == 1
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=f"pull_threads={bad!r}: give a count >= 1"):
            extra = {"pull_threads": bad}
            MooncakeConnector(KVTransferConfig(kv_connector="mooncake", kv_connector_extra_config=extra))
    with pytest.raises(ValueError, match="unknown \\['protcol'\\]"):
        MooncakeConnector(KVTransferConfig(kv_connector="mooncake", kv_connector_extra_config={"protcol": "tcp"}))


def test_without_the_transfer_engine_start_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from pypto_serving.config import KVTransferConfig

    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # the import fails, as without the wheel
    conn = MooncakeConnector(KVTransferConfig(kv_connector="mooncake", kv_role="prefill"))
    with pytest.raises(RuntimeError, match=r"pip install 'pypto-serving-mooncake-kv\[cpu\]'"):
        conn.start({"kv": [torch.zeros(4, 8)]})
    conn.close()
