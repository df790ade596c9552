#!/usr/bin/env bash
# Build crr's sandbox root without a registry: debootstrap a minimal Debian with Python, pytest and git,
# kept as a directory (the local engine's read-only root, CRR_ROOTFS, default /var/lib/crr/rootfs) and
# `docker import`ed as an image (the Docker engine's base). No image is ever pulled (these machines reach
# no registry).
# Usage: scripts/build-base-image.sh [IMAGE]   (default crr-base:bookworm); CRR_SKIP_DOCKER=1: the directory only.
# Idempotent: each half is skipped when it exists and was built from this recipe (the image's label
# org.crr.recipe, the file <root>.recipe); a missing half is made from the other one (no debootstrap).
set -euo pipefail
IMAGE="${1:-${CRR_BASE_IMAGE:-crr-base:bookworm}}"
ROOTFS="${CRR_ROOTFS:-/var/lib/crr/rootfs}"
MIRROR="${CRR_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# python-is-python3: task test commands say `python`, as on every SWE-bench image.
PACKAGES="python3,python3-pip,python3-pytest,python-is-python3,git,patch,procps"
RECIPE="$(echo "bookworm minbase $PACKAGES" | sha256sum | cut -c1-12)"
want_image=1; [ "${CRR_SKIP_DOCKER:-0}" = 1 ] && want_image=0
have_image=0; have_root=0
if [ "$want_image" = 1 ] && \
   [ "$(docker image inspect -f '{{index .Config.Labels "org.crr.recipe"}}' "$IMAGE" 2>/dev/null)" = "$RECIPE" ]; then
  have_image=1
fi
[ -d "$ROOTFS" ] && [ "$(cat "$ROOTFS.recipe" 2>/dev/null)" = "$RECIPE" ] && have_root=1
if [ "$have_root" = 1 ] && { [ "$have_image" = 1 ] || [ "$want_image" = 0 ]; }; then
  echo "sandbox root $ROOTFS already present$([ "$want_image" = 1 ] && echo ", and base image $IMAGE")"; exit 0
fi

if [ "$have_root" = 0 ]; then
  mkdir -p "$(dirname "$ROOTFS")"
  NEW="$(mktemp -d "$ROOTFS.new.XXXXXX")"  # beside it: published with one rename
  trap 'rm -rf "$NEW"' EXIT
  if [ "$have_image" = 1 ]; then
    echo "exporting $IMAGE into $ROOTFS"
    cid="$(docker create "$IMAGE" true)"
    docker export "$cid" | tar -C "$NEW" -x
    docker rm "$cid" >/dev/null
  else
    command -v debootstrap >/dev/null || { echo "debootstrap missing: apt-get install -y debootstrap" >&2; exit 2; }
    echo "debootstrap bookworm into $NEW (about a minute)"
    debootstrap --variant=minbase --include="$PACKAGES" \
      bookworm "$NEW" "$MIRROR" >/tmp/crr-debootstrap.log 2>&1 || { tail -20 /tmp/crr-debootstrap.log >&2; exit 1; }
    rm -rf "$NEW"/var/cache/apt/archives/*.deb "$NEW"/var/lib/apt/lists/*
  fi
  # The mount point of a task environment in the local engine's sandboxes (its /opt is read-only),
  # and no leftovers of the build (docker export adds an empty /.dockerenv).
  mkdir -p "$NEW/opt/crr"
  rm -f "$NEW/.dockerenv"
  # debootstrap leaves no /etc/hosts (Docker writes one into every container): `localhost` must resolve
  [ -s "$NEW/etc/hosts" ] || printf '127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' > "$NEW/etc/hosts"
  chmod 755 "$NEW"
  OLD="$ROOTFS.old.$$"
  [ -e "$ROOTFS" ] && mv "$ROOTFS" "$OLD"
  mv "$NEW" "$ROOTFS"
  echo "$RECIPE" > "$ROOTFS.recipe"
  rm -rf "$OLD"
  echo "sandbox root in $ROOTFS"
fi

if [ "$want_image" = 1 ] && [ "$have_image" = 0 ]; then
  # without the local engine's mount point: the image is what debootstrap made
  tar -C "$ROOTFS" --exclude=./opt/crr -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'LABEL org.crr.role=base' \
    --change "LABEL org.crr.recipe=$RECIPE" \
    --change 'CMD ["/bin/bash"]' - "$IMAGE" >/dev/null
  echo "built $IMAGE"
fi
