"""``moeswarm monitor``: a live map of an expert swarm for volunteers and operators.

``watch.SwarmWatch`` joins the DHT as a client and keeps a snapshot current: every watched model's
announcements (through the same validated reader as a backbone, ``net.discovery``), its demand and
prices (``market``), a ping to every holder it can reach, the ``/status`` of daemons running on this
machine, and the ledger's top contributors.  ``web`` serves the snapshot as a page (``/``), as JSON
(``/api/v1/swarm``) and as Prometheus figures (``/metrics``).
"""
