"""``convert-gguf`` writes the tokenizer as llama.cpp reads it (``tokenizer.ggml.*``), checked against
independent tokenizer implementations: transformers' fast tokenizer for a byte-level BPE (the shipped demo)
and mistral-common's Mixtral SentencePiece model.  (That llama.cpp itself loads these files and decodes the
same tokens is shown by benchmarks/llamacpp.py, which needs llama-cpp-python.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import pytest
from gguf import TokenType

from moeswarm.demo import CHECKPOINT
from moeswarm.model._gguf_vocab import pre_tokenizer_name
from moeswarm.model.gguf import convert_to_gguf
from moeswarm.model.synthetic import random_mixtral


def metadata(path: Path) -> dict[str, object]:
    reader = gguf.GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items() if name.startswith("tokenizer.")}


def test_byte_level_bpe_as_llama_cpp_reads_it(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    meta = metadata(convert_to_gguf(CHECKPOINT, tmp_path / "demo.gguf", weight_type="F16", sidecar=False).path)
    tok = AutoTokenizer.from_pretrained(CHECKPOINT)
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "gpt-2"  # ByteLevel with GPT-2's regex, nothing else
    tokens = meta["tokenizer.ggml.tokens"]
    assert tokens == tok.convert_ids_to_tokens(list(range(len(tok))))
    types = meta["tokenizer.ggml.token_type"]
    special = set(tok.all_special_ids)
    assert [i for i, t in enumerate(types) if t == TokenType.CONTROL] == sorted(special)
    assert all(t == TokenType.NORMAL for i, t in enumerate(types) if i not in special)
    merges = json.loads((CHECKPOINT / "tokenizer.json").read_text())["model"]["merges"]
    assert meta["tokenizer.ggml.merges"] == [m if isinstance(m, str) else " ".join(m) for m in merges]
    assert meta["tokenizer.ggml.bos_token_id"] == tok.bos_token_id
    assert meta["tokenizer.ggml.eos_token_id"] == tok.eos_token_id
    assert meta["tokenizer.ggml.padding_token_id"] == tok.pad_token_id


def test_sentencepiece_as_llama_cpp_reads_it(tmp_path: Path) -> None:
    import mistral_common
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    spm = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"  # Mixtral-8x7B's tokenizer
    folder = random_mixtral(tmp_path / "m", hidden=64, inter=64, layers=1, experts=2, vocab=32000, heads=4,
                            kv_heads=2)
    shutil.copyfile(spm, folder / "tokenizer.model")
    meta = metadata(convert_to_gguf(folder, tmp_path / "m.gguf", weight_type="F16", sidecar=False).path)
    ref = MistralTokenizer.from_file(str(spm)).instruct_tokenizer.tokenizer
    assert meta["tokenizer.ggml.model"] == "llama" and "tokenizer.ggml.pre" not in meta
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == ref.n_words == 32000
    assert tokens == [ref.id_to_piece(i) for i in range(ref.n_words)]
    types = meta["tokenizer.ggml.token_type"]
    assert types[ref.bos_id] == types[ref.eos_id] == TokenType.CONTROL
    assert types[0] == TokenType.UNKNOWN and tokens[0] == "<unk>"
    assert [i for i, t in enumerate(types) if t == TokenType.BYTE] == list(range(3, 3 + 256))  # <0x00>..<0xFF>
    assert meta["tokenizer.ggml.bos_token_id"] == ref.bos_id and meta["tokenizer.ggml.eos_token_id"] == ref.eos_id
    scores = meta["tokenizer.ggml.scores"]
    assert len(scores) == 32000 and scores[1000] > scores[20000]  # merge priority: earlier pieces score higher


@pytest.mark.parametrize(("regex", "name"), [
    (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
     "qwen2"),
    (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
     r"\s+(?!\S)|\s+", "llama-bpe"),
    (r"\p{L}+|\p{N}", "default"),  # a regex llama.cpp has no name for: its default pre-tokenizer
])
def test_pre_tokenizer_names_follow_the_split_regex(regex: str, name: str) -> None:
    tokenizer_json = {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}}
    assert pre_tokenizer_name(tokenizer_json) == name
