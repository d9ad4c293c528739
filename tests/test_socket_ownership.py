"""Clients refuse a socket that another user could own (hmaclient.safepath): a real daemon, real directories
whose modes and owners the tests change, and (as root) real clients run as another user."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import zmq
from daemon_harness import Daemon
from tiny_gguf import make_tiny_gguf

from hmaclient import Client, UnsafeSocket, cli
from hmaclient import protocol as P
from hmaclient.safepath import sys_uid_max, unsafe_reason

NOBODY = 65534
SERVICE = 1  # "daemon" on Debian: a system account (uid <= SYS_UID_MAX)
OTHER = 1000  # a regular user's uid
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="changing owners needs root")


@pytest.fixture(scope="module")
def base():
    """A directory under /tmp that every user may search (pytest's tmp_path is root's alone)."""
    d = tempfile.mkdtemp(prefix="hmad-own-", dir="/tmp")
    os.chmod(d, 0o755)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(base):
    model = make_tiny_gguf(base / "tiny.gguf", seed=3)
    d = Daemon(model, base)  # socket: base/run/hmad.sock
    yield d.wait_ready()
    assert d.stop() == 0, d.log_text()


@pytest.fixture
def run_dir(daemon):
    """The daemon's socket directory, put back as it was (mode and owners) after the test."""
    d, sock = Path(daemon.socket).parent, Path(daemon.socket)
    saved = [(p, os.stat(p)) for p in (d, sock)]
    yield d
    for p, st in saved:
        os.chown(p, st.st_uid, st.st_gid)
        os.chmod(p, st.st_mode & 0o7777)


def _refused(path: str) -> UnsafeSocket:
    with pytest.raises(UnsafeSocket) as info, Client(path, connect_timeout=2) as c:
        c.ping()
    return info.value


def test_own_socket_in_own_directory_is_used(daemon):
    assert unsafe_reason(daemon.socket) is None
    with Client(daemon.socket) as c:
        assert c.ping() > 0


@pytest.mark.parametrize(("mode", "who"), [(0o770, "group"), (0o757, "others"), (0o777, "group and others")])
def test_directory_others_may_write_is_refused(daemon, run_dir, mode, who, capsys):
    os.chmod(run_dir, mode)
    e = _refused(daemon.socket)
    assert f"{run_dir} is writable by {who} (mode {mode:04o})" in str(e) and daemon.socket in str(e)
    assert cli.main(["--socket", daemon.socket, "ping"]) == cli.EXIT_UNREACHABLE
    assert (
        f"refusing hmad's socket {daemon.socket}: {run_dir} is writable by {who}" in capsys.readouterr().err
    )
    os.chmod(run_dir, 0o750)
    with Client(daemon.socket) as c:  # the same client code accepts it once fixed
        assert c.ping() > 0


@AS_ROOT
def test_directory_or_socket_of_another_user_is_refused(daemon, run_dir):
    os.chown(run_dir, NOBODY, -1)
    assert f"{run_dir} is owned by uid {NOBODY} (nobody)" in str(_refused(daemon.socket))
    os.chown(run_dir, 0, -1)
    os.chown(daemon.socket, OTHER, -1)
    assert f"{daemon.socket} is owned by uid {OTHER}" in str(_refused(daemon.socket))


@AS_ROOT
def test_symbolic_links_are_checked_and_followed(daemon, run_dir, base):
    link = base / "link.sock"
    link.symlink_to(daemon.socket)
    try:
        with Client(str(link)) as c:  # root's link to a safe socket
            assert c.ping() > 0
        os.lchown(link, NOBODY, NOBODY)
        assert f"{link} is a symbolic link owned by uid {NOBODY}" in str(_refused(str(link)))
        os.lchown(link, 0, 0)
        os.chmod(run_dir, 0o777)  # the link is safe, where it leads is not
        assert f"{run_dir} is writable by group and others" in str(_refused(str(link)))
    finally:
        link.unlink()


def test_service_account_directory_handed_over_by_root(base):
    """systemd's layout: /run (root, 0755) / hmad (the service user, 0750) / hmad.sock (service user, 0660):
    accepted for a client of another uid. The same directory given to a regular user, to nobody, or made
    in a sticky directory anyone may write (where root handed nothing over) is refused."""
    assert sys_uid_max() >= SERVICE
    tree = base / "svc-tree"
    run, sticky = tree / "run", tree / "tmp"
    for d, mode in ((tree, 0o755), (run, 0o755), (sticky, 0o1777)):
        d.mkdir(exist_ok=True)
        os.chmod(d, mode)
    for parent in (run, sticky):
        (parent / "hmad").mkdir(exist_ok=True)
        os.chmod(parent / "hmad", 0o750)
        (parent / "hmad" / "hmad.sock").touch()  # ownership is what is checked; a file stands in
    if os.geteuid() != 0:
        pytest.skip("changing owners needs root")
    try:
        for owner, ok in ((SERVICE, True), (OTHER, False), (NOBODY, False)):
            for p in (run / "hmad", run / "hmad" / "hmad.sock"):
                os.chown(p, owner, -1)
            reason = unsafe_reason(str(run / "hmad" / "hmad.sock"), uid=OTHER + 1)
            assert (reason is None) == ok, (owner, reason)
        os.chown(run / "hmad", SERVICE, -1)
        os.chown(run / "hmad" / "hmad.sock", OTHER, -1)  # a socket the service account does not own
        assert "hmad.sock is owned by uid 1000" in unsafe_reason(
            str(run / "hmad" / "hmad.sock"), uid=OTHER + 1
        )
        for p in (sticky / "hmad", sticky / "hmad" / "hmad.sock"):
            os.chown(p, SERVICE, -1)
        reason = unsafe_reason(str(sticky / "hmad" / "hmad.sock"), uid=OTHER + 1)
        assert reason == f"{sticky / 'hmad'} is owned by uid {SERVICE} ({_name(SERVICE)}), {_NOT_TRUSTED}"
    finally:
        shutil.rmtree(tree)


_NOT_TRUSTED = "not by you, root or the service account that root gave its directory"


def _name(uid: int) -> str:
    import pwd

    return pwd.getpwuid(uid).pw_name


# -- as another user -------------------------------------------------------------------------------------


# The interpreter may live where nobody cannot read (a root-only pyenv): it starts as root, imports hmactl,
# then becomes nobody for good before hmactl runs.
_DROP_TO_NOBODY = f"""
import os, sys, shutil, asyncio, asyncio.unix_events, json, zmq.asyncio
from hmaclient import cli
cli.build_parser().format_help()  # argparse's lazy imports, while the files can still be read
os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
assert os.getuid() == os.geteuid() == {NOBODY}
sys.exit(cli.main(sys.argv[1:]))
"""


def _as_nobody(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``hmactl args`` run as nobody (no supplementary groups), with only ``env`` and PATH set."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", **(env or {})}
    cmd = [sys.executable, "-c", _DROP_TO_NOBODY, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def nobody_can_run():
    if os.geteuid() != 0:
        pytest.skip("running a client as another user needs root")
    probe = _as_nobody("--help")
    if probe.returncode != 0:
        pytest.skip(f"this interpreter cannot run as nobody: {probe.stderr[-300:]}")


def test_systemd_layout_serves_a_group_member_and_refuses_a_regular_users_socket(
    daemon, run_dir, base, nobody_can_run
):
    """The daemon's socket in a directory of a service account (mode 0750, group nobody's, as group hmad
    is for its clients; the socket 0660): a client of another user in that group talks to it. Given to a
    regular user instead, the same client refuses it and sends nothing."""
    os.chmod(base, 0o755)
    os.chown(run_dir, SERVICE, NOBODY)
    os.chown(daemon.socket, SERVICE, NOBODY)
    os.chmod(run_dir, 0o750)
    os.chmod(daemon.socket, 0o660)
    ok = _as_nobody("--socket", daemon.socket, "ping")
    assert ok.returncode == 0 and f"hmad is running at {daemon.socket}" in ok.stdout, ok.stderr
    os.chown(run_dir, OTHER, NOBODY)
    os.chown(daemon.socket, OTHER, NOBODY)
    refused = _as_nobody("--socket", daemon.socket, "ping")
    assert refused.returncode == cli.EXIT_UNREACHABLE, refused
    assert f"{run_dir} is owned by uid {OTHER}" in refused.stderr


def test_default_path_under_tmp_taken_by_another_user_is_refused(base, nobody_can_run):
    """The issue's attack: another user creates the client's fallback directory under the temp dir first and
    listens there. The client (default path, no $HMAD_SOCKET or $XDG_RUNTIME_DIR) refuses it, and the
    impostor receives nothing."""
    if os.path.isdir(P.SYSTEM_SOCKET_DIR):
        pytest.skip(f"{P.SYSTEM_SOCKET_DIR} exists here: it would be the default path")
    tmp = base / "tmp"
    tmp.mkdir(exist_ok=True)
    os.chmod(tmp, 0o1777)
    env = {"TMPDIR": str(tmp)}
    path = P.default_socket_path(env, euid=NOBODY)
    assert path == f"{tmp}/hmad-{NOBODY}/hmad.sock"
    os.mkdir(os.path.dirname(path), 0o755)
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as impostor:
        impostor.bind(P.endpoint(path))
        for p in (os.path.dirname(path), path):
            os.chown(p, OTHER, OTHER)
        os.chmod(path, 0o666)
        r = _as_nobody("ping", env=env)
        assert r.returncode == cli.EXIT_UNREACHABLE, r
        assert f"refusing hmad's socket {path}: {os.path.dirname(path)} is owned by uid {OTHER}" in r.stderr
        assert impostor.poll(200) == 0  # no ping, no prompt
