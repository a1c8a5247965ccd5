#!/usr/bin/env bash
# Builds the base image from Debian's own packages (debootstrap + docker import), so no
# registry is pulled from. Debian bookworm ships Python 3.11, the version our wheels target.
#
#   deploy/scripts/build_base_image.sh [IMAGE]      (default meshrl-base:bookworm)
#
# Needs root, debootstrap and a running Docker engine. Skips the work when IMAGE exists
# and carries the label of this script's content (so an edited script rebuilds).
set -euo pipefail
IMAGE="${1:-meshrl-base:bookworm}"
SUITE="${DEBIAN_SUITE:-bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
DOCKER="${DOCKER:-docker}"
HERE="$(cd "$(dirname "$0")" && pwd)"
RECIPE="$(sha256sum "$HERE/build_base_image.sh" | cut -c1-16)"

if [ "$($DOCKER image inspect -f '{{ index .Config.Labels "meshrl.base.recipe" }}' "$IMAGE" 2>/dev/null)" = "$RECIPE" ]; then
  echo "base image $IMAGE is up to date (recipe $RECIPE)"
  exit 0
fi

ROOT="$(mktemp -d /tmp/meshrl-rootfs.XXXXXX)"
trap 'rm -rf "$ROOT"' EXIT
# minbase: apt, dpkg and coreutils only; python3-venv brings ensurepip for the image's venv.
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  "$SUITE" "$ROOT" "$MIRROR"
chroot "$ROOT" apt-get clean
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin "$ROOT"/usr/share/doc/* \
  "$ROOT"/usr/share/man/* "$ROOT"/usr/share/locale/*
tar -C "$ROOT" -c . | $DOCKER import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change "LABEL meshrl.base.recipe=$RECIPE" \
  --change 'CMD ["/bin/bash"]' \
  - "$IMAGE"
echo "built $IMAGE (recipe $RECIPE)"
