"""Shared pytest fixtures.

The environment variables are set at import, before numpy / huggingface_hub are imported by any test module:
no hub access ever, no tokenizer thread pools, single-threaded OpenBLAS (several engine processes may share the
2 cores; OpenBLAS with 2 threads collapses next to a busy neighbour), no terminal size inherited.
"""
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["OPENBLAS_NUM_THREADS"] = "1"
# pytest-xdist's workers start with COLUMNS=80 and LINES=24 in their environment (one process has
# none): the CLI's tables would wrap at 80 columns under two workers and not under one
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)

import importlib  # noqa: E402
import pickle  # noqa: E402
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
            name = f"{arch}-{layout}" + ("-legacy_rope" if legacy_rope else "")
            d, done = self.root / name, self.root / f"{name}.reference.pickle"
            from engine_support import locked  # (it imports the engine)

            with locked(self.root / f"{name}.lock"):  # the other worker may be building it
                if done.exists():
                    reference = pickle.loads(done.read_bytes())
                else:
                    shutil.rmtree(d, ignore_errors=True)  # a build that died half way
                    if legacy_rope:
                        src, _ = self.get(arch, layout)
                        shutil.copytree(src, d)
                        o.write_legacy_rope_config(d)
                    else:
                        o.build_checkpoint(arch, layout, d)
                    reference = o.reference_run(d, o.PROMPT)
                    done.with_suffix(".part").write_bytes(pickle.dumps(reference))
                    done.with_suffix(".part").rename(done)
            self._cache[key] = (d, reference)
        return self._cache[key]

    __call__ = get


@pytest.fixture(scope="session")
def oracle_checkpoints(tmp_path_factory) -> OracleCheckpoints:
    """One folder for the whole run: under pytest-xdist the workers share it (the base temp's
    parent is the run's), so each checkpoint and its reference are built by one worker, once."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = tmp_path_factory.getbasetemp().parent / "oracle-shared"
        root.mkdir(exist_ok=True)
        return OracleCheckpoints(root)
    return OracleCheckpoints(tmp_path_factory.mktemp("oracle"))


def _family_checkpoints(module: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """tests/engine_support.py's ``FamilyCheckpoints`` of oracle module ``module`` (imported lazily:
    it imports the engine)."""
    from engine_support import FamilyCheckpoints

    return FamilyCheckpoints(module, tmp_path_factory)


# Two directories' tests use these (their own and tests/families' swarm of several models), so they live here.
@pytest.fixture(scope="session")
def glm4_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Oracle checkpoints of GLM-4.5 (``glm4_moe``) and GLM-4.7-Flash (``glm4_moe_lite``), built once per session."""
    return _family_checkpoints("oracle_glm4", tmp_path_factory)


@pytest.fixture(scope="session")
def granite_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Oracle checkpoints of Granite MoE (``granitemoe``) and Granite MoE shared (``granitemoeshared``),
    built once per session."""
    return _family_checkpoints("oracle_granite", tmp_path_factory)


# ---------------------------------------------------------------- diagnosing a hung test
# pytest-timeout prints every thread's stack, which for an asyncio test only says "the event
# loop is idle".  Shortly before it fires, this prints every pending asyncio task's stack too:
# which await never returned (a CI hang was a probe loop that lost its cancellation).

def _dump_asyncio_tasks(nodeid: str) -> None:
    import asyncio
    import gc
    import sys

    import warnings

    with warnings.catch_warnings():  # isinstance() on torch's deprecated aliases warns (an error here)
        warnings.simplefilter("ignore")
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


# ---------------------------------------------------------------- sockets a test's event loop leaves open
# asyncio.run closes its loop without waiting for the connections still closing on it: a TLS
# stream closed just before (aiohttp's client sessions, a relay WebSocket) is still exchanging
# close_notify with its peer, and on a loaded machine that peer (another process) answers late.
# The loop closes, the socket under the TLS stream stays open, and whichever later test the
# garbage collector happens to run in fails on "unclosed transport". That was the intermittent
# leak of sessions 21-27 (127.0.0.1 ephemeral -> ephemeral: a relay or node on port 0).
# Every test's loop is one of these: at close it lets the closes already under way finish
# (bounded), then a connection still open is the test's own leak: it is aborted, so no later
# test inherits it, and the test that left it fails, naming its peer.

CLOSING_S = 10.0  # a TLS goodbye from a peer process starved of CPU; never this slow


class TransportLeftOpen(AssertionError):
    pass


def _open_transports(loop: Any) -> list[Any]:
    transports = getattr(loop, "_transports", None) or {}
    return [t for t in list(transports.values()) if t is not None and getattr(t, "_sock", None) is not None]


def _closing(transport: Any) -> bool:
    """Closed by its owner and not finished: a write buffer draining, or a TLS goodbye under way
    (the socket below a TLS stream is closed only once both close_notify alerts have passed)."""
    import asyncio.sslproto as sslproto

    protocol = getattr(transport, "_protocol", None)
    if isinstance(protocol, sslproto.SSLProtocol):
        return protocol._state in (sslproto.SSLProtocolState.FLUSHING, sslproto.SSLProtocolState.SHUTDOWN)
    return bool(transport.is_closing())


def _harness_loop_class() -> type:
    import asyncio
    import time

    class HarnessLoop(asyncio.SelectorEventLoop):  # type: ignore[misc,valid-type]
        def close(self) -> None:
            if self.is_running() or self.is_closed():
                return super().close()
            deadline = time.monotonic() + CLOSING_S

            async def closes_under_way() -> None:
                while any(_closing(t) for t in _open_transports(self)) and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)

            self.run_until_complete(closes_under_way())
            left = _open_transports(self)
            peers = [str(t.get_extra_info("peername")) for t in left]
            for t in left:
                t.abort()
            if left:
                self.run_until_complete(asyncio.sleep(0))  # the aborts close their sockets
            super().close()
            if left:
                raise TransportLeftOpen(f"the test's event loop closed with {len(left)} connection(s) still open "
                                        f"(peers {', '.join(peers)}): close them (and await it) before it ends")

    return HarnessLoop


@pytest.fixture(scope="session", autouse=True)
def _event_loops_finish_their_closes():  # type: ignore[no-untyped-def]
    import asyncio
    import warnings

    with warnings.catch_warnings():  # policies are deprecated from Python 3.14 on: the hook still works there
        warnings.simplefilter("ignore", DeprecationWarning)

        class Policy(asyncio.DefaultEventLoopPolicy):  # type: ignore[misc,valid-type]
            _loop_factory = _harness_loop_class()

        previous = asyncio.get_event_loop_policy()
        asyncio.set_event_loop_policy(Policy())
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        asyncio.set_event_loop_policy(previous)


# ---------------------------------------------------------------- where a leaked socket was made
# An "unclosed <socket.socket fd=N ...>" found by the collector says nothing of who opened it (tracemalloc
# would, at 5x the suite's time). Every socket of the test process notes the stack that made it, by
# descriptor, until it is closed or detached; a leak found at a slow test's teardown names that stack.

_SOCKET_ORIGINS: dict[int, str] = {}


@pytest.fixture(scope="session", autouse=True)
def _sockets_remember_their_origin():  # type: ignore[no-untyped-def]
    import socket
    import traceback

    cls = socket.socket
    init, real_close, detach = cls.__init__, cls._real_close, cls.detach

    def noting_init(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[no-untyped-def]
        init(self, *args, **kwargs)
        _SOCKET_ORIGINS[self.fileno()] = "".join(traceback.format_stack(limit=14)[:-1])

    def noting_close(self, _ss=socket._socket.socket) -> None:  # type: ignore[no-untyped-def]
        _SOCKET_ORIGINS.pop(self.fileno(), None)
        real_close(self, _ss)

    def noting_detach(self) -> int:  # type: ignore[no-untyped-def]
        _SOCKET_ORIGINS.pop(self.fileno(), None)
        return detach(self)

    cls.__init__, cls._real_close, cls.detach = noting_init, noting_close, noting_detach
    yield
    cls.__init__, cls._real_close, cls.detach = init, real_close, detach


@pytest.fixture(autouse=True)
def _collect_slow_tests_garbage(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """A real-process test ends with a garbage collection, so that a socket or transport it left
    open is finalised in its own teardown and fails it, naming the stack that opened a socket,
    instead of failing whichever test the collector happens to run next."""
    yield
    if request.node.get_closest_marker("slow") is not None:
        import gc
        import re
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            gc.collect()
        leaks = []
        for w in caught:
            if not issubclass(w.category, ResourceWarning):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)  # as before: an error
                continue
            fd = re.search(r"fd=(\d+)", str(w.message))
            origin = _SOCKET_ORIGINS.pop(int(fd.group(1)), None) if fd else None
            leaks.append(f"{w.message}\n" + (f"opened at:\n{origin}" if origin else "(origin not recorded)"))
        if leaks:
            pytest.fail("left open at the end of the test:\n" + "\n".join(leaks), pytrace=False)


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
