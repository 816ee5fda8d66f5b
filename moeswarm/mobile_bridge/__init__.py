"""The edge runtime: ONNX expert shards on onnxruntime, served through a port-443 relay.

``export_onnx`` turns a checkpoint's experts into layer shards; ``OnnxShards`` opens them;
``OnnxExpertServer`` answers expert calls like a node; ``run_bridge`` dials a relay with
``RelayLink`` and serves until stopped. ``market_shards`` (``--experts auto``) asks the swarm's
market which experts a device should serve and exports them.
"""

from ._manifest import Manifest, ShardEntry
from .auto import AutoConfig, market_shards
from .bridge import (Assignment, AssignmentHook, BridgeConfig, RelayAnnouncer, command_line_assignment, run_bridge,
                     running_bridge)
from .export import export_onnx
from .link import LinkConfig, RelayLink
from .server import OnnxExpertServer
from .shards import OnnxShards, RuntimeConfig, session_options

__all__ = [
    "export_onnx", "Manifest", "ShardEntry", "OnnxShards", "RuntimeConfig", "session_options",
    "OnnxExpertServer", "RelayLink", "LinkConfig", "run_bridge", "BridgeConfig", "Assignment", "AssignmentHook",
    "RelayAnnouncer", "command_line_assignment", "running_bridge", "AutoConfig", "market_shards",
]
