"""Tokenizers from the model folder: ``tokenizer.json`` (the ``tokenizers`` library) or a
SentencePiece ``tokenizer.model`` (Mistral/Mixtral).  Decoding is incremental so text can be
streamed token by token without splitting multi-byte characters."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import CheckpointError


class Tokenizer:
    def __init__(self, encode_fn, decode_fn, bos_id: int | None, add_bos: bool) -> None:  # type: ignore[no-untyped-def]
        self._encode = encode_fn
        self._decode = decode_fn
        self.bos_id = bos_id
        self.add_bos = add_bos

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str], bos_id: int | None = None) -> "Tokenizer":
        folder = Path(folder)
        if (folder / "tokenizer.json").exists():
            from tokenizers import Tokenizer as HFTokenizer

            path = folder / "tokenizer.json"
            try:
                tok = HFTokenizer.from_file(str(path))
            except Exception as e:  # the library raises a bare Exception on malformed files
                raise CheckpointError(f"cannot read tokenizer: {e}", path=str(path)) from None
            # tokenizer.json carries its own post-processor: it adds <s> itself when the model wants it
            return cls(
                lambda s: tok.encode(s, add_special_tokens=True).ids,
                lambda ids: tok.decode(ids, skip_special_tokens=True),
                bos_id,
                False,
            )
        if (folder / "tokenizer.model").exists():
            import sentencepiece as spm

            path = folder / "tokenizer.model"
            try:
                sp = spm.SentencePieceProcessor(model_file=str(path))
            except (OSError, RuntimeError) as e:
                raise CheckpointError(f"cannot read SentencePiece model: {e}", path=str(path)) from None
            sp_bos = sp.bos_id()
            special = {i for i in (sp.bos_id(), sp.eos_id(), sp.pad_id(), sp.unk_id()) if i >= 0} - {sp.unk_id()}
            return cls(
                lambda s: sp.encode(s),
                lambda ids: sp.decode([i for i in ids if i not in special]),
                sp_bos if sp_bos >= 0 else bos_id,
                sp_bos >= 0,  # Llama/Mistral convention: prompts start with <s>
            )
        raise CheckpointError("no tokenizer.json or tokenizer.model in the model folder", path=str(folder))

    def encode(self, text: str) -> list[int]:
        ids = list(self._encode(text))
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        return str(self._decode(list(ids)))

    def stream(self, prefix: list[int] | None = None) -> "StreamDecoder":
        """A decoder for text that continues ``prefix`` (the prompt), so spacing comes out right."""
        return StreamDecoder(self, prefix or [])


class StreamDecoder:
    """Feed token ids one at a time; get back the text they complete (possibly empty).

    Decodes a short window (the last few settled tokens plus the new ones) and emits what the new
    tokens add, the way text-generation servers do: SentencePiece drops a leading space at the
    start of a decode, and a byte-level token may end inside a UTF-8 character.
    """

    def __init__(self, tokenizer: Tokenizer, prefix: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prefix)
        self.prefix_offset = max(0, len(self.ids) - 6)
        self.read_offset = len(self.ids)

    def feed(self, token_id: int) -> str:
        self.ids.append(token_id)
        settled = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(text) <= len(settled) or text.endswith("\ufffd"):  # incomplete character: wait
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(settled) :]
