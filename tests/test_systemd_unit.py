"""systemd/hmad.service and friends: required settings, and systemd's own checks where systemd is installed.

The static checks always run. `systemd-analyze security --offline=yes` (exposure must stay ≤ 2.0),
`systemd-analyze verify`, `systemd-sysusers --root` and `systemd-tmpfiles --root` run offline, without a
running systemd, and are skipped (with the reason) only when the tool is not installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SYSTEMD_DIR = Path(__file__).resolve().parent.parent / "systemd"
UNIT = SYSTEMD_DIR / "hmad.service"
SYSUSERS = SYSTEMD_DIR / "hmad.sysusers"
TMPFILES = SYSTEMD_DIR / "hmad.tmpfiles"
MAX_EXPOSURE = 2.0
YES_HARDENING = [
    "NoNewPrivileges",
    "ProtectHome",
    "PrivateTmp",
    "PrivateMounts",
    "ProtectKernelTunables",
    "ProtectKernelModules",
    "ProtectKernelLogs",
    "ProtectControlGroups",
    "ProtectClock",
    "ProtectHostname",
    "RestrictNamespaces",
    "RestrictRealtime",
    "RestrictSUIDSGID",
    "LockPersonality",
    "RemoveIPC",
]


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """systemd unit syntax → {section: {key: [values in order]}}; keys repeat, "\\" continues a line.

    An empty assignment (``Key=``) is kept as "" (in systemd it resets the list, which callers can see).
    """
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            pending = line[:-1].rstrip() + " "
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"assignment outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


@pytest.fixture(scope="module")
def service() -> dict[str, list[str]]:
    return parse_unit(UNIT.read_text())["Service"]


def one(service: dict[str, list[str]], key: str) -> str:
    values = service.get(key)
    assert values, f"{key}= missing from {UNIT.name}"
    return values[-1]


def words(service: dict[str, list[str]], key: str) -> set[str]:
    return {w for v in service.get(key, []) for w in v.split()}


# ---- static checks ------------------------------------------------------------------------------------


def test_parser_handles_repeats_continuations_and_empty_values():
    parsed = parse_unit("# c\n[S]\nA=1\nA=2\nB=x \\\n  y\nC=\n; c\n")
    assert parsed == {"S": {"A": ["1", "2"], "B": ["x y"], "C": [""]}}


def test_lifecycle(service):
    assert one(service, "Type") == "notify"
    assert one(service, "NotifyAccess") == "main"
    assert one(service, "ExecStart") == "/opt/hmad/venv/bin/hmad --config /etc/hmad/hmad.yaml"  # install.sh
    assert one(service, "KillMode") == "mixed"  # hmad stops its HTTP gateway child itself
    assert one(service, "WatchdogSec") == "30"
    assert one(service, "TimeoutStartSec") == "120"
    assert one(service, "TimeoutStopSec") == "30"
    assert one(service, "Restart") == "on-failure"
    assert one(service, "RestartSec") == "2"
    # connections are files: far above server.max_connections, so a flood cannot make libzmq abort
    assert int(one(service, "LimitNOFILE")) >= 4 * 1024
    assert "multi-user.target" in parse_unit(UNIT.read_text())["Install"]["WantedBy"]


def test_identity_and_directories(service):
    assert one(service, "User") == "hmad"
    assert one(service, "Group") == "hmad"
    assert {"render", "video"} <= words(service, "SupplementaryGroups")
    assert one(service, "RuntimeDirectory") == "hmad"
    assert one(service, "RuntimeDirectoryMode") == "0750"
    assert one(service, "CacheDirectory") == "hmad"
    assert "HMAD_CACHE_DIR=/var/cache/hmad" in words(service, "Environment")
    assert one(service, "UMask") == "0027"
    assert one(service, "LimitMEMLOCK") == "infinity"  # XRT pins the NPU's buffer objects
    assert "XILINX_XRT=/opt/xilinx/xrt" in words(service, "Environment")


def test_devices(service):
    """Only DRM nodes (/dev/dri/*) and accel nodes (/dev/accel/*) on top of the pseudo devices."""
    assert one(service, "DevicePolicy") == "closed"
    allowed = dict(v.split() for v in service["DeviceAllow"])
    assert allowed == {"char-drm": "rw", "char-accel": "rw"}
    assert service.get("PrivateDevices", ["no"])[-1] == "no", "PrivateDevices hides /dev/dri"


def test_hardening(service):
    for key in YES_HARDENING:
        assert one(service, key) == "yes", key
    assert one(service, "ProtectSystem") == "strict"
    assert one(service, "ProtectProc") == "invisible"
    assert one(service, "SystemCallArchitectures") == "native"
    assert service["SystemCallFilter"][0] == "@system-service"
    assert one(service, "CapabilityBoundingSet") == ""
    assert one(service, "AmbientCapabilities") == ""
    # the socket is AF_UNIX; TCP for the HTTP gateway child (http.enabled), with loopback peers only
    assert words(service, "RestrictAddressFamilies") == {"AF_UNIX", "AF_INET", "AF_INET6"}
    assert service.get("PrivateNetwork", ["no"])[-1] == "no", "a private network hides the HTTP listener"
    assert one(service, "IPAddressAllow") == "localhost" and one(service, "IPAddressDeny") == "any"


def test_sysusers_lines():
    lines = [ln.split(None, 2) for ln in SYSUSERS.read_text().splitlines() if ln and not ln.startswith("#")]
    assert ["u", "hmad", '- "hmad inference daemon" /var/lib/hmad'] in lines
    assert ["m", "hmad", "render"] in lines
    assert ["m", "hmad", "video"] in lines


# ---- systemd's own checks (offline) -------------------------------------------------------------------


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (apt-get install systemd)")
    return path


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SYSTEMD_COLORS": "0", "SYSTEMD_PAGER": "", "LC_ALL": "C.UTF-8"}
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)


def test_security_exposure_at_most_2():
    analyze = _tool("systemd-analyze")
    res = _run(analyze, "security", "--offline=yes", str(UNIT))
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", res.stdout)
    assert m, f"no exposure line (rc={res.returncode}):\n{res.stdout}\n{res.stderr}"
    exposure = float(m.group(1))
    assert exposure <= MAX_EXPOSURE, f"exposure {exposure} > {MAX_EXPOSURE}:\n{res.stdout}"


def test_verify(tmp_path):
    """The unit parses with no warnings; ExecStart points at a stand-in, as hmad need not be installed."""
    analyze = _tool("systemd-analyze")
    true = shutil.which("true")
    text = UNIT.read_text().replace("ExecStart=/opt/hmad/venv/bin/hmad ", f"ExecStart={true} ")
    unit = tmp_path / "hmad.service"
    unit.write_text(text)
    res = _run(analyze, "verify", "--man=no", "--generators=no", str(unit))
    complaints = [ln for ln in res.stderr.splitlines() if str(unit) in ln]
    assert res.returncode == 0 and not complaints, f"rc={res.returncode}\n{res.stderr}"


def test_sysusers_creates_user_and_memberships(tmp_path):
    sysusers = _tool("systemd-sysusers")
    (tmp_path / "etc").mkdir()
    res = _run(sysusers, f"--root={tmp_path}", str(SYSUSERS))
    assert res.returncode == 0, res.stderr
    passwd = (tmp_path / "etc/passwd").read_text().splitlines()
    group_lines = (tmp_path / "etc/group").read_text().split()
    group = {ln.split(":")[0]: ln.split(":")[3].split(",") for ln in group_lines}
    [hmad] = [ln.split(":") for ln in passwd if ln.startswith("hmad:")]
    assert hmad[5] == "/var/lib/hmad"
    assert "hmad" in group["render"] and "hmad" in group["video"] and "hmad" in group


def test_tmpfiles_creates_config_and_cache_dirs(tmp_path):
    sysusers, tmpfiles = _tool("systemd-sysusers"), _tool("systemd-tmpfiles")
    if os.geteuid() != 0:
        pytest.skip("systemd-tmpfiles --create chowns to hmad, which needs root")
    (tmp_path / "etc").mkdir()
    assert _run(sysusers, f"--root={tmp_path}", str(SYSUSERS)).returncode == 0
    res = _run(tmpfiles, f"--root={tmp_path}", "--create", str(TMPFILES))
    assert res.returncode == 0, res.stderr
    etc, cache = (tmp_path / "etc/hmad").stat(), (tmp_path / "var/cache/hmad").stat()
    assert etc.st_uid == 0 and etc.st_mode & 0o777 == 0o750
    assert cache.st_uid == cache.st_gid == etc.st_gid != 0 and cache.st_mode & 0o777 == 0o750


# ---- hmad-openai.service: the HTTP gateway beside hmad ------------------------------------------------

GATEWAY_UNIT = SYSTEMD_DIR / "hmad-openai.service"


@pytest.fixture(scope="module")
def gateway_unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit(GATEWAY_UNIT.read_text())


def test_gateway_follows_hmad_on_loopback(gateway_unit):
    unit, service = gateway_unit["Unit"], gateway_unit["Service"]
    assert "hmad.service" in unit["Requires"] and "hmad.service" in unit["After"]
    argv = one(service, "ExecStart").split()
    assert argv[0] == "/opt/hmad/venv/bin/hmad-openai"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--socket") + 1] == "/run/hmad/hmad.sock"
    assert one(service, "EnvironmentFile") == "-/etc/hmad/openai.env"  # HMAD_OPENAI_API_KEY, optional
    assert one(service, "Restart") == "on-failure"
    assert "multi-user.target" in gateway_unit["Install"]["WantedBy"]


def test_gateway_hardening(gateway_unit):
    service = gateway_unit["Service"]
    assert one(service, "DynamicUser") == "yes" and words(service, "SupplementaryGroups") == {"hmad"}
    for key in [k for k in YES_HARDENING if k != "PrivateNetwork"] + [
        "PrivateDevices",
        "MemoryDenyWriteExecute",
    ]:
        assert one(service, key) == "yes", key
    assert one(service, "ProtectSystem") == "strict"
    assert one(service, "CapabilityBoundingSet") == ""
    assert words(service, "RestrictAddressFamilies") == {"AF_UNIX", "AF_INET", "AF_INET6"}
    assert one(service, "IPAddressAllow") == "localhost" and one(service, "IPAddressDeny") == "any"
    assert service["SystemCallFilter"][0] == "@system-service"


def test_gateway_security_exposure_at_most_2():
    analyze = _tool("systemd-analyze")
    res = _run(analyze, "security", "--offline=yes", str(GATEWAY_UNIT))
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", res.stdout)
    assert m, f"no exposure line (rc={res.returncode}):\n{res.stdout}\n{res.stderr}"
    assert float(m.group(1)) <= MAX_EXPOSURE, res.stdout


def test_gateway_verify(tmp_path):
    """Both units side by side (Requires=hmad.service must resolve), ExecStart pointing at a stand-in."""
    analyze = _tool("systemd-analyze")
    true = shutil.which("true")
    for unit, exe in ((UNIT, "/opt/hmad/venv/bin/hmad "), (GATEWAY_UNIT, "/opt/hmad/venv/bin/hmad-openai ")):
        (tmp_path / unit.name).write_text(unit.read_text().replace(f"ExecStart={exe}", f"ExecStart={true} "))
    gateway = tmp_path / GATEWAY_UNIT.name
    res = _run(analyze, "verify", "--man=no", "--generators=no", str(gateway))
    complaints = [ln for ln in res.stderr.splitlines() if str(tmp_path) in ln]
    assert res.returncode == 0 and not complaints, f"rc={res.returncode}\n{res.stderr}"
