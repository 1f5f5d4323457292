"""Oracle test fixtures: one tiny dummy model shared by the honest run and the mutants."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="package", autouse=True)
def one_thread():
    """Two shared CPU cores: a second OpenMP thread slows these small ops down by 10x or more."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="package")
def tiny_config(tmp_path_factory):
    from tests.helpers import write_config

    return write_config(tmp_path_factory.mktemp("oracle_tiny"))


@pytest.fixture(scope="package")
def tiny(tiny_config):
    """Engine (fp32, CPU) and reference on the same dummy weights, with the quick suite."""
    from metainfer.oracle.build import build_setup

    return build_setup(f"dummy:{tiny_config}", "quick", {"device": "cpu"})
