#!/usr/bin/env bash
# `make run`: a local mosquitto (unless ROBOBUS_MQTT_URL names another broker) and every service on
# its simulator, under one small supervisor process (deploy/dev/supervise.py reads deploy/Procfile.sim): what dies
# is started again, the broker included; Ctrl-C stops the nodes first, then the broker.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="$PWD/.venv/bin:$PATH:/usr/sbin"
procfile=deploy/Procfile.sim
procs=$(grep -E '^[a-z0-9_-]+:' "$procfile" | cut -d: -f1)
if [ -n "${ROBOBUS_MQTT_URL:-}" ]; then
  echo "robobus: using the broker at $ROBOBUS_MQTT_URL (no local mosquitto)"
  procs=$(echo "$procs" | grep -vx broker)
else
  export ROBOBUS_MQTT_URL=mqtt://127.0.0.1:1883
  if (exec 3<>/dev/tcp/127.0.0.1/1883) 2>/dev/null; then
    echo "robobus: something already listens on 127.0.0.1:1883; stop it or set ROBOBUS_MQTT_URL" >&2
    exit 1
  fi
fi
# Home Assistant discovery only on request: it publishes retained configs other tools would see.
[ "${ROBOBUS_HOMEASSISTANT:-false}" = true ] || procs=$(echo "$procs" | grep -vx homeassistant)
# The bus recorder only when asked to record (ROBOBUS_RECORD=1): idle, it would hold ~40 MB for nothing.
[ "${ROBOBUS_RECORD:-0}" = 1 ] || procs=$(echo "$procs" | grep -vx recorder)
# -S: the supervisor needs the standard library alone (no site-packages, ~2 MB less resident)
exec python -S deploy/dev/supervise.py --procfile "$procfile" $(echo $procs)
