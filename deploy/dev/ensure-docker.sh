#!/usr/bin/env bash
# What `make up` and the container tests need, installed or started only when missing:
#   1. Debian's docker.io, and compose v2 (deploy/dev/install-compose.sh)
#   2. dockerd (started here, with --cpu-rt-runtime on RT-group kernels and --userland-proxy=false; log /var/log/robobus-dockerd.log)
#   3. a base image: ROBOBUS_BASE_IMAGE if set, else python:3.11-slim-bookworm if present or pullable, else
#      robobus/base:bookworm made by deploy/docker/make-base-image.sh (no registry needed)
# Progress goes to stderr; stdout is one line to eval: export ROBOBUS_BASE_IMAGE=...
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
say() { echo "robobus: $*" >&2; }
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo -n"
# 1. docker and compose
if [ ! -x /usr/bin/docker ] || ! command -v dockerd >/dev/null; then
  say "installing docker.io (Debian)"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq
  $SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends docker.io >/dev/null
fi
"$here/dev/install-compose.sh" >&2

# 2. dockerd
if ! /usr/bin/docker info >/dev/null 2>&1; then
  args=()
  [ -e /sys/fs/cgroup/cpu/cpu.rt_runtime_us ] && args+=(--cpu-rt-runtime="${ROBOBUS_DOCKERD_RT_RUNTIME_US:-950000}")
  # Published ports by kernel NAT, not docker-proxy: a host client of the broker on 127.0.0.1 (the CLI, the
  # realtime container on the host network) otherwise goes through a user-space copy each way (deploy/README.md)
  [ "${ROBOBUS_DOCKERD_USERLAND_PROXY:-false}" = false ] && args+=(--userland-proxy=false)
  say "starting dockerd ${args[*]} (log: /var/log/robobus-dockerd.log)"
  $SUDO bash -c "setsid nohup dockerd ${args[*]} >>/var/log/robobus-dockerd.log 2>&1 &"
  for _ in $(seq 60); do /usr/bin/docker info >/dev/null 2>&1 && break; sleep 0.5; done
  /usr/bin/docker info >/dev/null 2>&1 || { say "dockerd did not start: see /var/log/robobus-dockerd.log"; exit 1; }
fi

# 3. base image
if [ -z "${ROBOBUS_BASE_IMAGE:-}" ]; then
  if /usr/bin/docker image inspect python:3.11-slim-bookworm >/dev/null 2>&1; then
    export ROBOBUS_BASE_IMAGE=python:3.11-slim-bookworm
  elif /usr/bin/docker image inspect robobus/base:bookworm >/dev/null 2>&1; then
    export ROBOBUS_BASE_IMAGE=robobus/base:bookworm
  elif timeout 30 /usr/bin/docker pull -q python:3.11-slim-bookworm >/dev/null 2>&1; then
    export ROBOBUS_BASE_IMAGE=python:3.11-slim-bookworm
  else
    say "no image registry reachable: making robobus/base:bookworm with debootstrap (about a minute)"
    command -v debootstrap >/dev/null || $SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq debootstrap >/dev/null
    $SUDO "$here/docker/make-base-image.sh" >&2
    export ROBOBUS_BASE_IMAGE=robobus/base:bookworm
  fi
fi

echo "export ROBOBUS_BASE_IMAGE=$ROBOBUS_BASE_IMAGE"
