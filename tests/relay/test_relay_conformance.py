"""The conformance suite (``conformance.py``) passes against our relay and our bridge."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from moeswarm.mobile_bridge import BridgeConfig, export_onnx, running_bridge
from moeswarm.protocol import Identity
from moeswarm.relay import MemoryDirectory, RelayConfig, RelayLimits, RelayServer


def test_our_relay_and_bridge_pass_the_conformance_suite(conformance: ModuleType, certs: Any, mixtral: tuple[Path, Any], tmp_path: Path) -> None:
    folder, _ = mixtral
    manifest = export_onnx(folder, tmp_path / "shards", experts=(1, 2))

    async def main() -> tuple[Any, Any]:
        relay = RelayServer(Identity.generate(), RelayConfig("127.0.0.1", 0, str(certs.cert), str(certs.key),
                                                             limits=RelayLimits(startup_grace_s=0)), MemoryDirectory())
        await relay.start()
        try:
            cli = await asyncio.create_subprocess_exec(  # the command line any implementer runs
                sys.executable, str(Path(__file__).with_name("conformance.py")), "relay", relay.url,
                "--ca", str(certs.ca), stdout=asyncio.subprocess.PIPE)
            out, _ = await asyncio.wait_for(cli.communicate(), 60)
            assert cli.returncode == 0 and out.decode().count("PASS") == 8, out.decode()
            relay_report = await conformance.check_relay(relay.url, str(certs.ca))
            async with running_bridge(BridgeConfig(relay.url, str(tmp_path / "shards"), str(certs.ca))) as info:
                device_report = await conformance.check_device(info["endpoint"], str(certs.ca), manifest.model_id,
                                                               0, 2, manifest.hidden_size)
        finally:
            await relay.aclose()
        return relay_report, device_report

    relay_report, device_report = asyncio.run(main())
    relay_report.print()
    device_report.print()
    assert relay_report.ok and len(relay_report.results) == 8
    assert device_report.ok and len(device_report.results) == 4
