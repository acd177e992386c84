#!/usr/bin/env bash
# Build a local base image without any image registry: debootstrap a Debian bookworm root with
# Python 3.11 and import it into docker as robobus/base:bookworm.
#   sudo deploy/docker/make-base-image.sh && export ROBOBUS_BASE_IMAGE=robobus/base:bookworm
set -euo pipefail
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates bookworm "$root"
# pip in Debian refuses system installs (PEP 668); a container is the whole system, so allow it.
rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
ln -sf /usr/bin/python3 "$root/usr/local/bin/python"
ln -sf /usr/bin/pip3 "$root/usr/local/bin/pip"
tar -C "$root" -c . | docker import - robobus/base:bookworm
echo "built robobus/base:bookworm"
