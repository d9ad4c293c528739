"""The layer rule, held by CI: each floor of the daemon imports only the floors below it.

    process  hmad.__main__, service, server, config, composition, ...   (anything below)
    engine   hmad.engine        scheduler, runner, kv cache, sampling    -> model, backends, core
    model    hmad.model         files -> tensors + ModelConfig, Gemma 3  -> backends, core
    backends hmad.backends      cpu, vulkan, npu                         -> core
    core     hmad.core          the shared nouns                         -> nothing of hmad

The daemon reads the client's wire spec and socket-path rule (``hmaclient.protocol``), its check of who
owns a socket (``hmaclient.safepath``), the argument types its CLI shares with hmactl (``hmaclient.args``)
and the sampling fields (``hmaclient.sampling``, the only one the floors below the process may read),
nothing else of the client. The client imports nothing of the daemon. Every import statement counts,
also one inside a function: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DAEMON, CLIENT = ROOT / "daemon" / "hmad", ROOT / "client" / "hmaclient"

#: floor -> the hmad floors it may import (its own included)
ALLOWED = {
    "core": {"core"},
    "backends": {"backends", "core"},
    "model": {"model", "backends", "core"},
    "engine": {"engine", "model", "backends", "core"},
}
#: what of the client the daemon may import
CLIENT_FOR_DAEMON = {
    "hmaclient",
    "hmaclient.protocol",
    "hmaclient.safepath",
    "hmaclient.args",
    "hmaclient.sampling",
}
#: ... and what of it the floors may: the sampling fields' table (standard library only), which the engine's
#: SamplingParams reads its defaults and bounds from
CLIENT_FOR_FLOORS = {"hmaclient", "hmaclient.sampling"}


def module_name(path: Path, root: Path, package: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def imports(path: Path, module: str) -> list[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            out.append(name)
            out += [f"{name}.{a.name}" for a in node.names]  # `from hmad import engine` names a module
    return out


def floor(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else "process"


def daemon_modules() -> list[tuple[Path, str]]:
    return [(p, module_name(p, DAEMON, "hmad")) for p in sorted(DAEMON.rglob("*.py"))]


def known_daemon_modules() -> set[str]:
    return {m for _, m in daemon_modules()}


def test_every_floor_imports_only_the_floors_below_it():
    known = known_daemon_modules()
    wrong = []
    for path, module in daemon_modules():
        mine = floor(module)
        if mine == "process":
            continue
        for name in imports(path, module):
            if name.startswith("hmad.") and name in known | {n.rsplit(".", 1)[0] for n in known}:
                if floor(name) not in ALLOWED[mine]:
                    wrong.append(f"{module} ({mine}) imports {name} ({floor(name)})")
            elif name == "hmad" or (name.startswith("hmaclient") and name not in CLIENT_FOR_FLOORS):
                wrong.append(f"{module} ({mine}) imports {name}")
    assert not wrong, "upward imports:\n" + "\n".join(wrong)


def test_the_daemon_reads_only_the_protocol_and_the_path_rule_of_the_client():
    wrong = [
        f"{module} imports {name}"
        for path, module in daemon_modules()
        for name in imports(path, module)
        if name.startswith("hmaclient")
        and name.rsplit(".", 1)[0] not in CLIENT_FOR_DAEMON
        and name not in CLIENT_FOR_DAEMON
    ]
    assert not wrong, "\n".join(wrong)


def test_the_client_imports_nothing_of_the_daemon():
    wrong = [
        f"{module_name(p, CLIENT, 'hmaclient')} imports {name}"
        for p in sorted(CLIENT.rglob("*.py"))
        for name in imports(p, module_name(p, CLIENT, "hmaclient"))
        if name == "hmad" or name.startswith(("hmad.", "hmad_openai"))
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("source", ["from hmad.engine.batch import StepBatch", "import hmad.engine.batch"])
def test_the_check_sees_an_upward_import(tmp_path, source):
    """The rule's own check: a backend module that imports the engine is caught."""
    path = tmp_path / "hmad" / "backends" / "bad.py"
    path.parent.mkdir(parents=True)
    path.write_text(source + "\n")
    names = imports(path, "hmad.backends.bad")
    assert any(floor(n) == "engine" for n in names if n.startswith("hmad."))
    assert "engine" not in ALLOWED[floor("hmad.backends.bad")]
