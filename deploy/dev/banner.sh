#!/usr/bin/env bash
# Printed by `make run` once the nodes are up: where to look.
root=${ROBOBUS_TOPIC_ROOT:-robobus}
sleep "${1:-4}"
robobus status --wait 1.5 || true
cat <<MSG

robobus is up. Where to look:
  robobus status                          this table again
  robobus watch '$root/#'                 every message (or: mosquitto_sub -v -t '$root/#')
  robobus call NODE/DEVICE COMMAND '{}'   send a command (see docs/asyncapi.yaml for all of them)
  dashboard: http://127.0.0.1:${ROBOBUS_DASHBOARD_PORT:-8080}/   (in a browser; its MQTT goes through the page's server at /mqtt)
  broker: $ROBOBUS_MQTT_URL   websockets for other dashboards: ws://127.0.0.1:9001
Ctrl-C stops everything.
MSG
exec sleep infinity
