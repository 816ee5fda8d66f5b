"""The volunteer's expert node and the backbone, on the shared runtime of ``moeswarm.net``.

- ``volunteer``: ``moeswarm node``'s daemon (``run_node``); ``expert_server``: its numpy compute
  backend; ``rebalancer``: following the market with ``--experts auto``; ``fetch``: serving (and
  fetching) expert weights with their digests.
- ``backbone``: ``SwarmBackbone`` / ``run_backbone``; ``dispatch``: the executor that sends routed
  experts to their holders; ``links``, ``measure``, ``planner``, ``tiers``: the tier planner;
  ``service`` and ``http_api``: generation behind the OpenAI-compatible API.
- ``config``: the daemons' configuration; ``status``: ``/status``, ``/metrics`` and
  ``moeswarm node status``; ``cli``: the command lines.
"""
