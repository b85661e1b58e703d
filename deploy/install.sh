#!/usr/bin/env bash
# Installs everything tectonic-py needs on a fresh Debian machine: the FUSE and
# build packages from apt, then a virtualenv (.venv) holding the project, its test
# extras and torch (pinned: the local CPU wheel; an unpinned torch pulls GBs).
# Idempotent: a second run only checks. Needs root (or sudo) for apt.
set -euo pipefail
cd "$(dirname "$0")/.."

# etcd-server: the etcd metadata engine's store (the local cluster starts its own members).
# rsync, attr: the mount's POSIX round-trip tests (rsync -aHX; getfattr/setfattr for users).
# prometheus: the metrics test scrapes a cluster with a real server (tests/test_metrics_prometheus.py).
APT_PACKAGES=(fuse3 libfuse3-dev pkg-config gcc python3-venv python3-dev iproute2 psmisc etcd-server rsync attr prometheus)
need=()
for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
# python3-venv/python3-dev are only needed when the interpreter is Debian's own.
if [ ${#need[@]} -gt 0 ]; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null || { echo "install.sh: run as root to install: ${need[*]}" >&2; exit 1; }
        SUDO="sudo"
    fi
    echo "installing apt packages: ${need[*]}" >&2
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
    # Debian's package enables a default etcd on localhost:2379; tectonic-py never uses it.
    if [[ " ${need[*]} " == *" etcd-server "* ]] && [ -d /run/systemd/system ]; then
        $SUDO systemctl disable --now etcd >/dev/null 2>&1 || true
    fi
    # Likewise Debian's Prometheus (and the node exporter it recommends) on :9090 and :9100:
    # the tests start their own, on free ports, with a configuration of their own.
    if [[ " ${need[*]} " == *" prometheus "* ]] && [ -d /run/systemd/system ]; then
        $SUDO systemctl disable --now prometheus prometheus-node-exporter >/dev/null 2>&1 || true
    fi
fi

PYTHON="${PYTHON:-python3}"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || {
    echo "install.sh: needs Python 3.11 or later as $PYTHON (Debian 12 or later), or set PYTHON=" >&2
    exit 1
}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.tectonic-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    # --no-compile: byte-compiling every file of torch costs more CPU than the rest of the
    # install (15 s of 19 s here); Python compiles what is imported, on first use
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q --no-compile "torch==2.13.0"
    .venv/bin/python -m pip install -q --no-compile -e ".[test,bench,lint]"
    touch "$stamp"
fi

# mount(8) finds filesystem helpers in /sbin: `mount -t tectonic` and fstab lines of type
# tectonic run this venv's mount.tectonic. One that works already (another checkout's) is
# kept; a missing or dangling one is (re)made.
helper=/sbin/mount.tectonic
if [ "$(id -u)" -eq 0 ] && [ ! -e "$helper" ]; then
    ln -sfn "$PWD/.venv/bin/mount.tectonic" "$helper"
fi
