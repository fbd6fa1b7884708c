"""A DeepSeek-V4 prefill engine offers prefix-cache hits on a request's own blocks (its window blocks
given back during the prefill come back from the prefix cache), so it needs prefix caching: without
it a ``kv_role`` that sends is refused at start-up, naming why (a decode engine needs none)."""

from __future__ import annotations

import pytest

pytest.importorskip("pypto_serving_deepseek_mtp")


def test_a_prefill_role_without_prefix_caching_is_refused_with_the_reason() -> None:
    from pypto_serving import LLM

    common = dict(model="tiny-deepseek-v4", device="cpu", worker_mode="inproc", num_kv_blocks=64)
    with pytest.raises(Exception, match=r"sliding-window or snapshot .*needs enable_prefix_caching"):
        LLM(kv_role="prefill", enable_prefix_caching=False, **common)
    with LLM(kv_role="decode", enable_prefix_caching=False, **common) as decode:
        assert decode._engine().kvx is not None
