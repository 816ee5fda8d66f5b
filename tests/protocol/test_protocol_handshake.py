"""The handshake proves key possession and resists replay, relay, reflection and downgrade."""

from __future__ import annotations

from dataclasses import replace

import pytest

from moeswarm import protocol as p
from moeswarm.errors import ProtocolError

CLIENT = p.Identity.from_seed(bytes(range(32)))
SERVER = p.Identity.from_seed(bytes(range(32, 64)))
OTHER = p.Identity.from_seed(bytes(range(64, 96)))
E = p.ErrorCode


def _code(exc: pytest.ExceptionInfo[ProtocolError]) -> int:
    return exc.value.code


def _run(client: p.ClientHandshake, server: p.ServerHandshake) -> None:
    """Pass every handshake message through the codec, as a real connection would."""
    ack = server.receive_hello(p.decode(p.encode(client.hello)))  # type: ignore[arg-type]
    auth = client.receive_ack(p.decode(p.encode(ack)))  # type: ignore[arg-type]
    server.receive_auth(p.decode(p.encode(auth)))  # type: ignore[arg-type]


def test_handshake_authenticates_both_sides() -> None:
    client = p.ClientHandshake(CLIENT, expected_server=SERVER.peer_id, channel_binding=b"cb")
    server = p.ServerHandshake(SERVER, channel_binding=b"cb")
    _run(client, server)
    assert client.version == server.version == 2  # v1.3: receipts in batches
    assert client.server_peer == SERVER.peer_id
    assert server.client_peer == CLIENT.peer_id


@pytest.mark.parametrize(("client_versions", "server_versions"), [((1,), (1, 2)), ((1, 2), (1,))])
def test_a_v1_2_peer_and_a_v1_3_peer_agree_on_version_1(client_versions: tuple[int, ...],
                                                        server_versions: tuple[int, ...]) -> None:
    """A v1.2 peer offers or accepts only version 1: a v1.3 peer on the other side speaks it."""
    client = p.ClientHandshake(CLIENT, expected_server=SERVER.peer_id, versions=client_versions)
    server = p.ServerHandshake(SERVER, versions=server_versions)
    _run(client, server)
    assert client.version == server.version == 1


def test_no_common_version_is_refused_naming_both() -> None:
    client = p.ClientHandshake(CLIENT, versions=(2,))
    with pytest.raises(ProtocolError, match=r"no common version: client \[2\], server \[1\]") as info:
        p.ServerHandshake(SERVER, versions=(1,)).receive_hello(client.hello)
    assert _code(info) == E.UNSUPPORTED_VERSION


def test_wrong_server_rejected() -> None:
    client = p.ClientHandshake(CLIENT, expected_server=SERVER.peer_id)
    with pytest.raises(ProtocolError) as info:
        client.receive_ack(p.ServerHandshake(OTHER).receive_hello(client.hello))
    assert _code(info) == E.AUTH_FAILED


def test_replayed_auth_fails_on_a_new_connection() -> None:
    c1, s1 = p.ClientHandshake(CLIENT), p.ServerHandshake(SERVER)
    auth = c1.receive_ack(s1.receive_hello(c1.hello))
    s1.receive_auth(auth)
    # an eavesdropper replays the client's Hello and Auth to the server on a new connection
    s2 = p.ServerHandshake(SERVER)
    s2.receive_hello(c1.hello)
    with pytest.raises(ProtocolError) as info:
        s2.receive_auth(auth)
    assert _code(info) == E.AUTH_FAILED


def test_replayed_hello_ack_fails_for_a_new_client_nonce() -> None:
    c1, s1 = p.ClientHandshake(CLIENT), p.ServerHandshake(SERVER)
    ack = s1.receive_hello(c1.hello)
    c2 = p.ClientHandshake(CLIENT, expected_server=SERVER.peer_id)
    with pytest.raises(ProtocolError) as info:
        c2.receive_ack(ack)
    assert _code(info) == E.AUTH_FAILED


def test_relayed_handshake_fails_under_channel_binding() -> None:
    # a man in the middle terminates TLS on both legs, so each leg has its own binding
    client = p.ClientHandshake(CLIENT, expected_server=SERVER.peer_id, channel_binding=b"leg-1")
    server = p.ServerHandshake(SERVER, channel_binding=b"leg-2")
    ack = server.receive_hello(client.hello)
    with pytest.raises(ProtocolError) as info:
        client.receive_ack(ack)
    assert _code(info) == E.AUTH_FAILED


def test_reflected_signature_rejected() -> None:
    # the server's own transcript signature presented back as the client's Auth
    client, server = p.ClientHandshake(CLIENT), p.ServerHandshake(SERVER)
    ack = server.receive_hello(client.hello)
    with pytest.raises(ProtocolError) as info:
        server.receive_auth(p.Auth(ack.sig))
    assert _code(info) == E.AUTH_FAILED


def test_downgrade_of_offered_versions_detected() -> None:
    client = p.ClientHandshake(CLIENT, versions=(1, 2))
    server = p.ServerHandshake(SERVER, versions=(1, 2))
    tampered = replace(client.hello, versions=(1,))  # an attacker strips version 2
    ack = server.receive_hello(tampered)
    assert ack.version == 1
    with pytest.raises(ProtocolError) as info:
        client.receive_ack(ack)
    assert _code(info) == E.AUTH_FAILED


def test_highest_common_version_wins_and_no_overlap_fails() -> None:
    client = p.ClientHandshake(CLIENT, versions=(1, 2, 5))
    server = p.ServerHandshake(SERVER, versions=(1, 2, 3))
    _run(client, server)
    assert client.version == 2
    with pytest.raises(ProtocolError) as info:
        p.ServerHandshake(SERVER, versions=(3,)).receive_hello(p.ClientHandshake(CLIENT).hello)
    assert _code(info) == E.UNSUPPORTED_VERSION
    client = p.ClientHandshake(CLIENT, versions=(1,))
    ack = p.ServerHandshake(SERVER, versions=(1, 2)).receive_hello(client.hello)
    with pytest.raises(ProtocolError) as info:
        client.receive_ack(replace(ack, version=2))
    assert _code(info) == E.UNSUPPORTED_VERSION


def test_public_key_must_match_peer_id() -> None:
    hello = replace(p.ClientHandshake(CLIENT).hello, public_key=OTHER.public_key)
    with pytest.raises(ProtocolError) as info:
        p.ServerHandshake(SERVER).receive_hello(hello)
    assert _code(info) == E.AUTH_FAILED
    client = p.ClientHandshake(CLIENT)
    ack = p.ServerHandshake(SERVER).receive_hello(client.hello)
    with pytest.raises(ProtocolError) as info:
        client.receive_ack(replace(ack, peer_id=OTHER.peer_id))
    assert _code(info) == E.AUTH_FAILED


def test_messages_out_of_order() -> None:
    client, server = p.ClientHandshake(CLIENT), p.ServerHandshake(SERVER)
    with pytest.raises(ProtocolError) as info:
        server.receive_auth(p.Auth(bytes(64)))
    assert _code(info) == E.UNEXPECTED_MESSAGE
    ack = server.receive_hello(client.hello)
    with pytest.raises(ProtocolError) as info:
        server.receive_hello(client.hello)
    assert _code(info) == E.UNEXPECTED_MESSAGE
    client.receive_ack(ack)
    with pytest.raises(ProtocolError) as info:
        client.receive_ack(ack)
    assert _code(info) == E.UNEXPECTED_MESSAGE


def test_echoed_nonce_rejected() -> None:
    nonce = bytes(32)
    client = p.ClientHandshake(CLIENT, nonce=nonce)
    with pytest.raises(ProtocolError) as info:
        p.ServerHandshake(SERVER, nonce=nonce).receive_hello(client.hello)
    assert _code(info) == E.AUTH_FAILED
