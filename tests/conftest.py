"""Shared pytest fixtures.

The environment variables are set at import, before numpy / huggingface_hub are imported by any test module:
no hub access ever, no tokenizer thread pools, single-threaded OpenBLAS (several engine processes may share the
2 cores; OpenBLAS with 2 threads collapses next to a busy neighbour).
"""
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["OPENBLAS_NUM_THREADS"] = "1"

import importlib  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402


def _oracle():
    """tests/oracle.py, imported lazily (it imports torch + transformers, a few seconds)."""
    try:
        return importlib.import_module("oracle")
    except ModuleNotFoundError:  # tests/ became a package
        return importlib.import_module("tests.oracle")


class OracleCheckpoints:
    """Lazily built, session-cached oracle checkpoints.

    ``get(arch, layout)`` -> ``(model_dir, Reference)``: the checkpoint dir written by
    ``oracle.build_checkpoint(arch, layout, ...)`` (seed 0) and ``oracle.reference_run(model_dir, oracle.PROMPT)``
    (16-token prefill + 8 greedy decode steps). Each (arch, layout) is built once per session.
    ``get(arch, layout, legacy_rope=True)``: a copy of that dir whose config.json has been rewritten by
    ``oracle.write_legacy_rope_config`` (top-level ``rope_theta``, old ``rope_scaling``), with its own reference.
    Treat the returned dirs as read-only.
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        self._cache: dict[tuple[str, str, bool], tuple[Path, Any]] = {}

    @property
    def oracle(self):
        return _oracle()

    @property
    def prompt(self) -> list[int]:
        return list(self.oracle.PROMPT)

    def get(self, arch: str, layout: str, *, legacy_rope: bool = False) -> tuple[Path, Any]:
        key = (arch, layout, bool(legacy_rope))
        if key not in self._cache:
            o = self.oracle
            if arch not in o.ARCHS + o.EXTRA_ARCHS or layout not in o.LAYOUTS:
                raise ValueError(f"unknown oracle checkpoint {arch!r}/{layout!r}")
            d = self.root / (f"{arch}-{layout}" + ("-legacy_rope" if legacy_rope else ""))
            if legacy_rope:
                src, _ = self.get(arch, layout)
                shutil.copytree(src, d)
                o.write_legacy_rope_config(d)
            else:
                o.build_checkpoint(arch, layout, d)
            self._cache[key] = (d, o.reference_run(d, o.PROMPT))
        return self._cache[key]

    __call__ = get


@pytest.fixture(scope="session")
def oracle_checkpoints(tmp_path_factory) -> OracleCheckpoints:
    return OracleCheckpoints(tmp_path_factory.mktemp("oracle"))


# ---------------------------------------------------------------- diagnosing a hung test
# pytest-timeout prints every thread's stack, which for an asyncio test only says "the event
# loop is idle".  Shortly before it fires, this prints every pending asyncio task's stack too:
# which await never returned (a CI hang was a probe loop that lost its cancellation).

def _dump_asyncio_tasks(nodeid: str) -> None:
    import asyncio
    import gc
    import sys

    tasks = [o for o in gc.get_objects() if isinstance(o, asyncio.Task) and not o.done()]
    print(f"\n+++ {len(tasks)} pending asyncio tasks, {nodeid} about to time out +++", file=sys.stderr)
    for task in tasks:
        print(f"--- {task.get_name()}: {task.get_coro()!r}", file=sys.stderr)
        task.print_stack(limit=12, file=sys.stderr)
    sys.stderr.flush()


@pytest.hookimpl
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> None:
    import threading

    if settings.timeout and settings.timeout > 2:
        timer = threading.Timer(settings.timeout * 0.97 - 1, _dump_asyncio_tasks, (item.nodeid,))
        timer.daemon = True
        timer.start()
        item.stash[_task_dump_timer] = timer
    # returns None: pytest-timeout's own timer is set up as usual


@pytest.hookimpl
def pytest_timeout_cancel_timer(item: pytest.Item) -> None:
    timer = item.stash.get(_task_dump_timer, None)
    if timer is not None:
        timer.cancel()


_task_dump_timer = pytest.StashKey[Any]()


@pytest.fixture(autouse=True)
def _collect_slow_tests_garbage(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """A real-process test ends with a garbage collection, so that a socket or transport it left
    open is finalised (``ResourceWarning``, an error here) in its own teardown and names it,
    instead of failing whichever test the collector happens to run next."""
    yield
    if request.node.get_closest_marker("slow") is not None:
        import gc

        gc.collect()


@pytest.fixture(scope="session")
def network_namespaces() -> None:
    """The link tests build hosts in network namespaces: they need root and iproute2's ``ip``.
    Where those are missing the tests are skipped with a reason the session summary repeats
    loudly (below), never silently; as root without ``ip`` they fail, naming the package."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root): the link tests did NOT run")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.fail("the link tests need iproute2 (`ip`, `tc`): apt-get install -y iproute2")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """One line that says how many tests were skipped and why, so no skip goes unnoticed."""
    skipped = terminalreporter.stats.get("skipped", [])
    terminalreporter.write_sep("=", f"moeswarm: {len(skipped)} skipped", bold=bool(skipped), red=bool(skipped))
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        terminalreporter.write_line(f"SKIPPED {report.nodeid}: {reason}", red=True)
