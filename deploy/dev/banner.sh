#!/usr/bin/env bash
# Printed by `make run` once the nodes are up: where to look. Then it exits (a one-shot: the supervisor does
# not start it again), so that no process is left holding memory for nothing.
root=${ROBOBUS_TOPIC_ROOT:-robobus}
sleep "${1:-4}"
robobus status --wait 1.5 || true
# a blank ROI module is not broken: say what it means and what configures it
blank=$(robobus status --wait 0.5 --json 2>/dev/null | python -c '
import json, sys
h = json.load(sys.stdin).get("health", {})
print(" ".join(sorted(k for k, v in h.items() if v.get("state") == "blank_state" and not v.get("operational"))))' 2>/dev/null || true)
if [ -n "$blank" ]; then
  cat <<BLANK

Blank module(s): $blank. A ROI module in blank state lost its configuration (powered up, or reset) and waits
for its settings; the service pushes them at start and after every reset from its module settings (pin_modes
for a GPIO module, initial_mode for an ODrive; services/roi_modules/README.md, "Blank modules"). A module
that stays blank has none configured: add them, or configure it with set_pin_mode / set_velocity.
BLANK
fi
cat <<MSG

robobus is up. Where to look:
  robobus status                          this table again
  robobus watch '$root/#'                 every message (or: mosquitto_sub -v -t '$root/#')
  robobus call NODE/DEVICE COMMAND '{}'   send a command (see docs/asyncapi.yaml for all of them)
  dashboard: http://127.0.0.1:${ROBOBUS_DASHBOARD_PORT:-8080}/   (in a browser; its MQTT goes through the page's server at /mqtt)
  foxglove:  ws://127.0.0.1:${ROBOBUS_FOXGLOVE_PORT:-8765}   (Foxglove: Open connection -> Foxglove WebSocket; layout deploy/foxglove/robobus-demo.json)
  metrics:   http://127.0.0.1:${ROBOBUS_PROMETHEUS_PORT:-9880}/metrics   (Prometheus: scrape it; alert rules in deploy/prometheus/, docs/prometheus.md)
  broker: $ROBOBUS_MQTT_URL   websockets for other dashboards: ws://127.0.0.1:9001
Ctrl-C stops everything.
MSG
