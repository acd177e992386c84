#!/usr/bin/env bash
# The `hand` profile against a virtual Shadow hand in a second container (deploy/compose.vhand.yaml):
# starts the stack and, once the hand's container runs, puts a veth pair into its network namespace
# (ethercat-loop shares that namespace: one end is its EtherCAT "NIC", the other the hand's).
#   deploy/vhand.sh up [compose up options]      deploy/vhand.sh down
# Root: creating the pair needs CAP_NET_ADMIN on the host. Same settings as deploy/compose.sh. `up` needs no prior
# `make up`: it starts docker, makes the secrets and builds the images when missing, as deploy/up.sh does.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export ROBOBUS_VHAND=1 COMPOSE_PROFILES=${COMPOSE_PROFILES:-hand}
master=${ROBOBUS_ETHERCAT_IFNAME:-ecm0}
hand=${ROBOBUS_VHAND_IFNAME:-ech0}

link_once() {  # give the hand's current container (if running) the pair, unless it has it
  local cid pid
  cid=$("$here/compose.sh" ps -q virtual-hand 2>/dev/null || true)
  [ -n "$cid" ] || return 0
  pid=$(/usr/bin/docker inspect -f '{{.State.Pid}}' "$cid" 2>/dev/null || true)
  [ -n "$pid" ] && [ "$pid" != 0 ] || return 0
  nsenter -t "$pid" -n ip link show "$master" >/dev/null 2>&1 && return 0
  ip link add "$master" netns "$pid" type veth peer name "$hand" netns "$pid"
  # no IPv6 router solicitations or MLD reports on the EtherCAT link (netns.py does the same)
  nsenter -t "$pid" -n sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1 || true
  nsenter -t "$pid" -n ip link set "$master" up
  nsenter -t "$pid" -n ip link set "$hand" up
}

link() {  # while compose brings the stack up: a (re)created hand container gets its pair
  while true; do link_once || true; sleep 0.3; done
}

case "${1:-}" in
  up)
    shift
    # what `make up` would have done first: docker, a base image, the secrets, the images
    eval "$("$here/dev/ensure-docker.sh")"
    export ROBOBUS_SECRETS_DIR; ROBOBUS_SECRETS_DIR=$(realpath -m "${ROBOBUS_SECRETS_DIR:-$here/secrets}")
    python3 "$here/make_secrets.py" --dir "$ROBOBUS_SECRETS_DIR" --root "${ROBOBUS_TOPIC_ROOT:-robobus}" >/dev/null
    echo "robobus: building the images (a minute the first time)" >&2
    "$here/compose.sh" --progress quiet build
    link &
    linker=$!
    trap 'kill "$linker" 2>/dev/null || true' EXIT
    "$here/compose.sh" up -d --wait "$@"
    ;;
  down) shift; exec "$here/compose.sh" down --remove-orphans "$@" ;;
  *) echo "usage: deploy/vhand.sh up|down [compose options]" >&2; exit 2 ;;
esac
