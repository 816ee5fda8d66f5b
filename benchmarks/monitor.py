"""How long the swarm map takes to show a swarm at the MiniMax M3 shape, in headless Chromium.

500 signed announcements (random blocks) over 57 MoE layers x 128 experts (7,296 cells) are fed to
a monitor (``moeswarm.monitor.synthetic``: validated as every DHT record is, no DHT behind them);
the page is loaded fresh ``--runs`` times and timed from navigation until every node row is in the
table and the map is drawn; also the snapshot's JSON size and the server's time to build it.

    python benchmarks/monitor.py [--holders 500] [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # browser_support: Debian's Chromium

from browser_support import chromium_page  # noqa: E402

from moeswarm.monitor._serve_thread import serving  # noqa: E402
from moeswarm.monitor.synthetic import snapshot_size, synthetic_watch, write_m3_shaped_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--holders", type=int, default=500)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        watch = synthetic_watch(write_m3_shaped_config(Path(tmp) / "m3"), args.holders)
        builds = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            snap = watch.snapshot()
            builds.append(time.perf_counter() - t0)
        loads = []
        with serving(watch) as url, chromium_page() as page:
            for _ in range(args.runs):
                t0 = time.perf_counter()
                page.goto(url)
                page.wait_for_function(f"document.querySelectorAll('#nodes tbody tr').length === {args.holders} "
                                       "&& document.querySelector('canvas') && document.querySelector('canvas').width > 0",
                                       timeout=120_000)
                loads.append(time.perf_counter() - t0)
    print(f"\nswarm map at the MiniMax M3 shape (57 x 128 experts), {args.holders} holders, "
          f"medians of {args.runs} fresh page loads")
    print("| snapshot JSON | snapshot built | page load to map + table drawn |")
    print("|---|---|---|")
    print(f"| {snapshot_size(snap) / 1024:.0f} KiB | {statistics.median(builds) * 1000:.0f} ms | "
          f"{statistics.median(loads):.2f} s |")


if __name__ == "__main__":
    main()
