"""systemd/install.sh into a temporary root (``--root DIR``): the files it installs, a run again that changes
nothing, the venv and pip step, the drop-in without network, uninstall; then ``systemd-analyze verify`` on the
units as installed, where systemd-analyze exists (no PID 1 is needed for it).

The venv test installs a stand-in wheel (tests cannot reach PyPI): a package named fake-hmad whose console
scripts are ``hmad`` and ``hmad-openai``, so the venv, pip and the units' ExecStart are exercised for real.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "systemd" / "install.sh"
VENV_BIN = "/opt/hmad/venv/bin"
UNIT_FILES = ("etc/systemd/system/hmad.service", "etc/systemd/system/hmad-openai.service")
OTHER_FILES = ("etc/sysusers.d/hmad.conf", "etc/tmpfiles.d/hmad.conf", "etc/hmad/hmad.yaml")
SYSTEMD_ENV = {"SYSTEMD_COLORS": "0", "SYSTEMD_PAGER": "", "LC_ALL": "C.UTF-8"}


def install(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        ["bash", str(SCRIPT), "--root", str(root), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **SYSTEMD_ENV},
    )
    if check:
        assert res.returncode == 0, f"rc={res.returncode}\n{res.stdout}\n{res.stderr}"
    return res


def exec_start(unit: Path) -> str:
    return next(ln.partition("=")[2] for ln in unit.read_text().splitlines() if ln.startswith("ExecStart="))


def digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "opt" not in p.relative_to(root).parts and not p.name.startswith(".")
    }


def fake_wheel(folder: Path) -> Path:
    """A wheel whose console scripts ``hmad`` and ``hmad-openai`` print their names."""
    info = "fake_hmad-0.1.dist-info"
    files = {
        "fakehmad/__init__.py": "import sys\n\ndef main():\n    print(sys.argv[0].rsplit('/', 1)[-1])\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: fake-hmad\nVersion: 0.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": "[console_scripts]\nhmad = fakehmad:main\nhmad-openai = fakehmad:main\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    wheel = folder / "fake_hmad-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return wheel


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (apt-get install systemd)")
    return path


# -- the files ---------------------------------------------------------------------------------------------


def test_installs_units_users_and_config_and_a_run_again_changes_nothing(tmp_path):
    first = install(tmp_path, "--no-venv")
    for rel in (*UNIT_FILES, *OTHER_FILES):
        assert (tmp_path / rel).is_file(), f"{rel} missing:\n{first.stdout}"
    unit, gateway = (tmp_path / rel for rel in UNIT_FILES)
    assert exec_start(unit) == f"{VENV_BIN}/hmad --config /etc/hmad/hmad.yaml"
    assert exec_start(gateway).startswith(f"{VENV_BIN}/hmad-openai ")
    assert unit.read_text().replace(f"{VENV_BIN}/", "") == (
        REPO / "systemd/hmad.service"
    ).read_text().replace(f"{VENV_BIN}/", "")
    assert (tmp_path / "etc/hmad/hmad.yaml").read_text() == (REPO / "etc/hmad.yaml").read_text()
    assert (tmp_path / "etc/hmad/hmad.yaml").stat().st_mode & 0o777 == 0o640
    assert "systemd is not running here" in first.stdout and "no venv made" in first.stdout
    if shutil.which("systemd-sysusers"):  # the user, in the root's own passwd
        assert [ln for ln in (tmp_path / "etc/passwd").read_text().splitlines() if ln.startswith("hmad:")]

    (tmp_path / "etc/hmad/hmad.yaml").write_text("http:\n  enabled: true\n")  # the admin's edit
    before = digests(tmp_path)
    again = install(tmp_path, "--no-venv")
    assert digests(tmp_path) == before, "a second run changed files"
    assert (
        "kept" in again.stdout and (tmp_path / "etc/hmad/hmad.yaml").read_text() == "http:\n  enabled: true\n"
    )


def test_the_venv_option_moves_exec_start(tmp_path):
    install(tmp_path, "--no-venv", "--venv", "/srv/hmad/venv")
    unit, gateway = (tmp_path / rel for rel in UNIT_FILES)
    assert exec_start(unit) == "/srv/hmad/venv/bin/hmad --config /etc/hmad/hmad.yaml"
    assert exec_start(gateway).startswith("/srv/hmad/venv/bin/hmad-openai ")


@pytest.mark.parametrize("venv", ["/home/me/venv", "/root/venv", "opt/venv", "/"])
def test_refuses_a_venv_the_unit_could_not_run(tmp_path, venv):
    res = install(tmp_path, "--no-venv", "--venv", venv, check=False)
    assert res.returncode == 2 and "--venv" in res.stderr and not (tmp_path / UNIT_FILES[0]).exists()


def test_unknown_options_are_refused(tmp_path):
    res = install(tmp_path, "--frobnicate", check=False)
    assert res.returncode == 2 and "unknown option --frobnicate" in res.stderr


def test_uninstall_keeps_the_config_and_purge_removes_it(tmp_path):
    install(tmp_path, "--no-venv", "--socket-only")
    assert (tmp_path / "etc/systemd/system/hmad.service.d/socket-only.conf").is_file()
    res = install(tmp_path, "--uninstall")
    for rel in (*UNIT_FILES, "etc/sysusers.d/hmad.conf", "etc/tmpfiles.d/hmad.conf"):
        assert not (tmp_path / rel).exists(), rel
    assert not (tmp_path / "etc/systemd/system/hmad.service.d").exists()
    assert (tmp_path / "etc/hmad/hmad.yaml").is_file() and "--purge removes them" in res.stdout
    install(tmp_path, "--uninstall", "--purge")
    assert not (tmp_path / "etc/hmad").exists()


# -- the venv, and systemd's verdict on the units as installed --------------------------------------------


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A root with a real venv (pip installing the stand-in wheel, offline) and the socket-only drop-in."""
    root, wheels = tmp_path_factory.mktemp("root"), tmp_path_factory.mktemp("wheels")
    spec = str(fake_wheel(wheels))
    install(root, "--from", spec, "--pip-args", "--no-index", "--socket-only")
    return root


def test_the_venv_holds_what_exec_start_runs(installed):
    for rel in UNIT_FILES:
        exe = exec_start(installed / rel).split()[0]
        assert exe.startswith(f"{VENV_BIN}/")
        out = subprocess.run([f"{installed}{exe}"], capture_output=True, text=True, timeout=60).stdout
        assert out.strip() == Path(exe).name


def test_a_run_again_reuses_the_venv(installed, tmp_path):
    python = installed / VENV_BIN.lstrip("/") / "python"
    made = python.lstat().st_mtime_ns
    res = install(installed, "--from", str(fake_wheel(tmp_path)), "--pip-args", "--no-index")
    assert "creating the venv" not in res.stdout and python.lstat().st_mtime_ns == made


def test_systemd_analyze_verify_the_installed_units(installed, tmp_path):
    """The installed units (the socket-only drop-in included) load with no complaint; their ExecStart
    prefixed by the temporary root, where the venv is (verify checks that the program exists)."""
    analyze = _tool("systemd-analyze")
    units = installed / "etc/systemd/system"
    shutil.copytree(units, tmp_path / "units")
    for rel in UNIT_FILES:
        unit = tmp_path / "units" / Path(rel).name
        unit.write_text(
            unit.read_text().replace(f"ExecStart={VENV_BIN}/", f"ExecStart={installed}{VENV_BIN}/")
        )
    names = [str(tmp_path / "units" / Path(rel).name) for rel in UNIT_FILES]
    res = subprocess.run(
        [analyze, "verify", "--man=no", "--generators=no", *names],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **SYSTEMD_ENV},
    )
    complaints = [ln for ln in res.stderr.splitlines() if str(tmp_path) in ln or "hmad" in ln]
    assert res.returncode == 0 and not complaints, f"rc={res.returncode}\n{res.stderr}"


def test_the_socket_only_drop_in_takes_the_network_away(installed):
    """With socket-only.conf, hmad.service is back to a private network and AF_UNIX (exposure at most the
    unit's without it)."""
    analyze = _tool("systemd-analyze")

    def exposure(*args: str) -> tuple[float, str]:
        res = subprocess.run(
            [analyze, "security", "--offline=yes", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **SYSTEMD_ENV},
        )
        m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", res.stdout)
        assert m, f"rc={res.returncode}\n{res.stdout}\n{res.stderr}"
        return float(m.group(1)), res.stdout

    strict, shown = exposure(f"--root={installed}", "hmad.service")
    plain, _ = exposure(str(REPO / "systemd/hmad.service"))
    assert "Service has no access to the host's network" in shown
    assert "Service cannot allocate Internet sockets" in shown
    assert strict < plain
