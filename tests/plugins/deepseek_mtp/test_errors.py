"""Clear start-up errors."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from pypto_serving_deepseek_mtp import DeepseekConfigError, DeepseekMTPExecutor, MtpConfigError, parse_config

from .helpers import make_executor


def _settings(path, k=None, method="mtp"):
    spec = None if k is None else SimpleNamespace(method=method, num_speculative_tokens=k)
    return SimpleNamespace(
        model=str(path),
        dtype="float32",
        device="cpu",
        block_size=4,
        max_model_len=None,
        speculative_config=spec,
        max_num_seqs=2,
    )


def test_mtp_without_mtp_weights(checkpoints):
    with pytest.raises(MtpConfigError, match=r"no\s+mtp\.0\.\* tensors"):
        make_executor(checkpoints["sliding_only"].path, k=1)


@pytest.mark.parametrize("k", [0, 9])
def test_num_speculative_tokens_out_of_range(checkpoints, k):
    with pytest.raises(MtpConfigError, match="out of range"):
        DeepseekMTPExecutor(_settings(checkpoints["mixed_yarn"].path, k=k)).load()


def test_unknown_speculative_method(checkpoints):
    with pytest.raises(MtpConfigError, match=r"method='ngram' is not supported by the deepseek_mtp executor"):
        DeepseekMTPExecutor(_settings(checkpoints["mixed_yarn"].path, k=1, method="ngram")).load()


def test_unknown_layer_type(checkpoints, tmp_path):
    src = checkpoints["sliding_only"].path
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["layer_types"] = ["sliding_attention", "linear_attention"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DeepseekConfigError, match="linear_attention"):
        DeepseekMTPExecutor(_settings(tmp_path)).load()


def test_cache_groups_and_prefix_caching(checkpoints):
    _, info = make_executor(checkpoints["mixed_yarn"].path, k=2)
    groups = {g.name: g for g in info.cache_groups}
    assert set(groups) == {"swa", "csa_kv", "csa_index", "csa_state", "hca_kv", "mtp0", "mtp1", "mtp_state"}
    assert groups["csa_kv"].tokens_per_entry == 2 and groups["hca_kv"].tokens_per_entry == 4
    # Every group serves exact prefix hits. What a hit at p needs: the sliding window before p (4
    # tokens: positions p-3..p-1), every compressed entry and indexer key, the one CSA compressor
    # snapshot ending at p (one per CSA block: 4 entries of 2 tokens), each MTP depth's window
    # before entry p (its position i at entry i + d + 1) and the one MTP input snapshot ending at p
    # (one per hit unit, 16 tokens).
    assert all(g.prefix_caching and not g.no_prefix_caching_reason for g in info.cache_groups)
    lookback = {name: g.hit_lookback for name, g in groups.items()}
    assert lookback == {
        "swa": 3,
        "csa_kv": None,
        "csa_index": None,
        "csa_state": 1,
        "hca_kv": None,
        "mtp0": 3,
        "mtp1": 3,
        "mtp_state": 1,
    }
    assert [groups[f"mtp{d}"].slot_shift for d in range(2)] == [1, 2]
    assert groups["mtp_state"].tokens_per_block == 16
    assert groups["csa_state"].tokens_per_block == groups["csa_kv"].tokens_per_block == 8
    _, plain = make_executor(checkpoints["sliding_only"].path)
    assert [(g.name, g.prefix_caching) for g in plain.cache_groups] == [("swa", True)]


def test_legacy_config_keys():
    cfg = parse_config(
        {
            "num_hidden_layers": 3,
            "compress_ratios": [0, 4, 128],
            "num_hash_layers": 1,
            "qk_rope_head_dim": 64,
            "head_dim": 512,
        }
    )
    assert cfg.layer_types == [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ]
    assert cfg.mlp_layer_types == ["hash_moe", "moe", "moe"] and cfg.rope_head_dim == 64
