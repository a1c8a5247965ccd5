#!/usr/bin/env bash
# Builds the meshrl images without pulling from any registry:
#   1. the base image from Debian's packages (build_base_image.sh: debootstrap + import),
#   2. the wheelhouse on the host (build_wheelhouse.sh: CPU torch from local disk + PyPI),
#   3. `docker build` of deploy/Dockerfile's targets with deploy/ as the context.
#
#   deploy/scripts/build_images.sh [cpu] [cuda]       (default: cpu)
#
# Images: meshrl:cpu, meshrl:cuda (override with MESHRL_IMAGE_PREFIX=meshrl).
set -euo pipefail
DEPLOY="$(cd "$(dirname "$0")/.." && pwd)"
DOCKER="${DOCKER:-docker}"
PREFIX="${MESHRL_IMAGE_PREFIX:-meshrl}"
BASE="${MESHRL_BASE_IMAGE:-meshrl-base:bookworm}"
TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=(cpu)

"$DEPLOY/scripts/build_base_image.sh" "$BASE"
"$DEPLOY/scripts/build_wheelhouse.sh"
# The host's bundle: it trusts whatever proxy the host itself reaches PyPI through.
cp "${MESHRL_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}" "$DEPLOY/.build/ca-certificates.crt"

for target in "${TARGETS[@]}"; do
  start=$(date +%s)
  # The dependency stage gets a tag of its own, so that `docker image prune` keeps it
  # (and with it the cache of the slow layer) while removing superseded images.
  for stage in "$target-deps" "$target"; do
    tag="$PREFIX:$target"; [ "$stage" != "$target" ] && tag="$PREFIX-deps:$target"
    $DOCKER build -q --network host --build-arg "BASE_IMAGE=$BASE" --target "$stage" \
      -t "$tag" -f "$DEPLOY/Dockerfile" "$DEPLOY"
  done
  echo "built $PREFIX:$target in $(( $(date +%s) - start ))s"
done
