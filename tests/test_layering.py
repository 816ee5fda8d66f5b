"""The package layering, as rules that stay true (issue: one shared swarm runtime).

- The deployables below the node (relay, ledger, market, mobile bridge) and the libraries under
  everything (model, protocol) never name ``moeswarm.node``: what they share with it lives in
  ``moeswarm.net`` and ``moeswarm.daemon``.
- No module imports a module that imports it, directly or through others, counting every import
  (module level, inside functions, and under ``TYPE_CHECKING``).
- The shared runtime (``moeswarm.net``) never imports the engine (``moeswarm.model``), and the
  monitor never imports the node, nor the market the daemons' plumbing.
- Importing the edge device's bridge loads neither libp2p nor trio (tests/relay also runs one).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moeswarm"
BELOW_THE_NODE = ("relay", "ledger", "market", "mobile_bridge", "model", "protocol")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every moeswarm module ``name`` imports, wherever the import statement stands."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def test_no_module_below_the_node_names_it() -> None:
    pattern = re.compile(r"moeswarm\.node|from \.\.node")
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for package in BELOW_THE_NODE for p in sorted((PACKAGE / package).rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []


def test_the_market_does_not_import_the_daemons_plumbing() -> None:
    """``moeswarm.market`` is the pure core and its shells over any DHT; joining a swarm
    (``moeswarm.daemon``) is for the command, ``moeswarm.market_cli``, beside the other commands."""
    known = modules()
    found = sorted(f"{name} -> {target}" for name, path in known.items() if name.startswith("moeswarm.market.")
                   for target in imports_of(name, path, known) if target == "moeswarm.daemon")
    assert found == []


def test_the_monitor_does_not_import_the_node() -> None:
    """The swarm map reads the swarm through ``moeswarm.net`` and ``moeswarm.daemon`` (run files of
    this machine's daemons, the HTTP bounds), never through the volunteer's node or the backbone."""
    known = modules()
    found = sorted(f"{name} -> {target}" for name, path in known.items() if name.startswith("moeswarm.monitor")
                   for target in imports_of(name, path, known) if target.startswith("moeswarm.node"))
    assert found == []


def test_the_shared_runtime_does_not_load_the_engine() -> None:
    """``moeswarm.net`` serves, discovers and dials for every deployable, the relay and the ledger
    included: it never imports ``moeswarm.model`` (the expert service takes any object with the
    model's hidden size, expert width and top-k; a receipt's FLOPs come from the protocol)."""
    known = modules()
    found = sorted(f"{name} -> {target}" for name, path in known.items() if name.startswith("moeswarm.net")
                   for target in imports_of(name, path, known) if target.startswith("moeswarm.model"))
    assert found == []


def test_no_import_cycle_between_modules() -> None:
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    # Tarjan's strongly connected components: any with two or more modules is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_cycle_finder_finds_a_cycle(tmp_path: Path) -> None:
    """Negative control: two modules importing each other, in the shape the real walk reads."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from .b import x\n")
    b.write_text("def f():\n    from .a import y  # deferred imports count too\n")
    known = {"pkg.a": a, "pkg.b": b}
    assert imports_of("pkg.a", a, known) == {"pkg.b"} and imports_of("pkg.b", b, known) == {"pkg.a"}


@pytest.mark.parametrize("modules_", [
    "moeswarm.mobile_bridge.cli, moeswarm.mobile_bridge.bridge",
    "moeswarm.relay, moeswarm.ledger, moeswarm.market, moeswarm.daemon",
])
def test_the_edge_deployables_import_without_libp2p_or_trio(modules_: str) -> None:
    code = (f"import sys, {modules_}; "
            "print(sorted({'libp2p', 'trio'} & {m.split('.')[0] for m in sys.modules}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
