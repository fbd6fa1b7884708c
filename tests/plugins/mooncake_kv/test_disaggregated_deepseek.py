"""The tiny DeepSeek-V4 with MTP through the ``mooncake`` connector: every cache group a transferred
prefix hit needs (the sliding window, the compressed and indexer caches, the CSA snapshot; each group
one allocation of per-layer views) is read over Mooncake's TCP transport, and the decode engine's
greedy tokens (MTP on; a request starting at a hit drafts only once its MTP state has rebuilt,
docs/deepseek_mtp.md) equal co-located serving (see tests/plugins/deepseek_mtp/test_disaggregated.py
for the hit arithmetic)."""

from __future__ import annotations

import pytest

from pypto_serving import LLM, SamplingParams

from ..deepseek_mtp.test_disaggregated import COMMON, PROMPTS, UNIT, _params
from ..qwen.test_disaggregated import _all_blocks, _free_blocks
from .conftest import mooncake_engine_missing
from .test_disaggregated import MOONCAKE, _settle

_why = mooncake_engine_missing()
pytestmark = [
    pytest.mark.skipif(_why is not None, reason=_why or ""),
    pytest.mark.requires_plugin("deepseek_mtp"),
    pytest.mark.requires_plugin("sync_sched"),
]


def test_deepseek_mtp_decode_continues_from_the_read_hit() -> None:
    prompt = PROMPTS[0]  # 100 tokens: the first 64 (one hit unit) move
    with (
        LLM(kv_role="prefill", worker_mode="process", kv_transfer_config=MOONCAKE, **COMMON) as p,
        LLM(kv_role="decode", worker_mode="inproc", kv_transfer_config=MOONCAKE, **COMMON) as d,
    ):
        first = SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        (offer,) = [o.kv_transfer_params for o in p.generate([prompt], first, use_tqdm=False)]
        assert offer is not None and offer["num_tokens"] == UNIT
        out = d.generate([prompt], _params(False, kv_transfer_params=offer), use_tqdm=False)[0]
        (ref,) = p.generate([prompt], _params(False), use_tqdm=False)
        assert out.outputs[0].error is None
        assert out.num_cached_tokens == UNIT  # the KV came over, not recomputed
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert _free_blocks(d) == _all_blocks(d)
        _settle(p)
        assert _free_blocks(p) == _all_blocks(p)
