#!/bin/bash
# Install hmad as a systemd service on Debian 12/13 or Ubuntu, as root, from this checkout:
#
#   sudo systemd/install.sh [--enable]
#
# - a venv at /opt/hmad/venv with hmad and its extras (default-model, openai) from this checkout: Debian
#   refuses `pip install .` into the system Python (externally-managed-environment), and a venv outside
#   /home keeps the unit's ProtectHome=yes;
# - the units in /etc/systemd/system, ExecStart pointing at that venv; hmad-openai.service too (the gateway
#   as a unit of its own, not enabled: hmad serves HTTP itself when http.enabled is true);
# - the user and directories: /etc/sysusers.d/hmad.conf and /etc/tmpfiles.d/hmad.conf, applied with
#   systemd-sysusers and systemd-tmpfiles (neither needs a running systemd);
# - /etc/hmad/hmad.yaml from etc/hmad.yaml, unless one is there (it is never overwritten);
# - systemctl daemon-reload (and, with --enable, enable --now hmad) when systemd runs as PID 1; in a
#   container without it, a note says what is left.
# Running it again upgrades hmad in the venv and the units, and changes nothing else.
#
# Options:
#   --root DIR       install under DIR instead of / (an image, a test): files go to DIR/etc/..., the venv to
#                    DIR/opt/hmad/venv; nothing is asked of a running systemd
#   --venv DIR       the venv (default /opt/hmad/venv); the units' ExecStart follows it
#   --no-venv        no venv, no pip: the venv is made otherwise (a package, an image layer)
#   --from SPEC      what pip installs instead of this checkout (repeatable): a directory, a wheel, with its
#                    extras, e.g. --from ./hmaclient-0.1.0-py3-none-any.whl --from './hmad-0.1.0-py3-none-any.whl[openai]'
#   --extras LIST    the extras of this checkout's hmad (default: default-model,openai)
#   --pip-args ARGS  more arguments for pip install (e.g. "--no-index --find-links /srv/wheels")
#   --socket-only    also install hmad.service.d/socket-only.conf: no HTTP, a private network namespace
#   --enable         systemctl enable --now hmad at the end
#   --uninstall      stop and disable the units, remove them, the venv and the sysusers/tmpfiles files;
#                    with --purge also /etc/hmad, /var/lib/hmad and /var/cache/hmad (the user stays)
set -euo pipefail
umask 022  # the venv and the units readable by all (the hmad user runs the venv); the config gets 0640

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROOT=""
VENV=/opt/hmad/venv
MAKE_VENV=1
SPECS=()
EXTRAS=default-model,openai
PIP_ARGS=""
SOCKET_ONLY=0
ENABLE=0
UNINSTALL=0
PURGE=0

say() { echo "hmad install: $*"; }
note() { echo "hmad install: note: $*"; }
die() { echo "hmad install: error: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --root) ROOT=${2:?--root needs a directory}; shift 2 ;;
    --venv) VENV=${2:?--venv needs a directory}; shift 2 ;;
    --no-venv) MAKE_VENV=0; shift ;;
    --from) SPECS+=("${2:?--from needs a pip requirement}"); shift 2 ;;
    --extras) EXTRAS=${2?--extras needs a list}; shift 2 ;;
    --pip-args) PIP_ARGS=${2?--pip-args needs arguments}; shift 2 ;;
    --socket-only) SOCKET_ONLY=1; shift ;;
    --enable) ENABLE=1; shift ;;
    --uninstall) UNINSTALL=1; shift ;;
    --purge) PURGE=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

if [ -n "$ROOT" ]; then
  mkdir -p "$ROOT" && ROOT=$(cd "$ROOT" && pwd)
  [ "$ROOT" != / ] || ROOT=""
fi
[ -n "$ROOT" ] || [ "$(id -u)" -eq 0 ] || die "run it as root (sudo $0), or give --root DIR"
case "$VENV" in
  /home/*|/root|/root/*|/run/user/*) die "--venv $VENV: the unit's ProtectHome=yes hides /home, /root and /run/user" ;;
  /|/*/..|/*/../*) die "--venv $VENV: a directory of its own, please" ;;
  /*) ;;
  *) die "--venv $VENV: an absolute path, please" ;;
esac
UNITS=$ROOT/etc/systemd/system
# systemd itself runs (not a container, not a chroot, not --root): then systemctl may be asked
live_systemd() { [ -z "$ROOT" ] && [ -d /run/systemd/system ]; }
have() { command -v "$1" >/dev/null 2>&1; }

uninstall() {
  if live_systemd; then
    systemctl disable --now hmad-openai.service hmad.service || true
  fi
  rm -f "$UNITS/hmad.service" "$UNITS/hmad-openai.service" "$UNITS/hmad.service.d/socket-only.conf"
  rmdir "$UNITS/hmad.service.d" 2>/dev/null || true
  rm -f "$ROOT/etc/sysusers.d/hmad.conf" "$ROOT/etc/tmpfiles.d/hmad.conf"
  if [ -f "$ROOT$VENV/pyvenv.cfg" ]; then rm -rf -- "$ROOT$VENV"; fi  # a venv, and only that
  rmdir "$(dirname "$ROOT$VENV")" 2>/dev/null || true
  if [ "$PURGE" -eq 1 ]; then
    rm -rf "$ROOT/etc/hmad" "$ROOT/var/lib/hmad" "$ROOT/var/cache/hmad"
  else
    note "kept $ROOT/etc/hmad, $ROOT/var/lib/hmad and $ROOT/var/cache/hmad (models): --purge removes them"
  fi
  if live_systemd; then systemctl daemon-reload; fi
  note "the user hmad stays (userdel hmad removes it)"
  say "uninstalled"
}

make_venv() {
  local py=$ROOT$VENV/bin/python
  if ! [ -x "$py" ] || ! "$py" -m pip --version >/dev/null 2>&1; then  # none, or one left without pip
    have python3 || die "python3 is missing: apt-get install python3 python3-venv"
    say "creating the venv $ROOT$VENV"
    python3 -m venv "$ROOT$VENV" || die "cannot make a venv: apt-get install python3-venv"
  fi
  if [ ${#SPECS[@]} -eq 0 ]; then
    [ -f "$SRC/pyproject.toml" ] || die "$SRC is not an hmad checkout: give --from SPEC"
    SPECS=("$SRC/client" "$SRC[$EXTRAS]")
  fi
  say "pip install ${SPECS[*]}"
  # shellcheck disable=SC2086  # PIP_ARGS is a list of arguments
  "$py" -m pip install --quiet --disable-pip-version-check $PIP_ARGS "${SPECS[@]}"
  [ -x "$ROOT$VENV/bin/hmad" ] || die "pip installed no $VENV/bin/hmad"
}

# gid of a group in $ROOT/etc/group (empty if none), so that --root never reads the host's groups
gid_of() { awk -F: -v g="$1" '$1 == g { print $3 }' "$ROOT/etc/group" 2>/dev/null || true; }

install_unit() {  # install_unit FILE: into $UNITS, its ExecStart on $VENV
  sed "s#/opt/hmad/venv/bin/#$VENV/bin/#g" "$SRC/systemd/$1" > "$UNITS/$1.new"
  chmod 0644 "$UNITS/$1.new" && mv "$UNITS/$1.new" "$UNITS/$1"
}

install_files() {
  mkdir -p "$UNITS" "$ROOT/etc/sysusers.d" "$ROOT/etc/tmpfiles.d"
  install_unit hmad.service
  install_unit hmad-openai.service
  if [ "$SOCKET_ONLY" -eq 1 ]; then
    install -D -m 0644 "$SRC/systemd/socket-only.conf" "$UNITS/hmad.service.d/socket-only.conf"
  elif [ -e "$UNITS/hmad.service.d/socket-only.conf" ]; then
    note "$UNITS/hmad.service.d/socket-only.conf stays: hmad serves no HTTP until you remove it"
  fi
  install -m 0644 "$SRC/systemd/hmad.sysusers" "$ROOT/etc/sysusers.d/hmad.conf"
  install -m 0644 "$SRC/systemd/hmad.tmpfiles" "$ROOT/etc/tmpfiles.d/hmad.conf"
  say "installed the units in $UNITS, sysusers.d/hmad.conf and tmpfiles.d/hmad.conf"
}

apply_users_and_dirs() {
  local rootopt=()
  [ -z "$ROOT" ] || rootopt=("--root=$ROOT")
  if have systemd-sysusers; then
    systemd-sysusers "${rootopt[@]}" "$ROOT/etc/sysusers.d/hmad.conf"
  else
    note "no systemd-sysusers: create the user yourself (useradd --system --home-dir /var/lib/hmad --groups render,video hmad)"
  fi
  if have systemd-tmpfiles && [ "$(id -u)" -eq 0 ]; then
    systemd-tmpfiles "${rootopt[@]}" --create "$ROOT/etc/tmpfiles.d/hmad.conf"
  else
    mkdir -p -m 0750 "$ROOT/etc/hmad"
    note "systemd-tmpfiles not run (it needs root; systemd runs it at boot): /etc/hmad and /var/cache/hmad come then"
  fi
}

install_config() {
  local cfg=$ROOT/etc/hmad/hmad.yaml gid
  if [ -e "$cfg" ]; then
    say "kept $cfg (the shipped one: $SRC/etc/hmad.yaml)"
    return
  fi
  [ -f "$SRC/etc/hmad.yaml" ] || { note "no $SRC/etc/hmad.yaml: $cfg not written (hmad runs on its defaults)"; return; }
  install -D -m 0640 "$SRC/etc/hmad.yaml" "$cfg"
  gid=$(gid_of hmad)
  if [ -n "$gid" ] && [ "$(id -u)" -eq 0 ]; then chgrp "$gid" "$cfg"; fi
  say "wrote $cfg"
}

tell_systemd() {
  if live_systemd; then
    systemctl daemon-reload
    if [ "$ENABLE" -eq 1 ]; then systemctl enable --now hmad.service; fi
  else
    note "systemd is not running here (a container, a chroot or --root): no daemon-reload; once it runs: systemctl enable --now hmad"
  fi
}

if [ "$UNINSTALL" -eq 1 ]; then
  uninstall
  exit 0
fi
if [ "$MAKE_VENV" -eq 1 ]; then make_venv; else note "no venv made (--no-venv): ExecStart expects $VENV/bin/hmad"; fi
install_files
apply_users_and_dirs
install_config
tell_systemd
say "done: $VENV/bin/hmad, config /etc/hmad/hmad.yaml (http.enabled for the HTTP API), logs: journalctl -u hmad"
