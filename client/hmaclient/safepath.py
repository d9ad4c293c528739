"""Whether a socket path is safe to talk to: who owns the socket and every directory above it.

A client sends its prompts to whoever listens on the socket, so before connecting it checks that no other
unprivileged user could be the one listening, the way OpenSSH checks the files it trusts (StrictModes).
``unsafe_reason(path)`` walks the path from ``/`` down and returns why it is unsafe, or None:

- Trusted owners are you and root, and a *service account* where root handed it a directory: a system
  user (uid 1 to ``SYS_UID_MAX`` of /etc/login.defs, 999 by default; never ``nobody``) owning a directory
  whose parent belongs to root and is writable by root alone. Only root can have made that directory and
  given it away, which is what systemd's ``RuntimeDirectory=hmad`` does: /run/hmad belongs to the hmad
  user (mode 0750) in root's /run. That account is trusted below its directory, so the service's socket
  (hmad:hmad, 0660; clients are in group hmad) is accepted, while a regular user's home or runtime
  directory (uid 1000 and up) is not.
- Every directory on the way belongs to a trusted owner and is writable by its owner alone: group or
  others' write permission lets them replace the socket. The exception is a root-owned sticky directory
  (/tmp, mode 1777), where only an entry's owner may remove or rename it: there the next entry must be
  yours or root's (a sticky directory hands nothing to a service account).
- The socket belongs to a trusted owner. Its own mode does not matter: on a socket, write permission is
  the right to connect, not to replace it.
- A symbolic link on the way must belong to a trusted owner, and the path it leads to is checked too.

A path that does not exist yet is checked as far as it goes (the client then reports the missing socket);
a directory this user may not search ends the walk too (connecting through it fails the same way).
"""

from __future__ import annotations

import functools
import os
import pwd
import stat

LOGIN_DEFS = "/etc/login.defs"
DEFAULT_SYS_UID_MAX = 999  # shadow-utils' default when login.defs does not set SYS_UID_MAX


def unsafe_reason(path: str, uid: int | None = None) -> str | None:
    """Why the socket at ``path`` may be someone else's (a sentence naming the path at fault), or None.

    ``uid``: whose client this is (default: the effective uid)."""
    uid = os.geteuid() if uid is None else uid
    literal = os.path.abspath(path)
    for walked in dict.fromkeys((literal, os.path.realpath(literal))):
        reason = _walk(walked, uid)
        if reason is not None:
            return reason
    return None


def _walk(path: str, uid: int) -> str | None:
    trusted = {0, uid}
    parts = [p for p in path.split("/") if p]
    prefixes = ["/"] + ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]
    parent: os.stat_result | None = None
    for here in prefixes:
        try:
            st = os.lstat(here)
            if stat.S_ISLNK(st.st_mode):
                if st.st_uid not in trusted:
                    return f"{here} is a symbolic link owned by {_who(st.st_uid)}, {_NOT_TRUSTED}"
                st = os.stat(here)
        except OSError:  # missing, or not ours to search: connecting fails there too
            return None
        if not stat.S_ISDIR(st.st_mode):  # the socket (or whatever stands in its place)
            return None if st.st_uid in trusted else f"{here} is owned by {_who(st.st_uid)}, {_NOT_TRUSTED}"
        if st.st_uid not in trusted:
            if not (parent is not None and _hands_over(parent) and _service_account(st.st_uid)):
                return f"{here} is owned by {_who(st.st_uid)}, {_NOT_TRUSTED}"
            trusted.add(st.st_uid)
        writable = _writable_by_others(st)
        if writable:
            return f"{here} is writable by {writable} (mode {stat.S_IMODE(st.st_mode):04o})"
        parent = st
    return None


_NOT_TRUSTED = "not by you, root or the service account that root gave its directory"


def _writable_by_others(st: os.stat_result) -> str | None:
    """'group', 'others' or 'group and others' when they may write in this directory (None: only its
    owner may, or it is root's and sticky)."""
    if st.st_mode & stat.S_ISVTX and st.st_uid == 0:
        return None
    who = [name for bit, name in ((stat.S_IWGRP, "group"), (stat.S_IWOTH, "others")) if st.st_mode & bit]
    return " and ".join(who) or None


def _hands_over(parent: os.stat_result) -> bool:
    """Whether only root could have made an entry in this directory (root's, writable by root alone)."""
    return parent.st_uid == 0 and not parent.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _service_account(uid: int) -> bool:
    return 0 < uid <= sys_uid_max()


@functools.cache
def sys_uid_max() -> int:
    """The highest uid of a system account: SYS_UID_MAX in /etc/login.defs, else 999."""
    try:
        with open(LOGIN_DEFS) as f:
            for line in f:
                words = line.partition("#")[0].split()
                if len(words) == 2 and words[0] == "SYS_UID_MAX" and words[1].isdigit():
                    return int(words[1])
    except OSError:
        pass
    return DEFAULT_SYS_UID_MAX


def _who(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"
