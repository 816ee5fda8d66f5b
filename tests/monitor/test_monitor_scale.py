"""The map at the MiniMax M3 shape: 500 signed announcements over 57 MoE layers x 128 experts
render in headless Chromium (a table row per holder, a canvas cell per expert). How long it takes
is measured by benchmarks/monitor.py, not here."""

from __future__ import annotations

from pathlib import Path

from browser_support import chromium_page

from moeswarm.monitor._serve_thread import serving
from moeswarm.monitor.synthetic import M3_SHAPE, synthetic_watch, write_m3_shaped_config

HOLDERS = 500


def test_the_page_renders_500_holders_over_57_by_128_experts(tmp_path: Path) -> None:
    watch = synthetic_watch(write_m3_shaped_config(tmp_path / "m3"), HOLDERS)
    model_id = next(iter(watch.models))
    with serving(watch) as url, chromium_page() as page:
        page.goto(url)
        page.wait_for_function(f"document.querySelectorAll('#nodes tbody tr').length === {HOLDERS}", timeout=120_000)
        size = page.evaluate(f"""() => {{
            const c = document.querySelector('[data-model="{model_id}"] canvas');
            return [c.width, c.height, Number(c.dataset.uncovered)];
        }}""")
        hover = page.locator(f'[data-model="{model_id}"] canvas')
        hover.hover(position={"x": 3, "y": 3})
        tip = page.locator("#tooltip").inner_text()
    experts, layers = M3_SHAPE["num_local_experts"], M3_SHAPE["num_hidden_layers"]
    zoom = size[0] // experts
    assert zoom >= 2 and size == [experts * zoom, layers * zoom, layers * experts]  # nobody reachable: all red
    assert tip.startswith("layer 0, expert 0") and "live replicas: 0" in tip
