"""DeepSeek-V4 model configuration read straight from ``config.json``.

We parse the JSON ourselves instead of importing transformers so the worker does not need it at
runtime; the defaults and legacy-key folding follow the published DeepSeek-V4 config semantics.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
SCORING_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")


class DeepseekConfigError(ValueError):
    """The checkpoint's config.json cannot be served by this executor."""


@dataclass
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    rope_head_dim: int
    num_experts_per_tok: int
    n_routed_experts: int
    scoring_func: str
    routed_scaling_factor: float
    max_position_embeddings: int
    layer_types: list[str]
    mlp_layer_types: list[str]
    compress_rates: dict[str, int]
    rope_main: dict[str, Any]
    rope_compress: dict[str, Any]
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_nextn_predict_layers: int
    rms_norm_eps: float
    torch_dtype: str
    eos_token_ids: list[int] = field(default_factory=list)
    tie_word_embeddings: bool = False

    @property
    def csa_rate(self) -> int:
        return int(self.compress_rates[CSA])

    @property
    def hca_rate(self) -> int:
        return int(self.compress_rates[HCA])


def load_config(model_dir: str | Path) -> DeepseekV4Config:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise DeepseekConfigError(f"{path} does not exist")
    return parse_config(json.loads(path.read_text()))


def parse_config(raw: dict[str, Any]) -> DeepseekV4Config:
    """Fold defaults and legacy keys, then validate everything the executor relies on."""
    n = int(raw.get("num_hidden_layers", 43))
    head_dim = int(raw.get("head_dim", 512))
    compress_rates = dict(raw.get("compress_rates") or {CSA: 4, HCA: 128})
    if raw.get("compress_rate_csa") is not None:
        compress_rates[CSA] = int(raw["compress_rate_csa"])
    if raw.get("compress_rate_hca") is not None:
        compress_rates[HCA] = int(raw["compress_rate_hca"])

    layer_types = raw.get("layer_types")
    if layer_types is None and raw.get("compress_ratios") is not None:
        ratios = raw["compress_ratios"]
        unknown = [r for r in ratios if r not in _RATIO_TO_TYPE]
        if unknown:
            raise DeepseekConfigError(f"config.json compress_ratios has unsupported values {unknown}")
        layer_types = [_RATIO_TO_TYPE[r] for r in ratios]
    if layer_types is None:
        layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    layer_types = list(layer_types)[:n]
    bad = sorted({t for t in layer_types if t not in LAYER_TYPES})
    if bad:
        raise DeepseekConfigError(
            f"config.json layer_types has unknown entries {bad}; this executor supports {list(LAYER_TYPES)}"
        )
    if len(layer_types) != n:
        raise DeepseekConfigError(f"config.json layer_types has {len(layer_types)} entries for {n} layers")

    mlp_types = raw.get("mlp_layer_types")
    if mlp_types is None:
        n_hash = int(raw.get("num_hash_layers", 3))
        mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    mlp_types = list(mlp_types)[:n]
    bad = sorted({t for t in mlp_types if t not in MLP_LAYER_TYPES})
    if bad or len(mlp_types) != n:
        raise DeepseekConfigError(
            f"config.json mlp_layer_types must list {n} entries of {list(MLP_LAYER_TYPES)}; got {mlp_types}"
        )
    for kind in {t for t in layer_types if t != SLIDING}:
        rate = int(compress_rates.get(kind, 0))
        if rate < 1:
            raise DeepseekConfigError(f"config.json compress_rates[{kind!r}] must be a positive integer")

    partial = raw.get("partial_rotary_factor")
    if partial is None:
        qk_rope = raw.get("qk_rope_head_dim")
        partial = (qk_rope / head_dim) if qk_rope is not None else 64 / 512
    rope_dim = int(head_dim * partial)
    if rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim:
        raise DeepseekConfigError(f"rotary dim {rope_dim} (head_dim * partial_rotary_factor) must be even and > 0")

    rp = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, compress = dict(rp["main"]), dict(rp["compress"])
    else:
        # Flat rope params describe the compressed branch's scaling (YaRN); the main rope is plain.
        flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)}
        compress = {**flat, "rope_theta": raw.get("compress_rope_theta", 160000.0)}
        compress.setdefault("rope_type", compress.get("type", "default"))
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)

    scoring = str(raw.get("scoring_func", "sqrtsoftplus"))
    if scoring not in SCORING_FUNCS:
        raise DeepseekConfigError(f"config.json scoring_func {scoring!r} is not one of {list(SCORING_FUNCS)}")
    eos = raw.get("eos_token_id", 1)
    eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    heads = int(raw.get("num_attention_heads", 64))
    o_groups = int(raw.get("o_groups", 8))
    if heads % o_groups:
        raise DeepseekConfigError(f"num_attention_heads {heads} is not divisible by o_groups {o_groups}")

    return DeepseekV4Config(
        vocab_size=int(raw.get("vocab_size", 129280)),
        hidden_size=int(raw.get("hidden_size", 4096)),
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 2048)),
        num_hidden_layers=n,
        num_attention_heads=heads,
        head_dim=head_dim,
        q_lora_rank=int(raw.get("q_lora_rank", 1024)),
        rope_head_dim=rope_dim,
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 6)),
        n_routed_experts=int(raw.get("n_routed_experts", 256)),
        scoring_func=scoring,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 1048576)),
        layer_types=layer_types,
        mlp_layer_types=mlp_types,
        compress_rates={k: int(v) for k, v in compress_rates.items()},
        rope_main=main,
        rope_compress=compress,
        hc_mult=int(raw.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(raw.get("hc_eps", 1e-6)),
        swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
        sliding_window=int(raw.get("sliding_window", 128)),
        o_groups=o_groups,
        o_lora_rank=int(raw.get("o_lora_rank", 1024)),
        index_n_heads=int(raw.get("index_n_heads", 64)),
        index_head_dim=int(raw.get("index_head_dim", 128)),
        index_topk=int(raw.get("index_topk", 512)),
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers", 1)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
        eos_token_ids=eos_ids,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )
