#!/usr/bin/env bash
# Builds what the CPU image installs from, on the host (which reaches PyPI and has the CPU
# torch wheel on disk), so that the image build itself needs no network:
#   deploy/.build/wheelhouse/  every dependency's wheel (torch: the CPU build)
#   deploy/.build/dist/        the meshrl wheel of the working tree (+ the compose demo script)
#
#   deploy/scripts/build_wheelhouse.sh
#
# The dependencies are kept while pyproject.toml is unchanged (the image's dependency
# layer then stays cached too); the meshrl wheel is rebuilt every time.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
BUILD="$REPO/deploy/.build"
PY="${PYTHON:-$REPO/.venv/bin/python}"
TORCH_PIN="${TORCH_PIN:-torch==2.13.0}"
EXTRAS="${MESHRL_EXTRAS:-}"          # e.g. "[ray]"; the CPU image needs none
WHEELS="$BUILD/wheelhouse"
CONSTRAINTS="$BUILD/constraints.txt"
mkdir -p "$WHEELS"
quiet() { grep -v "is ignored: it is neither a file nor a directory" || true; }

# The image gets the versions the host's venv runs (and was tested with), not whatever the
# index offers on the day of the build: every installed distribution pinned. torch is
# pinned by TORCH_PIN; installs from a local file (`name @ file://...`) cannot be constraints.
"$PY" -m pip freeze --exclude-editable > "$BUILD/freeze.txt"
grep -v -e '^torch==' -e ' @ ' "$BUILD/freeze.txt" > "$CONSTRAINTS" || true
STAMP="$WHEELS/.deps-$(cat "$REPO/pyproject.toml" "$CONSTRAINTS" <(echo "$TORCH_PIN$EXTRAS") | sha256sum | cut -c1-16)"

if [ ! -f "$STAMP" ]; then
  rm -f "$WHEELS"/*.whl "$WHEELS"/.deps-*
  # torch first, by its pin: the CPU build from the local wheel folder, not a CUDA one.
  "$PY" -m pip download -q --no-deps -d "$WHEELS" "$TORCH_PIN" 2>&1 | quiet
  "$PY" -m pip wheel -q --wheel-dir "$WHEELS" --find-links "$WHEELS" -c "$CONSTRAINTS" \
    "$TORCH_PIN" "$REPO$EXTRAS" 2>&1 | quiet
  rm -f "$WHEELS"/meshrl-*.whl
  touch "$STAMP"
fi
# The CUDA image installs meshrl's dependencies (with the vllm extra) from PyPI by this
# list, so its big dependency layer is rebuilt only when pyproject.toml changes.
"$PY" - "$REPO/pyproject.toml" > "$BUILD/requirements-cuda.txt" <<'PYEOF'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["vllm"]))
PYEOF
rm -rf "$BUILD/dist" && mkdir -p "$BUILD/dist"
"$PY" -m pip wheel -q --no-deps --wheel-dir "$BUILD/dist" "$REPO" 2>&1 | quiet
cp "$REPO/deploy/scripts/compose_demo.py" "$BUILD/dist/"  # installed beside meshrl in the image
rm -rf "$REPO/build"  # setuptools' leftovers of the wheel build
echo "wheelhouse: $(ls "$WHEELS"/*.whl | wc -l) wheels in $WHEELS; meshrl: $(ls "$BUILD"/dist)"
