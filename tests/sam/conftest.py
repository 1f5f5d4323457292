"""Shared fixtures: a tiny dummy model (every structural feature, peaked weights) and its tokenizer."""

from __future__ import annotations

import json

import pytest

from metainfer.sam.build import DEFAULT_DIR
from metainfer.sam.config import tiny_config
from metainfer.sam.tokenizer import PromptTokenizer
from metainfer.sam.weights import dummy_model


@pytest.fixture(scope="session")
def tiny():
    return dummy_model(tiny_config(), "cpu", seed=0)


@pytest.fixture(scope="session")
def tok():
    return PromptTokenizer.from_dir(DEFAULT_DIR, tiny_config().text_context)


@pytest.fixture(scope="session")
def tiny_json(tmp_path_factory):
    p = tmp_path_factory.mktemp("sam") / "tiny.json"
    p.write_text(json.dumps(tiny_config().to_hf()))
    return str(p)
