"""hmaclient is a distribution of its own (client/pyproject.toml) that needs only pyzmq and msgpack, and
prompt_toolkit for hmactl chat's terminal (imported only when one starts): what it
declares, what its installed metadata says, what its modules import, and what importing it loads."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
CLIENT = ROOT / "client"
RUNTIME = {"pyzmq", "msgpack", "prompt_toolkit"}
THIRD_PARTY_IMPORTS = {"zmq", "msgpack"}  # the import names of RUNTIME but prompt_toolkit's, which only:
OPTIONAL_IMPORTS = {
    "prometheus.py": {"prometheus_client"},  # behind the `prometheus` extra
    "chat.py": {"prompt_toolkit"},  # inside the function that starts the terminal UI
}
# The daemon's stack: none of it may come with the client.
HEAVY = ("numpy", "vulkan", "gguf", "tokenizers", "llguidance", "safetensors", "yaml", "hmad", "hmad_openai")
HEAVY += ("prometheus_client", "starlette", "uvicorn", "pydantic", "sdnotify", "prompt_toolkit")


def _pyproject(path: Path) -> dict:
    with open(path, "rb") as f:
        return tomllib.load(f)


def _names(requirements: list[str]) -> set[str]:
    return {Requirement(r).name.lower() for r in requirements}


def test_client_declares_only_its_runtime():
    project = _pyproject(CLIENT / "pyproject.toml")["project"]
    assert project["name"] == "hmaclient"
    assert _names(project["dependencies"]) == RUNTIME
    assert {k: _names(v) for k, v in project["optional-dependencies"].items()} == {
        "prometheus": {"prometheus-client"}
    }
    assert project["scripts"] == {"hmactl": "hmaclient.cli:main"}


def test_hmad_depends_on_this_client_and_does_not_ship_it():
    client = _pyproject(CLIENT / "pyproject.toml")["project"]
    hmad = _pyproject(ROOT / "pyproject.toml")
    pins = [Requirement(r) for r in hmad["project"]["dependencies"] if Requirement(r).name == "hmaclient"]
    assert len(pins) == 1 and pins[0].specifier.contains(client["version"])
    assert "hmactl" not in hmad["project"]["scripts"]
    assert hmad["tool"]["setuptools"]["packages"]["find"]["where"] == ["daemon"]
    assert not (ROOT / "daemon" / "hmaclient").exists()


def test_installed_metadata_matches():
    """The metadata pip built from client/pyproject.toml (the installed hmaclient)."""
    dist = importlib.metadata.distribution("hmaclient")
    required = [Requirement(r) for r in dist.requires or []]
    assert {r.name.lower() for r in required if r.marker is None} == RUNTIME
    assert {r.name.lower() for r in required if r.marker is not None} == {"prometheus-client"}
    assert [ep.value for ep in dist.entry_points if ep.name == "hmactl"] == ["hmaclient.cli:main"]
    assert Path(dist.locate_file("")).resolve() != ROOT  # not the hmad distribution's files
    hmad_requires = [Requirement(r) for r in importlib.metadata.distribution("hmad").requires]
    assert [r.name for r in hmad_requires if r.marker is None and r.name == "hmaclient"] == ["hmaclient"]


def test_modules_import_only_the_standard_library_zmq_and_msgpack():  # (and chat.py prompt_toolkit)
    for path in sorted((CLIENT / "hmaclient").glob("*.py")):
        allowed = THIRD_PARTY_IMPORTS | {"hmaclient"} | OPTIONAL_IMPORTS.get(path.name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                tops = {node.module.split(".")[0]}
            else:
                continue
            extra = tops - allowed - set(sys.stdlib_module_names) - {"__future__"}
            assert not extra, f"{path.name}:{node.lineno} imports {extra}"


def test_importing_and_running_hmactl_loads_nothing_of_the_daemon(tmp_path):
    """In a fresh interpreter: import the package, and run ``hmactl ping`` to its end (no daemon there)."""
    code = f"""
import json, sys
import hmaclient, hmaclient.cli, hmaclient.client, hmaclient.protocol, hmaclient.safepath
code = hmaclient.cli.main(["--socket", {str(tmp_path / "none.sock")!r}, "ping"])
print(json.dumps([code, sorted(m for m in sys.modules if m.split(".")[0] in {list(HEAVY)!r})]))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    exit_code, heavy = json.loads(p.stdout.splitlines()[-1])
    assert exit_code == 3 and "no socket file there" in p.stderr
    assert heavy == []
