#!/usr/bin/env bash
# `make down`: stop and remove robobus's containers (SIGTERM first: fail-safe shutdown). Broker data,
# images and the secrets folder are kept; `deploy/down.sh -v` removes the broker's data volume too.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ -n "${ROBOBUS_ENV_FILE:-}" ]; then set -a; . "$ROBOBUS_ENV_FILE"; set +a; fi
export COMPOSE_PROFILES=${COMPOSE_PROFILES:-sim,hand,epuck,dexter}
exec "$here/compose.sh" down --remove-orphans "$@"
