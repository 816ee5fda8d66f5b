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
        # the colour of every cell's centre pixel, as drawn: (layers x experts) distinct RGB values
        colours = page.evaluate(f"""() => {{
            const c = document.querySelector('[data-model="{model_id}"] canvas');
            const z = c.width / {M3_SHAPE["num_local_experts"]};
            const px = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
            const seen = {{}};
            for (let y = z / 2; y < c.height; y += z)
                for (let x = z / 2; x < c.width; x += z) {{
                    const i = 4 * (Math.floor(y) * c.width + Math.floor(x));
                    const rgba = px.slice(i, i + 4).join(",");
                    seen[rgba] = (seen[rgba] || 0) + 1;
                }}
            return seen;
        }}""")
        head = page.locator(f'[data-model="{model_id}"] .model-head').inner_text()
        shown = page.locator(f'[data-model="{model_id}"] canvas').is_visible()
        hover = page.locator(f'[data-model="{model_id}"] canvas')
        hover.hover(position={"x": 3, "y": 3})
        tip = page.locator("#tooltip").inner_text()
    experts, layers = M3_SHAPE["num_local_experts"], M3_SHAPE["num_hidden_layers"]
    zoom = size[0] // experts
    assert zoom >= 2 and size == [experts * zoom, layers * zoom, layers * experts]  # nobody reachable: all red
    assert tip.startswith("layer 0, expert 0") and "live replicas: 0" in tip
    # what a person sees: every one of the 57 x 128 cells painted the "0 replicas" red of the legend
    # (#d62d20), and the model's line saying so (a blank canvas of the right size fails here)
    assert shown and colours == {"214,45,32,255": layers * experts}, colours
    assert f"0/{HOLDERS} holders live" in head and f"{layers * experts} experts uncovered" in head, head
    assert f"{layers} MoE layers × {experts} experts" in head, head
