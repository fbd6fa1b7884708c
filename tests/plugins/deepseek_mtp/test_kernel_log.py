"""Loading says which implementation runs each attention layer kind's kernels."""

from __future__ import annotations

import logging
from typing import Any

from tests.plugins.deepseek_mtp.helpers import make_executor


def test_load_logs_the_kernels_of_each_layer_kind(checkpoints: dict[str, Any], caplog: Any) -> None:
    caplog.set_level(logging.INFO, logger="pypto_serving_deepseek_mtp.executor")
    make_executor(checkpoints["csa_heavy"].path)
    lines = [r.getMessage() for r in caplog.records]
    assert (
        "compressed_sparse_attention layers: compressor_pool runs reference, indexer_topk runs reference, "
        "sink_attention runs reference"
    ) in lines
    assert "heavily_compressed_attention layers: compressor_pool runs reference, sink_attention runs reference" in lines
    assert "sliding_attention layers: sink_attention runs reference" in lines
