"""The ``mooncake`` KV connector's tests need its plugin; those moving KV also need Mooncake's
transfer engine importable (``mooncake_engine`` below)."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "pypto_serving_mooncake_kv",
    reason="plugin mooncake_kv (pip install 'plugins/mooncake_kv[cpu]') not installed",
)


def mooncake_engine_missing() -> str | None:
    """Why Mooncake's transfer engine cannot be used here, or None when it imports."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as e:  # not installed, or a system library missing (libibverbs.so.1)
        return f"Mooncake's transfer engine does not import here: {e}"
    return None
