"""Tokenizers from a model folder, checked against independent implementations."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from moeswarm.errors import CheckpointError
from moeswarm.model import Tokenizer

TEXTS = ["Hello world, naïve café 日本", "  leading spaces\nand\ttabs", "In the beginning God created", "x" * 50, "🙂 emoji"]


@pytest.fixture(scope="module")
def mixtral_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """The Mixtral-8x7B SentencePiece model that ships inside the mistral-common wheel."""
    import mistral_common
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    src = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    folder = tmp_path_factory.mktemp("mixtral_tok")
    shutil.copy(src, folder / "tokenizer.model")
    return folder, MistralTokenizer.from_file(str(src)).instruct_tokenizer.tokenizer


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [Path(os.__file__).read_text()] * 2 + TEXTS
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path_factory.mktemp("bpe")
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_matches_mistral_common(mixtral_tokenizer, text: str) -> None:
    folder, oracle = mixtral_tokenizer
    ours = Tokenizer.from_folder(folder)
    ids = ours.encode(text)
    assert ids == oracle.encode(text, bos=True, eos=False)  # type: ignore[attr-defined]
    assert ours.decode(ids) == oracle.decode(ids)  # type: ignore[attr-defined]


def test_tokenizer_json_round_trips(bpe_folder: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    ours = Tokenizer.from_folder(bpe_folder)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(bpe_folder / "tokenizer.json"))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"]
        assert ours.decode(ids) == text


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=40), st.integers(0, 5))
def test_streaming_equals_one_decode(bpe_folder: Path, text: str, split: int) -> None:
    tok = Tokenizer.from_folder(bpe_folder)
    ids = tok.encode(text)
    split = min(split, len(ids))
    assume(not tok.decode(ids[:split]).endswith("\ufffd"))  # a prompt cut inside a character
    stream = tok.stream(ids[:split])
    pieces = "".join(stream.feed(i) for i in ids[split:])
    assert tok.decode(ids[:split]) + pieces == tok.decode(ids)


def test_streaming_keeps_sentencepiece_spaces(mixtral_tokenizer) -> None:
    folder, _ = mixtral_tokenizer
    tok = Tokenizer.from_folder(folder)
    ids = tok.encode("And it came to pass that the king said")
    stream = tok.stream(ids[:5])
    assert tok.decode(ids[:5]) + "".join(stream.feed(i) for i in ids[5:]) == "And it came to pass that the king said"


def test_no_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no tokenizer"):
        Tokenizer.from_folder(tmp_path)
