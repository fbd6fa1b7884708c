from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip(
    "pypto_serving_deepseek_mtp",
    reason="plugin deepseek_mtp (pip install pypto-serving-deepseek-mtp) not installed",
)
pytest.importorskip("transformers.models.deepseek_v4")

from .helpers import Checkpoint, build_checkpoint

# Each variant exercises a different mix: layer types, routing, hc_mult, rates, scoring, RoPE scaling.
VARIANTS = {
    "mixed_yarn": dict(
        n_mtp=2,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "csa_heavy": dict(
        n_mtp=1,
        seed=1,
        num_hidden_layers=4,
        hc_mult=3,
        scoring_func="sigmoid",
        sliding_window=6,
        layer_types=[
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
            "sliding_attention",
        ],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        index_topk=3,
    ),
    "sliding_only": dict(
        n_mtp=0,
        seed=2,
        num_hidden_layers=2,
        hc_mult=1,
        layer_types=["sliding_attention", "sliding_attention"],
        mlp_layer_types=["moe", "hash_moe"],
    ),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    out = {}
    for name, kw in VARIANTS.items():
        out[name] = build_checkpoint(Path(tmp_path_factory.mktemp(name)), **kw)
    return out
