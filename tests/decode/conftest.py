"""The decode tests' fixtures (beside tests/conftest.py's)."""

import pytest

from mtp.model import MTPModel

pytest.register_assert_rewrite("decode.common")  # its checks explain their failures too


@pytest.fixture
def random_model(tiny_config):
    """The tiny config's untrained model, in float64."""
    return MTPModel(tiny_config).double().eval()
