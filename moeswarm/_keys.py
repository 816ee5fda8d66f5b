"""Ed25519 keys kept in files: a 32-byte seed, created with mode 0600 (nodes, relays, bridges, ledgers)."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ConfigError
from .protocol import Identity


def load_key_file(path: str | os.PathLike[str], *, create: bool, what: str = "key file",
                  missing_hint: str = "") -> Identity:
    """The identity whose seed ``path`` holds; a new one written there (mode 0600) if the file
    is missing and ``create``, else ``ConfigError`` ("no {what} at {path}{missing_hint}")."""
    p = Path(path)
    if p.exists():
        seed = p.read_bytes()
        if len(seed) != 32:
            raise ConfigError(f"{what} {p} must hold a 32-byte Ed25519 seed, not {len(seed)} bytes")
        return Identity.from_seed(seed)
    if not create:
        raise ConfigError(f"no {what} at {p}{missing_hint}")
    identity = Identity.generate()
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise ConfigError(f"cannot create {what} {p}: {e.strerror}") from None
    with os.fdopen(fd, "wb") as fh:
        fh.write(identity.seed())
    return identity
