"""The one exception tree of moeswarm, split by whose fault it is.

``SwarmError`` is the root.  Below it:

* ``ConfigError``: local misuse -- a bad flag, a missing file, an unsupported model.
  ``CheckpointError`` narrows it to a model folder whose files are missing, truncated or
  disagree with their config; it names the file and the tensor.
* ``ProtocolError``: the peer sent something that does not follow ``protocol_spec/``.
  ``BadResponse`` narrows it to a well-formed answer that is wrong (bad signature, wrong shape).
* ``NetworkError``: the network failed us -- ``Unreachable`` and ``Timeout``.

Library exceptions are translated into these at the boundary of the module that uses the library.
"""

from __future__ import annotations


class SwarmError(Exception):
    """Root of every error moeswarm raises on purpose."""


class ConfigError(SwarmError):
    """Local misuse: bad arguments, missing files, unsupported configurations."""


class CheckpointError(ConfigError):
    """A model folder is unusable: names the file (and the tensor, when one is at fault)."""

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None) -> None:
        self.path = path
        self.tensor = tensor
        where = ", ".join(p for p in (f"file {path}" if path else "", f"tensor {tensor}" if tensor else "") if p)
        super().__init__(f"{message} ({where})" if where else message)


class ProtocolError(SwarmError):
    """The peer broke the protocol: malformed frame, bad field, oversized message."""

    def __init__(self, message: str, *, code: int = 1) -> None:
        self.code = code
        super().__init__(message)


class BadResponse(ProtocolError):
    """A well-formed answer that is wrong: forged signature, wrong shape, NaNs."""


class NetworkError(SwarmError):
    """The network failed: the peer could not be reached or did not answer in time."""


class Unreachable(NetworkError):
    """No connection could be made to the peer."""


class Timeout(NetworkError):
    """The peer did not answer within the deadline."""
