#!/usr/bin/env bash
# `make down`: stop and remove robobus's containers (SIGTERM first: fail-safe shutdown). Broker data,
# images and the secrets folder are kept; `deploy/down.sh -v` removes the broker's data volume too.
# Going down for good clears what the nodes left retained on the broker about their devices (health, state,
# events under {root}/{node}/{device}/...), so that a later profile (the real hand after `sim`) never shows the
# old one's data as current; each node's {root}/{node}/status stays, saying offline and since when. A fleet
# edge's bridge carries the clearing to the centre while its link is up. ROBOBUS_DOWN_KEEP_RETAINED=1 keeps it all.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ -n "${ROBOBUS_ENV_FILE:-}" ]; then set -a; . "$ROBOBUS_ENV_FILE"; set +a; fi
# every profile `make up` can start (compose's `down` removes no container of a profile it is not given)
export COMPOSE_PROFILES=${COMPOSE_PROFILES:-sim,hand,epuck,dexter,record,central,foxglove,prometheus}
secrets=${ROBOBUS_SECRETS_DIR:-$here/secrets}
root=${ROBOBUS_TOPIC_ROOT:-robobus}
compose() { ROBOBUS_COMPOSE_VERBOSE=0 "$here/compose.sh" "$@"; }

if [ "${ROBOBUS_DOWN_KEEP_RETAINED:-0}" != 1 ] && [ -f "$secrets/acl" ] \
   && compose ps --status running --services 2>/dev/null | grep -qx broker; then
  # every service but the broker first: each node says offline itself (its fail-safe hooks), then its device
  # topics ({root}/{node}/+/+/#: not its status) are cleared with its own credentials (ACL: readwrite {root}/{node}/#)
  others=$(compose ps --status running --services | grep -vx broker || true)
  # shellcheck disable=SC2086
  [ -n "$others" ] && compose stop -t 10 $others >/dev/null 2>&1
  # the node users: `user NAME` followed by `topic readwrite {root}/NAME/#` in the generated ACL
  nodes=$(awk -v r="$root" '/^user /{u=$2} $0 == "topic readwrite " r "/" u "/#" {print u}' "$secrets/acl")
  script='for n in $NODES; do eval "p=\$P_$(echo "$n" | tr -c "A-Za-z0-9\n" _)";
    mosquitto_sub -p 1883 -u "$n" -P "$p" -i "$n-down-$$" -t "$ROOT/$n/+/+/#" --remove-retained --retained-only \
      -W 3 >/dev/null 2>&1 & done; wait; true'
  envs=(-e "ROOT=$root" -e "NODES=$(echo $nodes)")
  for n in $nodes; do
    pw=$(sed -n 's/^ROBOBUS_MQTT_PASSWORD=//p' "$secrets/$n.env" 2>/dev/null || true)
    [ -n "$pw" ] && envs+=(-e "P_$(echo "$n" | tr -c 'A-Za-z0-9\n' _)=$pw")
  done
  if [ -n "$nodes" ]; then
    compose exec -T "${envs[@]}" broker sh -c "$script" || true
    echo "robobus: cleared the retained device data of $(echo $nodes | wc -w) nodes under $root (statuses kept)"
  fi
fi
exec "$here/compose.sh" down --remove-orphans "$@"
