"""Fixtures for the serving tests: a tiny model with a tokenizer, and a live HTTP API on loopback."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from sdk_support import CHAT_TEMPLATE, MODEL_ID, LiveServer, train_tokenizer

from moeswarm.model import Model, Tokenizer, load_model
from moeswarm.node.service import GenerationService


@pytest.fixture(scope="session")
def sdk_model_dir(oracle_checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The oracle Mixtral checkpoint plus a trained tokenizer and a chat template."""
    src, _ = oracle_checkpoints.get("mixtral", "packed")
    folder = tmp_path_factory.mktemp("sdk") / MODEL_ID
    shutil.copytree(src, folder)
    train_tokenizer(folder)
    config = {"chat_template": CHAT_TEMPLATE, "bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def engine(sdk_model_dir: Path) -> tuple[Model, Tokenizer]:
    model = load_model(sdk_model_dir)
    return model, Tokenizer.from_folder(sdk_model_dir, model.config.bos_token_id)


@pytest.fixture(scope="session")
def server(engine: tuple[Model, Tokenizer]) -> Iterator[LiveServer]:
    """The API over the tiny model, one generation at a time."""
    model, tokenizer = engine
    with LiveServer(GenerationService(model, tokenizer, MODEL_ID, max_concurrent=1)) as live:
        yield live
