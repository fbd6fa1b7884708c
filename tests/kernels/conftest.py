"""Kernel tests need the pypto-kernels distribution."""

import pytest

pytest.importorskip("pypto_kernels", reason="pypto-kernels not installed")
