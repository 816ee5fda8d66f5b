"""The swarm runtime every deployable shares: what crosses the network, and nothing a role owns.

- ``p2p`` (+ ``p2p_config``, ``_libp2p_patches``, ``_libp2p_dht``): the control plane, one libp2p
  node (py-libp2p in a trio thread) behind an asyncio API, with the workarounds for its bugs.
  Imported only when a daemon joins the DHT (libp2p and trio take 1-2 s to import).
- ``records``: validation of every DHT record (announcements, demand reports, ledger roots).
- ``announce`` / ``discovery`` / ``routing_table``: publishing a holder's announcement, and reading
  them back into a table of live holders.
- ``tls``: self-signed server contexts and channel binding for the data plane.
- ``dataplane``: the data plane's server (framing over TLS, handshake, one handler per request);
  ``expert_service``: its expert-serving half (queue, batch, validate, sign) with a pluggable
  compute backend; ``client``: the multiplexed client and its per-peer pool.

The deployables sit on top: ``moeswarm.node`` (expert node, backbone), ``moeswarm.relay``,
``moeswarm.mobile_bridge``, ``moeswarm.ledger``, ``moeswarm.market``; ``moeswarm.daemon`` holds the
process plumbing they share.
"""
