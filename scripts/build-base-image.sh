#!/usr/bin/env bash
# Build crr's sandbox base image without a registry: debootstrap a minimal Debian with Python,
# pytest and git, then `docker import` it. No image is ever pulled (these machines reach no registry).
# Usage: scripts/build-base-image.sh [IMAGE]   (default crr-base:bookworm)
# Skips the build when IMAGE exists and was built from this recipe (label org.crr.recipe).
set -euo pipefail
IMAGE="${1:-${CRR_BASE_IMAGE:-crr-base:bookworm}}"
MIRROR="${CRR_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# python-is-python3: task test commands say `python`, as on every SWE-bench image.
PACKAGES="python3,python3-pip,python3-pytest,python-is-python3,git,patch,procps"
RECIPE="$(echo "bookworm minbase $PACKAGES" | sha256sum | cut -c1-12)"
if [ "$(docker image inspect -f '{{index .Config.Labels "org.crr.recipe"}}' "$IMAGE" 2>/dev/null)" = "$RECIPE" ]; then
  echo "base image $IMAGE already present"; exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap missing: apt-get install -y debootstrap" >&2; exit 2; }
ROOT="$(mktemp -d /tmp/crr-rootfs.XXXXXX)"
trap 'rm -rf "$ROOT"' EXIT
echo "debootstrap bookworm into $ROOT (about a minute)"
debootstrap --variant=minbase --include="$PACKAGES" \
  bookworm "$ROOT" "$MIRROR" >/tmp/crr-debootstrap.log 2>&1 || { tail -20 /tmp/crr-debootstrap.log >&2; exit 1; }
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/*
tar -C "$ROOT" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'LABEL org.crr.role=base' \
  --change "LABEL org.crr.recipe=$RECIPE" \
  --change 'CMD ["/bin/bash"]' - "$IMAGE" >/dev/null
echo "built $IMAGE"
