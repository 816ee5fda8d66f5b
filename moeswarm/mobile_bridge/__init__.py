"""The edge runtime: ONNX expert shards on onnxruntime, served through a port-443 relay.

``export_onnx`` turns a checkpoint's experts into layer shards; ``OnnxShards`` opens them;
``OnnxExpertServer`` answers expert calls like a node; ``run_bridge`` dials a relay with
``RelayLink`` and serves until stopped. ``AssignmentHook`` is where the market decides what a
device serves.
"""

from ._manifest import Manifest, ShardEntry
from .bridge import (Assignment, AssignmentHook, BridgeConfig, RelayAnnouncer, command_line_assignment, run_bridge,
                     running_bridge)
from .export import export_onnx
from .link import LinkConfig, RelayLink
from .server import OnnxExpertServer
from .shards import OnnxShards, RuntimeConfig, session_options

__all__ = [
    "export_onnx", "Manifest", "ShardEntry", "OnnxShards", "RuntimeConfig", "session_options",
    "OnnxExpertServer", "RelayLink", "LinkConfig", "run_bridge", "BridgeConfig", "Assignment", "AssignmentHook",
    "RelayAnnouncer", "command_line_assignment", "running_bridge",
]
