#!/usr/bin/env bash
# Install the Debian packages robobus needs for `make run` / `make test`, only if missing.
set -euo pipefail
need=()
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || need+=(mosquitto)
command -v mosquitto_sub >/dev/null 2>&1 || need+=(mosquitto-clients)
# the broker plugin (deploy/mosquitto/robobus_auth.c) is built against Debian's mosquitto 2.0 for host brokers too
command -v gcc >/dev/null 2>&1 || need+=(gcc libc6-dev)
[ -e /usr/include/mosquitto_plugin.h ] || need+=(mosquitto-dev)
[ -e /usr/include/mosquitto.h ] || need+=(libmosquitto-dev)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v cyclictest >/dev/null 2>&1 || need+=(rt-tests)
command -v node >/dev/null 2>&1 || need+=(nodejs)
command -v npm >/dev/null 2>&1 || need+=(npm)
# epuck-gateway's firmware update drives gdb-multiarch; its tests build a Cortex-M4 ELF with binutils.
command -v gdb-multiarch >/dev/null 2>&1 || need+=(gdb-multiarch)
command -v arm-none-eabi-as >/dev/null 2>&1 || need+=(binutils-arm-none-eabi)
command -v chromium >/dev/null 2>&1 || need+=(chromium)   # the dashboard's browser tests (headless)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)   # promtool checks the alert rules; the tests run the real Prometheus
[ ${#need[@]} -eq 0 ] && exit 0
echo "robobus: installing Debian packages: ${need[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; else
    echo "robobus: not root and no sudo: please install ${need[*]}" >&2; exit 1; fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# The Debian package enables a system broker on :1883; robobus runs its own, so keep it off.
if [[ " ${need[*]} " == *" mosquitto "* ]]; then
  (command -v systemctl >/dev/null && $SUDO systemctl disable --now mosquitto >/dev/null 2>&1) || true
  (command -v service >/dev/null && $SUDO service mosquitto stop >/dev/null 2>&1) || true
fi
