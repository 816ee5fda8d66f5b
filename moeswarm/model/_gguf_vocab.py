"""The tokenizer as llama.cpp reads it: ``tokenizer.ggml.*`` metadata, written the way its converter does.

``convert_hf_to_gguf.py`` (llama.cpp) stores the vocabulary as token strings, scores and types, plus the
BPE merges, the pre-tokenizer's name, the special token ids, the add-BOS/EOS flags and the chat template.
Without ``tokenizer.ggml.model`` llama.cpp refuses the file.  The vocabulary readers of the ``gguf``
package do the reading (``SentencePieceVocab`` for ``tokenizer.model``, ``BpeVocab`` for a byte-level BPE
``tokenizer.json``, ``LlamaHfVocab`` for a SentencePiece-style one), ``SpecialVocab`` the special tokens,
merges and chat template, as in llama.cpp's converter.  Two things are done here the way the converter
does them: added tokens marked ``special`` become CONTROL tokens, other added tokens USER_DEFINED, and ids
past the tokenizer's end up to the model's vocab size are ``[PAD{i}]`` UNUSED tokens.

The pre-tokenizer name (``tokenizer.ggml.pre``) selects llama.cpp's split regex.  llama.cpp's converter
recognises a model by hashing the ids of a test string; this module matches the tokenizer.json's split
regex to the one llama.cpp's name stands for (so any model with that regex gets it), ``gpt-2`` for a plain
byte-level BPE, else ``default``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import gguf
from gguf import GGUFWriter, TokenType

# tokenizer.json Split patterns -> llama.cpp's pre-tokenizer names (src/llama-vocab.cpp regexes)
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_BY_REGEX = {_QWEN2: "qwen2", _LLAMA3: "llama-bpe"}


def pre_tokenizer_name(tokenizer_json: dict[str, Any]) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for a BPE tokenizer.json."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    for step in steps:
        if step.get("type") == "Split":
            regex = (step.get("pattern") or {}).get("Regex")
            if regex in PRE_BY_REGEX:
                return PRE_BY_REGEX[regex]
            return "default"
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel" and steps[0].get("use_regex", True):
        return "gpt-2"
    return "default"


def _vocab(base: Path) -> Any:
    """The gguf package's reader for the tokenizer in ``base``, or None."""
    readers = [gguf.vocab.SentencePieceVocab, gguf.vocab.BpeVocab, gguf.vocab.LlamaHfVocab]
    for reader in readers:
        try:
            return reader(base)
        except (FileNotFoundError, ValueError, RuntimeError, KeyError, TypeError):
            continue
    return None


def write_vocab(writer: GGUFWriter, files: dict[str, str], n_vocab: int, spm_model: Path | None = None) -> bool:
    """Add ``tokenizer.ggml.*`` for the tokenizer in ``files`` (name -> text: tokenizer.json,
    tokenizer_config.json, config.json...) and ``spm_model`` (a SentencePiece ``tokenizer.model``).
    Returns False (and writes nothing) when there is no tokenizer it can read."""
    with tempfile.TemporaryDirectory(prefix="moeswarm-vocab-") as tmp:
        base = Path(tmp)
        for name, text in files.items():
            (base / name).write_text(text, encoding="utf-8")
        if spm_model is not None and spm_model.is_file():
            shutil.copyfile(spm_model, base / "tokenizer.model")
        vocab = _vocab(base)
        if vocab is None:
            return False
        tokens: list[Any] = []
        scores: list[float] = []
        types: list[int] = []
        for text, score, kind in vocab.all_tokens():
            tokens.append(text)
            scores.append(float(score))
            types.append(int(kind))
        tokenizer_json = json.loads(files["tokenizer.json"]) if "tokenizer.json" in files else {}
        for added in tokenizer_json.get("added_tokens", []):  # as llama.cpp's get_vocab_base marks them
            i = int(added["id"])
            if i < len(types):
                types[i] = int(TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED)
        for i in range(len(tokens), n_vocab):  # the embedding has rows the tokenizer never produces
            tokens.append(f"[PAD{i}]")
            scores.append(-1000.0)
            types.append(int(TokenType.UNUSED))
        writer.add_tokenizer_model(vocab.tokenizer_model)
        if vocab.tokenizer_model == "gpt2":
            writer.add_tokenizer_pre(pre_tokenizer_name(tokenizer_json))
        writer.add_token_list(tokens)
        if vocab.tokenizer_model == "llama":
            writer.add_token_scores(scores)
        writer.add_token_types(types)
        special = gguf.SpecialVocab(base, load_merges=vocab.tokenizer_model == "gpt2", n_vocab=len(tokens))
        special.add_to_gguf(writer, quiet=True)
    return True


__all__ = ["PRE_BY_REGEX", "pre_tokenizer_name", "write_vocab"]
