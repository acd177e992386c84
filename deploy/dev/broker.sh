#!/usr/bin/env bash
# The local broker for `make run`, stopped LAST: on Ctrl-C or SIGTERM the nodes must still reach it to
# run their fail-safe hooks and publish `online: false, reason: shutdown`; only then does it go.
# mosquitto runs in its own session so the terminal's Ctrl-C does not reach it directly.
conf=${1:-deploy/mosquitto/mosquitto.conf}
grace=${ROBOBUS_BROKER_GRACE_S:-3}
setsid mosquitto -c "$conf" &
pid=$!
stop() {
  trap '' INT TERM
  sleep "$grace"
  kill -TERM "$pid" 2>/dev/null
  wait "$pid"
  exit 0
}
trap stop INT TERM
wait "$pid"
