"""The model id every holder of one checkpoint derives alike (nodes, backbones, bridges, ledgers)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from ._gguf_path import find_gguf
from .config import ModelConfig


def model_id_for(folder: str | os.PathLike[str], cfg: ModelConfig) -> str:
    """A stable id for a checkpoint, so every holder of the same checkpoint agrees without naming it
    (override with --model-id).

    * A safetensors folder: its architecture plus a hash of its config.json, ``mixtral-76b2c92d8168``.
    * A GGUF checkpoint (a ``.gguf`` file, or a folder holding one and no safetensors, with or without
      the converter's config.json beside it): the same hash of the config.json it embeds, plus how its
      routed experts are encoded, ``mixtral-76b2c92d8168-q8_0``.

    The id promises what an expert call computes.  A Q8_0 expert's outputs differ from the fp16/fp32
    one's by the quantisation error, enough to flip near-tie tokens, so a backbone must not mix the two
    without being told: nodes and a backbone holding the same GGUF (or GGUFs whose experts are encoded
    alike) find each other by default; a backbone on the safetensors folder sees Q8_0 nodes only when
    every side passes the same --model-id, which is how one accepts their numbers.  Every GGUF gets the
    suffix, F32 too: one rule, and the id says what the file holds.  Like the safetensors id, it does not
    hash the weights (that would read the whole checkpoint at start): two fine-tunes with one config.json
    and one encoding share an id.
    """
    gguf_file = find_gguf(folder)
    digest = hashlib.sha256(config_bytes(folder)).hexdigest()[:12]
    if gguf_file is None:
        return f"{cfg.arch}-{digest}"
    from .gguf import GGUFFile  # the gguf package: imported only for GGUF checkpoints

    return f"{cfg.arch}-{digest}-{GGUFFile(gguf_file).expert_encoding(cfg)}"


def config_bytes(folder: str | os.PathLike[str]) -> bytes:
    """The bytes a checkpoint's model id hashes: its config.json, or the config.json a GGUF embeds.
    A holder hands these out (``config_request``), and the swarm catalogue publishes their SHA-256."""
    gguf_file = find_gguf(folder)
    if gguf_file is None:
        return Path(folder, "config.json").read_bytes()
    from .gguf import GGUFFile

    return GGUFFile(gguf_file).config_text().encode("utf-8")


def model_name(path: str | os.PathLike[str]) -> str | None:
    """A human name for the checkpoint at ``path``: config.json's ``name``, else the last part of its
    ``_name_or_path``, else the folder's (or GGUF file's) own name."""
    p = Path(path)
    folder = p.parent if p.name == "config.json" else p
    if folder.is_dir() and (folder / "config.json").is_file():
        with contextlib.suppress(OSError, ValueError):
            raw = json.loads((folder / "config.json").read_text())
            name = config_name(raw)
            if name:
                return name
    return (folder.stem if folder.is_file() else folder.name) or None


def config_name(raw: object) -> str | None:
    """A human name from a parsed config.json: its ``name``, else the last part of ``_name_or_path``."""
    if isinstance(raw, dict):
        for key in ("name", "_name_or_path"):
            if isinstance(raw.get(key), str) and raw[key].strip("/"):
                return str(raw[key]).rstrip("/").rsplit("/", 1)[-1]
    return None
