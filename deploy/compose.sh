#!/usr/bin/env bash
# `docker compose` for deploy/compose.yaml plus the overrides this host needs:
#   compose.rt-group.yaml  kernel with CONFIG_RT_GROUP_SCHED=y and a dockerd started with --cpu-rt-runtime
#   compose.rlimits.yaml   dockerd's own hard limits allow rtprio 90 and unlimited memlock
#   compose.edge.yaml      the secrets folder has a bridge.conf (fleet edge)
#   compose.edge-tls.yaml  ... and the fleet's CA, fleet-ca.crt (the bridge over TLS: the default)
#   compose.vhand.yaml     ROBOBUS_VHAND=1: the realtime container against a virtual hand (deploy/vhand.sh)
#   compose.wan.yaml       ROBOBUS_WAN_NETWORK is set (a fleet simulated on one host)
#   compose.tls.yaml       the secrets folder has certs/server.crt (a centre always has: make_secrets --central)
# and the profiles: COMPOSE_PROFILES (default `sim`); `sim` brings along every `sim-<name>` profile of
# compose.yaml (sim-roi, sim-dexter, ...). Uses Debian's docker client (/usr/bin/docker) with
# BuildKit when present: the client first on PATH may lack buildx.
#   deploy/compose.sh up -d --build --wait      deploy/compose.sh ps      deploy/compose.sh down
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# absolute: compose resolves relative paths against deploy/, the caller means its own directory
secrets=$(realpath -m "${ROBOBUS_SECRETS_DIR:-$here/secrets}")
export ROBOBUS_SECRETS_DIR=$secrets
files=(-f "$here/compose.yaml" -f "$here/compose.foxglove.yaml")   # + robobus foxglove (profiles sim, foxglove)
# compose.prometheus.yaml (profile prometheus) is not named here: compose.yaml includes it, and naming it again
# merges its services with themselves (compose refuses the doubled list entries)
notes=()

dockerd_pid=$(pgrep -xo dockerd || true)
rt_group=""
for f in /sys/fs/cgroup/cpu/cpu.rt_runtime_us /sys/fs/cgroup/cpu,cpuacct/cpu.rt_runtime_us; do
  [ -e "$f" ] && rt_group=1
done
if [ -n "$rt_group" ]; then
  budget=""
  [ -n "$dockerd_pid" ] && tr '\0' ' ' < "/proc/$dockerd_pid/cmdline" | grep -q -- '--cpu-rt-runtime' && budget=1
  grep -qs '"cpu-rt-runtime"' /etc/docker/daemon.json && budget=1
  if [ -n "$budget" ]; then
    files+=(-f "$here/compose.rt-group.yaml")
    rt_budget=1
  else
    notes+=("dockerd has no realtime budget (no --cpu-rt-runtime): ethercat-loop's SCHED_FIFO will be refused although the container has SYS_NICE (the cause is the budget, cpu_rt_runtime; fix: dockerd --cpu-rt-runtime=950000 or \"cpu-rt-runtime\": 950000 in /etc/docker/daemon.json, restart dockerd, make up)")
  fi
fi
if [ -n "$dockerd_pid" ] && [ "${ROBOBUS_RLIMITS:-auto}" != "off" ]; then
  rtprio=$(awk '/Max realtime priority/ {print $5}' "/proc/$dockerd_pid/limits")
  memlock=$(awk '/Max locked memory/ {print $5}' "/proc/$dockerd_pid/limits")
  if [ "$rtprio" != "" ] && { [ "$rtprio" = unlimited ] || [ "$rtprio" -ge 90 ]; } && [ "$memlock" = unlimited ]; then
    files+=(-f "$here/compose.rlimits.yaml")
  fi
fi
if [ -n "${ROBOBUS_VHAND:-}" ]; then
  files+=(-f "$here/compose.vhand.yaml")
  [ -n "${rt_budget:-}" ] && files+=(-f "$here/compose.vhand.rt-group.yaml")
fi
if [ -f "$secrets/bridge.conf" ]; then
  files+=(-f "$here/compose.edge.yaml")
  [ -f "$secrets/fleet-ca.crt" ] && files+=(-f "$here/compose.edge-tls.yaml")
fi
if [ -n "${ROBOBUS_WAN_NETWORK:-}" ]; then
  files+=(-f "$here/compose.wan.yaml")
  /usr/bin/docker network inspect "$ROBOBUS_WAN_NETWORK" >/dev/null 2>&1 \
    || /usr/bin/docker network create "$ROBOBUS_WAN_NETWORK" >/dev/null
fi
[ -f "$secrets/certs/server.crt" ] && files+=(-f "$here/compose.tls.yaml")

profiles=${COMPOSE_PROFILES:-sim}
if [[ ",$profiles," == *,sim,* ]]; then
  # every `sim-<name>` profile of compose.yaml comes along: a service on its simulator that needs what the others
  # do not (roi-modules shares its simulator's network namespace) is still part of the simulated system
  for p in $(grep -oE '^[[:space:]]+profiles: \[[^]]*\]' "$here/compose.yaml" | grep -oE 'sim-[A-Za-z0-9_-]+' \
             | sort -u); do
    profiles+=",$p"
  done
fi
export COMPOSE_PROFILES=$profiles

docker=docker
[ -x /usr/bin/docker ] && docker=/usr/bin/docker
export DOCKER_BUILDKIT=1 COMPOSE_BAKE=false
if [ "${ROBOBUS_COMPOSE_VERBOSE:-1}" = 1 ]; then
  for n in "${notes[@]}"; do echo "robobus: $n" >&2; done
fi
exec "$docker" compose --project-directory "$here" "${files[@]}" "$@"
