"""Issue 32, point 7: model files as bad input to the loaders.

A model file comes from whoever published it. The attacker's path is a file handed to the CLI,
so each case runs ``moeswarm`` in a subprocess on a crafted file and measures that process
(``os.wait4``: its own peak RSS), bounded by a generous wall-clock timeout and a 4 GiB
address-space limit that keeps the machine safe. On main 52de96c:

- a GGUF whose one metadata array (of uint8) claims 2^40 items: ``generate`` allocated until
  killed; this test printed ``AssertionError: did not finish in 60 s (peak 3047 MiB)`` (the
  issue measured 4 GB after 115 s). Now refused at once: the count cannot fit in the bytes left.
- a safetensors file whose header is 48 MiB of ``[]``: ``generate`` refused it only after
  ``json.loads``; this test printed ``AssertionError: peak RSS 1243 MiB``. Now the header is
  refused before parsing (over 16 MiB, and more than one JSON container per 12 bytes).
- a chat template of two nested ``range`` loops: the backbone's ``/v1/chat/completions`` never
  answered in 30 s (the render runs on the API's event loop, so nobody else was served either);
  this test printed ``AssertionError: chat request: ('timeout', '')``. Now the render stops after 1,000,000 steps with a 400, and the API keeps serving.
"""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import start_daemon, stop_daemon

PEAK_MIB = 400  # what the CLI needs to start and refuse a file (about 150-250 MiB measured)


def _run_cli(args: list[str], timeout_s: float = 60.0) -> tuple[int | None, str, float]:
    """Run ``moeswarm ARGS``: (exit status or None if it had to be killed, stderr, peak RSS in MiB)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    with open(os.devnull, "w") as devnull, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen([sys.executable, "-m", "moeswarm.cli", *args], stdout=devnull, stderr=err,
                                   preexec_fn=limit, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        deadline, status, peak_kb = time.monotonic() + timeout_s, None, 0
        while time.monotonic() < deadline:
            peak_kb = max(peak_kb, _high_water_kb(process.pid))
            pid, raw, _ = os.wait4(process.pid, os.WNOHANG)
            if pid:
                status = os.waitstatus_to_exitcode(raw)
                break
            time.sleep(0.02)
        else:
            process.kill()
            os.wait4(process.pid, 0)
        process.returncode = status if status is not None else -9  # reaped here, not by Popen
        err.seek(0)
        return status, err.read(), peak_kb / 1024


def _high_water_kb(pid: int) -> int:
    """The process's peak resident memory so far (``VmHWM``), 0 once it has exited.  Not the
    ``ru_maxrss`` of ``wait4``: Linux carries the pre-exec image's high-water mark over exec, and
    that image is a fork of this pytest worker (hundreds of MiB with torch loaded)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _folder_with(tmp_path: Path, **replace: bytes) -> Path:
    """The demo checkpoint's files, linked, with some replaced."""
    folder = tmp_path / "model"
    folder.mkdir()
    for f in CHECKPOINT.iterdir():
        if f.name in replace:
            (folder / f.name).write_bytes(replace[f.name])
        else:
            (folder / f.name).symlink_to(f)
    return folder


def _gguf_with_huge_array() -> bytes:
    """GGUF v3: 0 tensors, 1 key ``a`` holding an array of uint8 that claims 2^40 items."""
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    key = struct.pack("<Q", 1) + b"a" + struct.pack("<I", 9)  # type 9: array
    return head + key + struct.pack("<IQ", 0, 1 << 40) + b"\x00" * 64  # of type 0: uint8


def test_a_gguf_array_claiming_2_to_the_40_items_is_refused_at_once(tmp_path: Path) -> None:
    path = tmp_path / "huge-array.gguf"
    path.write_bytes(_gguf_with_huge_array())
    status, stderr, peak = _run_cli(["generate", "--model", str(path), "--max-new-tokens", "1"])
    assert status is not None, f"did not finish in 60 s (peak {peak:.0f} MiB)"
    assert peak < PEAK_MIB, f"peak RSS {peak:.0f} MiB"
    assert status != 0 and "claims 1099511627776 array items" in stderr and "Traceback" not in stderr, stderr[-2000:]


def test_a_safetensors_header_of_48_mib_of_empty_arrays_is_refused_before_parsing(tmp_path: Path) -> None:
    n = (48 << 20) // 3
    header = b'{"x":[' + b"[]," * n + b"[]]}"
    folder = _folder_with(tmp_path, **{"model.safetensors": struct.pack("<Q", len(header)) + header})
    status, stderr, peak = _run_cli(["generate", "--model", str(folder), "--max-new-tokens", "1"])
    assert status is not None, f"did not finish in 60 s (peak {peak:.0f} MiB)"
    assert peak < PEAK_MIB, f"peak RSS {peak:.0f} MiB"
    assert status != 0 and "safetensors header of" in stderr and "Traceback" not in stderr, stderr[-2000:]


def _post(url: str, body: dict[str, object], timeout: float) -> tuple[int | str, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (TimeoutError, OSError):
        return "timeout", ""


def test_a_chat_template_of_nested_range_loops_is_stopped_and_the_api_keeps_serving(tmp_path: Path) -> None:
    config = json.loads((CHECKPOINT / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
                               "{{ messages[0]['content'] }}")
    folder = _folder_with(tmp_path, **{"tokenizer_config.json": json.dumps(config).encode()})
    backbone = start_daemon("backbone", ["backbone", "--model", str(folder), "--local-fallback",
                                         "--coverage-timeout", "1", "--http", "127.0.0.1:0"])
    try:
        url = backbone.info["http"]
        chat = _post(url + "/v1/chat/completions",
                     {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}, timeout=30)
        assert chat[0] == 400 and "over its limits" in chat[1], f"chat request: {chat}"
        plain = _post(url + "/v1/completions", {"prompt": "hello", "max_tokens": 2}, timeout=30)
        assert plain[0] == 200, f"the API stopped serving: {plain}"
    finally:
        stop_daemon(backbone)
