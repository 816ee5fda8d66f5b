"""Helpers of the HTTP attack tests (issue 32): a victim service in its own process
(``http_victims.py``), an attacker script of ``attackers/`` run alongside, and an honest client
that keeps one HTTP/1.1 connection open across requests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}


@dataclass
class Victim:
    process: subprocess.Popen[str]
    info: dict[str, Any]

    @property
    def url(self) -> str:
        return str(self.info["url"])

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.communicate("\n", timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.communicate(timeout=5)


def start_victim(service: str, *args: str) -> Victim:
    """``http_victims.py SERVICE ARGS`` once it printed READY."""
    process = subprocess.Popen([sys.executable, str(HERE / "http_victims.py"), service, *args], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    assert process.stdout is not None
    line = process.stdout.readline()  # the victim starts in a few seconds at most; a crash closes stdout
    if not line.startswith("READY "):
        process.kill()
        _, err = process.communicate(timeout=10)
        raise AssertionError(f"victim {service} did not start: {line!r} {err[-2000:]}")
    return Victim(process, json.loads(line[6:]))


def start_attacker(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(HERE / "attackers" / script), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)


def read_json_line(process: subprocess.Popen[str]) -> dict[str, Any]:
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.startswith("{"), f"attacker said {line!r}; stderr: {process.stderr.read()[-2000:] if process.stderr else ''}"
    return dict(json.loads(line))


class KeptAlive:
    """An honest HTTP/1.1 client on one connection from 127.0.0.1: ``get(path)`` -> (status, body)."""

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        parts = urlsplit(url)
        self.host = f"{parts.hostname}:{parts.port}"
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout,
                                             source_address=("127.0.0.1", 0))
        self.buffer = b""

    def get(self, path: str, host: str | None = None) -> tuple[int, bytes]:
        self.sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host or self.host}\r\n\r\n".encode())
        while b"\r\n\r\n" not in self.buffer:
            self._more()
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status = int(head.split(b" ", 2)[1])
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                      if line.lower().startswith(b"content-length:"))
        while len(self.buffer) < length:
            self._more()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return status, body

    def _more(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the honest client's connection")
        self.buffer += chunk

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> KeptAlive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
