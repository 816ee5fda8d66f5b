"""``moeswarm node status`` renders every report shape a daemon (or a failed request) gives:
a node with links, link errors and a plan; a backbone; an unreachable URL; and a daemon that
has not planned yet.  The figures shown are the report's, in the units the header names."""

from __future__ import annotations

from click.testing import CliRunner

from moeswarm.node.status import _ranges, render_report

NODE = {
    "role": "node", "peer_id": "12D3KooWnode", "model_id": "mixtral-abc", "url": "http://127.0.0.1:1",
    "endpoint": "tcp+tls://127.0.0.1:2", "layers": [0, 3], "experts": [0, 3], "memory_budget": 8 << 30,
    "memory": {"vm_size": 2 << 30, "vm_rss": 512 << 20, "vm_swap": 0, "major_faults": 7, "minor_faults": 9,
               "read_bytes": 64 << 20},
    "serving": {"requests": 5, "pairs": 40, "load_permille": 12},
    "expert_cache": {"hit_rate": 0.5, "prefetch_accuracy": 0.707, "bytes_fetched": 3 << 20},
    "tiers": {
        "acting": False, "local_tier": {"disk_mb_s": 850.0, "compute_gb_s": 20.0, "step_without_experts_ms": 1.2},
        "links": {"12D3KooWpeerAAAAAAAAAAAA": {"rtt_ms": 3.8, "up_mbit": 84.9, "down_mbit": 46.8, "age_s": 2.0,
                                               "probes": 3}},
        "link_errors": {"12D3KooWgoneBBBBBBBBBBBB": "Unreachable: cannot connect"},
        "fetched": {"experts": 2, "bytes": 0, "bytes_fetched": 0, "errors": 0, "checked": True, "verified": 3,
                    "rejected": 1},
        "plan": {"age_s": 1.0, "counts": {"local": 30, "remote": 1, "fetch": 1}, "predicted_tokens_per_s": 41.8,
                 "layers": {"0": {"local": [0, 1, 2, 3, 5], "remote": [4]}, "1": {"fetch": [7]}}},
    },
}


def rendered(report: dict, experts: bool = True) -> str:  # type: ignore[type-arg]
    runner = CliRunner()
    import click

    @click.command()
    def show() -> None:
        render_report(report, experts)

    result = runner.invoke(show, env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    return result.output


def test_a_node_report_shows_links_each_way_errors_and_the_plan() -> None:
    out = rendered(NODE)
    assert "84.9" in out and "46.8" in out and "3.80" in out  # up, down, rtt of the measured peer
    assert "Unreachable: cannot connect" in out
    assert "30 experts local, 1 remote, 1 fetch" in out and "41.8 tokens/s" in out
    assert "0-3,5" in out  # layer 0's local experts as ranges
    assert "hit rate 50.0%" in out and "prefetch accuracy 70.7%" in out
    assert "VmRSS 512 MiB" in out and "budget 8,192 MiB" in out
    assert "2 experts fetched" in out and "3 checked against their digests, 1 refused" in out


def test_other_shapes_render_without_failing() -> None:
    assert "connection refused" in rendered({"url": "http://127.0.0.1:9", "error": "connection refused"})
    no_plan = {**NODE, "tiers": {**NODE["tiers"], "plan": None}}
    no_plan["tiers"].pop("plan")
    assert "no tier plan yet" in rendered(no_plan)
    unmeasured = {**NODE, "tiers": {**NODE["tiers"], "plan": {**NODE["tiers"]["plan"], "predicted_tokens_per_s": None}}}
    assert "no prediction until holders are measured" in rendered(unmeasured)
    backbone = {"role": "backbone", "peer_id": "12D3KooWbb", "model_id": "m", "url": "http://127.0.0.1:3",
                "memory": {}, "dispatch": {"calls": 10, "fallbacks": 0, "local_pairs": 4, "served_by": {"ab": 2}}}
    assert "dispatched 10 calls to 1 holders, 4 pairs computed here" in rendered(backbone)


def test_ranges() -> None:
    assert _ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert _ranges([]) == "-" and _ranges([3]) == "3"


def test_a_daemon_answering_an_http_error_is_reported_with_its_status() -> None:
    """``node status`` against a daemon whose /status fails: an error entry naming the HTTP
    status, not an exception."""
    import http.server
    import threading

    from moeswarm.node.status import fetch_reports

    class Failing(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_error(500, "snapshot failed")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reports = fetch_reports([f"http://127.0.0.1:{server.server_port}"])
    finally:
        server.shutdown()
        server.server_close()
    assert reports[0]["error"] == "HTTP 500: snapshot failed"
