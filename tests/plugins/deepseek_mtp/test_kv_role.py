"""DeepSeek-V4 keeps per-request state outside its paged blocks (compressor rings, the MTP carry), so
its KV cannot be moved between engines yet: a kv_role is refused at start-up, naming why."""

from __future__ import annotations

import pytest

pytest.importorskip("pypto_serving_deepseek_mtp")


def test_a_kv_role_is_refused_with_the_reason() -> None:
    from pypto_serving import LLM

    with pytest.raises(Exception, match=r"DeepseekMTPExecutor cannot move its KV cache.*unset kv_role"):
        LLM(model="tiny-deepseek-v4", kv_role="decode", device="cpu", worker_mode="inproc", num_kv_blocks=64)
