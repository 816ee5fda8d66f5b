"""The data-plane handshake as two sans-I/O state machines.

    client                                   server
    Hello{versions, peer_id, public_key, nonce}  ->
                 <-  HelloAck{version, peer_id, public_key, nonce, sig=server's transcript sig}
    Auth{sig=client's transcript sig}             ->
    (requests may follow Auth at once, without waiting)

Both signatures cover the same transcript (both nonces, both peer IDs, the client's offered
versions, the chosen version, the channel binding) and differ only in ``role``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from moeswarm.errors import ConfigError, ProtocolError

from ._identity import Identity, peer_id_from_public_key, verify_body
from ._limits import MAX_CHANNEL_BINDING_BYTES, NONCE_SIZE, SUPPORTED_VERSIONS, ErrorCode, SignatureKind
from ._messages import Auth, Hello, HelloAck
from ._wire import sorted_map


def auth_transcript(
    *,
    role: str,
    version: int,
    client_versions: Sequence[int],
    client_peer: bytes,
    server_peer: bytes,
    client_nonce: bytes,
    server_nonce: bytes,
    channel_binding: bytes,
) -> dict[str, Any]:
    """The map each side signs (domain ``auth``); ``role`` is ``"client"`` or ``"server"``."""
    return sorted_map({
        "channel_binding": channel_binding, "client_nonce": client_nonce,
        "client_peer": client_peer, "client_versions": list(client_versions),
        "role": role, "server_nonce": server_nonce, "server_peer": server_peer,
        "version": version,
    })


def _auth_failed(message: str) -> ProtocolError:
    return ProtocolError(message, code=ErrorCode.AUTH_FAILED)


def _check_key(peer_id: bytes, public_key: bytes, who: str) -> None:
    if peer_id_from_public_key(public_key) != peer_id:
        raise _auth_failed(f"{who} public key does not match its peer ID")


def _nonce(nonce: bytes | None) -> bytes:
    nonce = os.urandom(NONCE_SIZE) if nonce is None else nonce
    if len(nonce) != NONCE_SIZE:
        raise ConfigError(f"a nonce has {NONCE_SIZE} bytes")
    return nonce


def _binding(channel_binding: bytes) -> bytes:
    if len(channel_binding) > MAX_CHANNEL_BINDING_BYTES:
        raise ConfigError(f"channel binding longer than {MAX_CHANNEL_BINDING_BYTES} bytes")
    return bytes(channel_binding)


class ClientHandshake:
    """The dialing side. Send ``hello``, feed the ``HelloAck`` to ``receive_ack``, send its ``Auth``.

    ``expected_server`` is the peer ID the client meant to reach (from its signed
    announcement); leave it ``None`` only when any server will do.
    """

    def __init__(
        self,
        identity: Identity,
        *,
        expected_server: bytes | None = None,
        versions: Sequence[int] = SUPPORTED_VERSIONS,
        channel_binding: bytes = b"",
        nonce: bytes | None = None,
    ) -> None:
        self._identity = identity
        self._expected = expected_server
        self._binding = _binding(channel_binding)
        self.hello = Hello(tuple(versions), identity.peer_id, identity.public_key, _nonce(nonce))
        self.version: int | None = None  # set once the server is authenticated
        self.server_peer: bytes | None = None

    def receive_ack(self, ack: HelloAck) -> Auth:
        """Authenticate the server; return the ``Auth`` to send. ``ProtocolError`` 2, 9 or 12."""
        if self.version is not None:
            raise ProtocolError("second HelloAck", code=ErrorCode.UNEXPECTED_MESSAGE)
        if ack.version not in self.hello.versions:
            raise ProtocolError(f"server chose version {ack.version}, not offered",
                                code=ErrorCode.UNSUPPORTED_VERSION)
        _check_key(ack.peer_id, ack.public_key, "server")
        if self._expected is not None and ack.peer_id != self._expected:
            raise _auth_failed("server is not the peer that was dialled")
        if ack.nonce == self.hello.nonce:
            raise _auth_failed("server echoed the client's nonce")
        transcript = self._transcript(ack, "server")
        if not verify_body(ack.public_key, SignatureKind.AUTH, transcript, ack.sig):
            raise _auth_failed("server's handshake signature does not verify")
        self.version, self.server_peer = ack.version, ack.peer_id
        return Auth(self._identity.sign_body(SignatureKind.AUTH, self._transcript(ack, "client")))

    def _transcript(self, ack: HelloAck, role: str) -> dict[str, Any]:
        return auth_transcript(
            role=role, version=ack.version, client_versions=self.hello.versions,
            client_peer=self.hello.peer_id, server_peer=ack.peer_id,
            client_nonce=self.hello.nonce, server_nonce=ack.nonce, channel_binding=self._binding,
        )


class ServerHandshake:
    """The accepting side. Feed ``Hello`` to ``receive_hello``, send its ``HelloAck``, then
    feed ``Auth`` to ``receive_auth``, which returns the authenticated client peer ID."""

    def __init__(
        self,
        identity: Identity,
        *,
        versions: Sequence[int] = SUPPORTED_VERSIONS,
        channel_binding: bytes = b"",
        nonce: bytes | None = None,
    ) -> None:
        self._identity = identity
        self._versions = tuple(versions)
        self._binding = _binding(channel_binding)
        self._nonce = _nonce(nonce)
        self._hello: Hello | None = None
        self._version = 0
        self.client_peer: bytes | None = None  # set once the client is authenticated

    @property
    def version(self) -> int | None:
        """The negotiated version, once ``receive_hello`` succeeded."""
        return self._version or None

    def receive_hello(self, hello: Hello) -> HelloAck:
        """Pick the version and sign the transcript. ``ProtocolError`` 2, 9 or 12."""
        if self._hello is not None:
            raise ProtocolError("second Hello", code=ErrorCode.UNEXPECTED_MESSAGE)
        common = set(hello.versions) & set(self._versions)
        if not common:
            raise ProtocolError(f"no common version: client {list(hello.versions)}, "
                                f"server {list(self._versions)}", code=ErrorCode.UNSUPPORTED_VERSION)
        _check_key(hello.peer_id, hello.public_key, "client")
        if hello.nonce == self._nonce:
            raise _auth_failed("client echoed the server's nonce")
        self._hello, self._version = hello, max(common)
        sig = self._identity.sign_body(SignatureKind.AUTH, self._transcript(hello, "server"))
        return HelloAck(self._version, self._identity.peer_id, self._identity.public_key,
                        self._nonce, sig)

    def receive_auth(self, auth: Auth) -> bytes:
        """Verify the client's signature; return its peer ID. ``ProtocolError`` 9 or 12."""
        if self._hello is None or self.client_peer is not None:
            raise ProtocolError("Auth out of order", code=ErrorCode.UNEXPECTED_MESSAGE)
        hello = self._hello
        if not verify_body(hello.public_key, SignatureKind.AUTH, self._transcript(hello, "client"),
                           auth.sig):
            raise _auth_failed("client's handshake signature does not verify")
        self.client_peer = hello.peer_id
        return self.client_peer

    def _transcript(self, hello: Hello, role: str) -> dict[str, Any]:
        return auth_transcript(
            role=role, version=self._version, client_versions=hello.versions,
            client_peer=hello.peer_id, server_peer=self._identity.peer_id,
            client_nonce=hello.nonce, server_nonce=self._nonce, channel_binding=self._binding,
        )
