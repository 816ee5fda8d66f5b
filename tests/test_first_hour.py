"""The first hour with moeswarm (issue 33): the messages a newcomer meets, run as they run them
(``python -m moeswarm.cli ...`` in subprocesses, several at once to keep the file quick).

What each test printed on 52de96c, before the fix, is in its docstring.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import expert_nodes
from moeswarm.protocol import Identity

TIMEOUT_S = 300  # whole commands on a loaded 2-core machine
CLI = [sys.executable, "-m", "moeswarm.cli"]
LEDGER = [sys.executable, "-m", "moeswarm.ledger.cli"]
ENV = {**{k: v for k, v in os.environ.items() if k != "COLUMNS"}, "OPENBLAS_NUM_THREADS": "1"}  # piped, as in CI


def run_all(commands: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess[str]]:
    """Run every command at once (real processes, stdout and stderr piped); their results by name."""
    started = {name: subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
               for name, argv in commands.items()}
    done = {}
    try:
        for name, p in started.items():
            out, err = p.communicate(timeout=TIMEOUT_S)
            done[name] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    finally:
        for p in started.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    return done


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from moeswarm.mobile_bridge import export_onnx

    out = tmp_path_factory.mktemp("shards")
    export_onnx(str(CHECKPOINT), str(out), layers=(0, 0), experts=(0, 0))
    return out


def test_every_listening_command_says_in_one_line_that_its_port_is_taken(shards: Path, tmp_path: Path) -> None:
    """Port already in use: one line and exit status 2 for every command that listens, before it
    loads or dials anything (backbone and monitor are given a dead bootstrap peer: the port must be
    named first).  On 52de96c: ``node --port`` and ``relay --listen`` printed a 40-line traceback
    ending ``OSError: [Errno 98] error while attempting to bind on address``; the backbone and the
    monitor answered ``no bootstrap peer answered: ...: SwarmException: ... (negative cache)`` after
    10 s; ``bridge --web`` a traceback."""
    dead = f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{Identity.generate().peer_id_str}"
    model = str(CHECKPOINT)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        at = f"127.0.0.1:{port}"
        results = run_all({
            "--port": [*CLI, "node", "--model", model, "--experts", "0-3", "--port", str(port)],
            "--status": [*CLI, "node", "--model", model, "--experts", "0-3", "--status", at],
            "--p2p-port": [*CLI, "node", "--model", model, "--experts", "0-3", "--p2p-port", str(port)],
            "--listen": [*CLI, "relay", "--listen", at, "--no-dht"],
            "--http": [*CLI, "backbone", "--model", model, "--http", at, "--bootstrap", dead],
            "monitor --http": [*CLI, "monitor", "--model", model, "--http", at, "--bootstrap", dead],
            "ledger --listen": [*LEDGER, "serve", "--db", str(tmp_path / "l.db"), "--listen", at],
            "--web": [*CLI, "bridge", "--relay", "ws://127.0.0.1:9", "--shards", str(shards), "--web", at],
        })
    for name, r in results.items():
        option = name.split()[-1]
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, (name, r.returncode, r.stderr[-3000:])
        assert lines[0] == (f"error: {option} {at}: the port is in use by another process "
                            "(choose another port, or 0 for any free one)"), (name, lines)
        assert r.stdout == "", (name, r.stdout)


def test_messages_name_the_problem() -> None:
    """Each message says what is wrong.  On 52de96c: ``--experts 7-3`` "is outside 0-7";
    ``--model README.md`` "model folder not found" (generate) and a NotADirectoryError traceback
    (node); a dead bootstrap peer ``SwarmException: Peer ... recently failed all addresses
    (negative cache)``; ``--speculative 4 --temperature 0.8`` printed the prompt on stdout, its error
    then landing on the prompt's line; ``plan`` said the fp16 demo is "stored as BF16"."""
    model = str(CHECKPOINT)
    dead_port = closed_port()
    dead = f"/ip4/127.0.0.1/tcp/{dead_port}/p2p/{Identity.generate().peer_id_str}"
    r = run_all({
        "reversed": [*CLI, "node", "--model", model, "--experts", "7-3"],
        "file node": [*CLI, "node", "--model", "README.md", "--experts", "0-3"],
        "file generate": [*CLI, "generate", "--model", "README.md"],
        "dead peer": [*CLI, "node", "--model", model, "--experts", "0-3", "--bootstrap", dead],
        "speculative": [*CLI, "generate", "--speculative", "4", "--temperature", "0.8", "--max-new-tokens", "4"],
        "plan": [*CLI, "plan", "--model", model],
    })
    for name in ("reversed", "file node", "file generate", "dead peer", "speculative"):
        assert r[name].returncode == 2 and "Traceback" not in r[name].stderr, (name, r[name].stderr[-3000:])
    assert r["reversed"].stderr.strip().endswith("error: --experts 7-3 is reversed: write the lower end first, 3-7")
    for name in ("file node", "file generate"):
        assert r[name].stderr.strip().endswith(
            "error: this is a file, not a model folder: give the folder that holds config.json and *.safetensors, "
            "or a .gguf file (file README.md)"), r[name].stderr
    refused = f"error: no bootstrap peer answered: connection refused at {dead} (is the peer running?)"
    assert r["dead peer"].stderr.strip().endswith(refused), r["dead peer"].stderr
    assert r["speculative"].stdout == ""  # nothing on stdout: the error is a line of its own
    assert r["speculative"].stderr == "error: --speculative needs --temperature 0 (greedy)\n"
    assert r["plan"].returncode == 0
    assert json.loads((CHECKPOINT / "config.json").read_text())["dtype"] == "float16"  # the oracle: its config
    assert "  stored as       FP16 (config.json: dtype float16, no quantization_config)\n" in r["plan"].stdout


def test_a_node_says_what_it_does_and_node_status_reads_unwrapped_when_piped() -> None:
    """A node says, in words on stderr, what it loads and serves (READY on stdout unchanged); ``node
    status`` piped is not wrapped at 80 columns and does not claim the demo lacks
    expert_digests.json (a node fetches no weights).  On 52de96c: the node printed nothing on
    stderr; ``node status`` printed "not checked: no expert_digests.json" and broke its first line
    (peer id, model, URL) at column 80."""
    assert (CHECKPOINT / "expert_digests.json").is_file()  # the demo ships it
    with expert_nodes(str(CHECKPOINT), ["0-7"]) as (node,):
        url = node.info["status"]
        r = run_all({"status": [*CLI, "node", "status", "--url", url],
                     "experts": [*CLI, "node", "status", "--url", url, "--experts"]})
        node_log = node.log_tail(5000)
    assert node.info["experts"] == [0, 7] and node.info["endpoint"].startswith("tcp+tls://")  # READY as before
    assert "starting a new swarm: this process is its bootstrap peer" in node_log
    assert f"serving layers 0-3 x experts 0-7 at {node.info['endpoint']}, status at {url} (Ctrl-C to stop)" in node_log
    for name, out in r.items():
        assert out.returncode == 0, out.stderr
        first = out.stdout.splitlines()[0]
        assert first == f"node {node.info['peer_id']}  model {node.info['model_id']}  ({url})", (name, first)
        assert "fetches no expert weights (the plan is shown, not followed)" in out.stdout
        assert "no expert_digests.json" not in out.stdout


@pytest.fixture(scope="module")
def gguf_conversion(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("gguf") / "demo.gguf"
    converted = run_all({"convert": [*CLI, "convert-gguf", "--model", str(CHECKPOINT), "--out", str(out),
                                     "--no-sidecar"]})["convert"]
    assert converted.returncode == 0, converted.stderr[-2000:]
    return out, converted


def test_convert_and_export_show_a_bar_with_its_total(gguf_conversion: tuple[Path, subprocess.CompletedProcess[str]],
                                                      tmp_path: Path) -> None:
    """convert-gguf and export-onnx draw a progress bar that knows its total.  On 52de96c:
    convert-gguf's bar (1 s delay, no total) never appeared; export-onnx had none."""
    path, converted = gguf_conversion
    bars = converted.stderr.replace("\r", "\n").splitlines()
    done = [b for b in bars if b.startswith(f"writing {path}: 100%|")]
    assert done, converted.stderr[-2000:]
    written, total = re.search(r"\| ([\d.]+\w?)/([\d.]+\w?) \[", done[-1]).groups()  # type: ignore[union-attr]
    assert written == total
    exported = run_all({"export": [*CLI, "export-onnx", "--model", str(CHECKPOINT), "--layers", "0-1",
                                   "--experts", "2-3", "--out", str(tmp_path / "shards")]})["export"]
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert "exporting experts 2-3: 100%|" in exported.stderr and "| 2/2 [" in exported.stderr, exported.stderr
    assert json.loads(exported.stdout)["experts"] == [2, 3]  # the machine-readable line, as before


def test_a_gguf_cut_short_is_named_so(gguf_conversion: tuple[Path, subprocess.CompletedProcess[str]],
                                      tmp_path: Path) -> None:
    """A GGUF cut to 100 bytes (an interrupted download).  On 52de96c: ``not a readable GGUF file
    (ValueError: When changing to a larger dtype, its size must be a divisor of the total size in
    bytes of the last axis of the array.)``."""
    path, _ = gguf_conversion
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:100])
    r = run_all({"cut": [*CLI, "generate", "--model", str(cut), "--max-new-tokens", "1"]})["cut"]
    assert r.returncode == 2
    # the bounded header reader (issue 32) finds the cut first: the demo's 36 keys cannot fit the 76 bytes left
    assert r.stderr == (f"error: the GGUF file is cut short or damaged: its header claims 36 metadata keys of at "
                        f"least 13 bytes each, but only 76 bytes are left in the file (an incomplete download or "
                        f"copy?) (file {cut})\n")


def test_generate_takes_top_k_and_reports_its_speed() -> None:
    """``--top-k 1`` keeps only the most likely token, so sampling at temperature 1.5 gives the
    greedy tokens (without it, the same seed does not); tokens/s close every generation, and
    --speculative says how many drafts were accepted.  On 52de96c: "No such option: --top-k"; no
    tokens/s without --stats; nothing about drafts."""
    ids = ["--prompt", "the LORD the LORD the LORD the LORD", "--max-new-tokens", "16", "--print-token-ids"]
    r = run_all({
        "greedy": [*CLI, "generate", *ids],
        "top-k 1": [*CLI, "generate", *ids, "--temperature", "1.5", "--top-k", "1", "--seed", "3"],
        "sampled": [*CLI, "generate", *ids, "--temperature", "1.5", "--seed", "3"],
        "speculative": [*CLI, "generate", *ids, "--speculative", "4"],
    })
    tokens = {name: json.loads(out.stdout.strip().splitlines()[-1]) for name, out in r.items()}
    assert tokens["top-k 1"] == tokens["greedy"] == tokens["speculative"] and len(tokens["greedy"]) == 16
    assert tokens["sampled"] != tokens["greedy"]  # so --top-k did the narrowing
    for name, out in r.items():
        assert re.search(r"^16 tokens in \d+\.\d\d s: \d+\.\d tokens/s \(the first after \d+\.\d\d s\)$", out.stderr,
                         re.M), (name, out.stderr)
    drafts = re.search(r"^speculative: (\d+) of (\d+) draft tokens accepted \(\d+%\), 16 tokens in (\d+) forward "
                       r"passes$", r["speculative"].stderr, re.M)
    assert drafts, r["speculative"].stderr
    accepted, drafted, passes = map(int, drafts.groups())
    # each forward pass yields its own token (the last one's is dropped when the drafts reach 16) plus the accepted
    assert 0 < accepted <= drafted and passes + accepted in (16, 17), (accepted, passes)

