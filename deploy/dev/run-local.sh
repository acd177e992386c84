#!/usr/bin/env bash
# `make run`: a local mosquitto (unless ROBOBUS_MQTT_URL names another broker) and every service on
# its simulator, under one small supervisor process (deploy/dev/supervise.py reads deploy/Procfile.sim): what dies
# is started again, the broker included; Ctrl-C stops the nodes first, then the broker; a supervisor killed (-9
# too) takes every process with it. The broker keeps its retained messages (the bus stop) in run/mosquitto/
# across its restarts; the broker and every service node run at SCHED_FIFO ${ROBOBUS_RUN_RT_PRIORITY:-10} where
# the host permits it (0: normal priority). deploy/README.md, "make run".
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="$PWD/.venv/bin:$PATH:/usr/sbin"
procfile=deploy/Procfile.sim
procs=$(grep -E '^[a-z0-9_-]+:' "$procfile" | cut -d: -f1)
as_user=()
if [ -n "${ROBOBUS_MQTT_URL:-}" ]; then
  echo "robobus: using the broker at $ROBOBUS_MQTT_URL (no local mosquitto)"
  procs=$(echo "$procs" | grep -vx broker)
else
  export ROBOBUS_MQTT_URL=mqtt://127.0.0.1:1883
  if (exec 3<>/dev/tcp/127.0.0.1/1883) 2>/dev/null; then
    echo "robobus: something already listens on 127.0.0.1:1883; stop it or set ROBOBUS_MQTT_URL" >&2
    exit 1
  fi
  # the broker's database (deploy/mosquitto/mosquitto.conf: persistence_location run/mosquitto/)
  mkdir -p run/mosquitto
  if [ "$(id -u)" = 0 ] && id -u mosquitto >/dev/null 2>&1; then
    # mosquitto started as root becomes the user mosquitto, and a process that changes its user loses the
    # parent-death signal (a kill -9 of the supervisor would leave it holding 1883): the supervisor starts it as
    # that user already, which must be able to write its database
    chown mosquitto: run/mosquitto
    if setpriv --reuid mosquitto --regid mosquitto --init-groups test -w "$PWD/run/mosquitto" 2>/dev/null; then
      as_user=(--user broker=mosquitto)
    elif [ -z "${ROBOBUS_MOSQUITTO_CONF:-}" ]; then
      # the user mosquitto cannot reach this checkout (a private home folder): the broker stays root, as the
      # nodes of this `make run` are
      echo "robobus: the user mosquitto cannot write $PWD/run/mosquitto: the broker runs as root" >&2
      { cat deploy/mosquitto/mosquitto.conf; echo "user root"; } > run/mosquitto-root.conf
      export ROBOBUS_MOSQUITTO_CONF=run/mosquitto-root.conf
    fi
  fi
fi
# The stop's and the demands' path at a realtime priority (services/ethercat_loop/README.md, "Priorities on a busy
# host"; docs/kit.md, what the stop guarantees): the broker and every service node (a folder of services/ with an
# api.py is a service; its Procfile name is the folder's with dashes), not the simulators nor the tools. The
# supervisor says so, or why the host refused it.
rt=${ROBOBUS_RUN_RT_PRIORITY:-10}
realtime=()
if [ "$rt" != 0 ]; then
  for node in broker $(for api in services/*/api.py; do basename "$(dirname "$api")" | tr _ -; done); do
    if echo "$procs" | grep -qx -- "$node"; then realtime+=(--realtime "$node=$rt"); fi
  done
fi
# (tests: what the supervisor would be given, and nothing started)
[ "${1:-}" = --print-realtime ] && { echo "${realtime[*]}"; exit 0; }
# Home Assistant discovery only on request: it publishes retained configs other tools would see.
[ "${ROBOBUS_HOMEASSISTANT:-false}" = true ] || procs=$(echo "$procs" | grep -vx homeassistant)
# The bus recorder only when asked to record (ROBOBUS_RECORD=1): idle, it would hold ~40 MB for nothing.
[ "${ROBOBUS_RECORD:-0}" = 1 ] || procs=$(echo "$procs" | grep -vx recorder)
# -S: the supervisor needs the standard library alone (no site-packages, ~2 MB less resident)
exec python -S deploy/dev/supervise.py --procfile "$procfile" "${realtime[@]}" "${as_user[@]}" $(echo $procs)
