#!/usr/bin/env bash
# Build both images with whichever engine runs here (docker/engine.sh), tagged as the chart
# and the samples name them: ghcr.io/disagg/operator:<version>, ghcr.io/disagg/runtime:<version>
# (<version> from pyproject.toml). `make images` runs this.
#
#   docker/build.sh [operator|runtime ...]     BASE_IMAGE=..., TORCH_VARIANT=... pass through
#   docker/build.sh --if-ready                  (`make e2e-local`) build when an engine and the
#                                               base image are there, else say why and exit 0
#
# With Podman, this machine's pip configuration (`pip config list`: indexes, find-links, the
# CA bundle, constraints) is written to a pip.conf for the build steps (PIP_CONFIG_FILE, a
# build argument) and every local path it names is mounted read-only under
# /run/disagg-build: builds use the local torch wheel and package indexes without any of it
# entering an image (empty mount points under /run/disagg-build are all that remains). With Docker
# (no build-time mounts), pip inside the build uses its defaults (PyPI, PyTorch's index).
set -euo pipefail
cd "$(dirname "$0")/.."
if_ready=0
if [ "${1:-}" = --if-ready ]; then if_ready=1; shift; fi
if ! . docker/engine.sh; then
  [ $if_ready = 1 ] && { echo "images: not built (no engine); pods run from the host venv"; exit 0; }
  exit 1
fi
base="${BASE_IMAGE:-docker.io/library/python:3.11-slim}"
if [ $if_ready = 1 ] && ! "$engine" image inspect "$base" >/dev/null 2>&1; then
  echo "images: not built (no $base in $engine's storage: make images, or make local-base)"
  exit 0
fi
version="$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n1)"
images=("$@")
[ ${#images[@]} -gt 0 ] || images=(operator runtime)

args=()
[ -z "${BASE_IMAGE:-}" ] || args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
[ -z "${TORCH_VARIANT:-}" ] || args+=(--build-arg "TORCH_VARIANT=$TORCH_VARIANT")
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
if [ "$(basename "$engine")" = podman ]; then
  args+=(--network host --layers)
  pip="$(command -v pip3 || command -v pip || true)"
  if [ -n "$pip" ] && "$pip" config list >"$tmp/pip.list" 2>/dev/null && [ -s "$tmp/pip.list" ]; then
    python3 - "$tmp/pip.list" "$tmp/pip.conf" "$tmp/mounts" <<'EOF'
import os, re, sys
keys = {}
for line in open(sys.argv[1]):
    m = re.match(r"^[^.]*\.([a-z-]+)='(.*)'$", line.strip())
    if m:
        keys[m.group(1)] = m.group(2)  # env (PIP_*) lines come first: later lines win
paths = {}  # host path -> where the build sees it (under /run/disagg-build: no residue in /etc)
def inside(word):
    url = word.startswith("file://")
    path = word.removeprefix("file://").rstrip("/")
    # an index's links lead to its ../files: mount its parent
    top = os.path.dirname(path) if url and os.path.basename(path) == "simple" else path
    if not top.startswith("/") or not os.path.exists(top):
        return word  # a URL, a number, or nothing here
    target = paths.setdefault(os.path.realpath(top), f"/run/disagg-build/{len(paths)}")
    return ("file://" if url else "") + target + path[len(top):]
with open(sys.argv[2], "w") as f:
    f.write("[global]\n")
    for k, v in sorted(keys.items()):
        f.write(f"{k} = {' '.join(inside(w) for w in v.split())}\n")
open(sys.argv[3], "w").write("".join(f"{h}:{c}\n" for h, c in sorted(paths.items())))
EOF
    args+=(-v "$tmp/pip.conf:/run/disagg-build/pip.conf:ro")
    args+=(--build-arg PIP_CONFIG_FILE=/run/disagg-build/pip.conf)
    torch=0
    while IFS=: read -r host inside; do
      args+=(-v "$host:$inside:ro")
      ! compgen -G "$host/torch-*" >/dev/null || torch=1
    done <"$tmp/mounts"
    # a local torch wheel (pip's find-links): use it, not PyTorch's index
    [ $torch = 0 ] || args+=(--build-arg TORCH_INDEX_URL=)
  fi
fi

for image in "${images[@]}"; do
  tag="ghcr.io/disagg/$image:$version"
  start=$SECONDS
  old="$("$engine" image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)"
  ignore=()
  [ "$(basename "$engine")" != podman ] || ignore=(--ignorefile "docker/$image.Dockerfile.dockerignore")
  own=()  # runtime-vllm (named only: ~4 GB) builds on this version's runtime image
  [ "$image" != runtime-vllm ] || own=(--build-arg "RUNTIME_IMAGE=ghcr.io/disagg/runtime:$version")
  "$engine" build ${BUILD_FLAGS:---quiet} -f "docker/$image.Dockerfile" "${ignore[@]}" "${args[@]}" "${own[@]}" -t "$tag" . >/dev/null
  size="$("$engine" image inspect --format '{{.Size}}' "$tag")"
  # the tag's previous image, untagged by this build: removed (its layers below the source
  # are this one's too), so rebuilds leave no dangling images; kept if anything uses it
  if [ -n "$old" ] && [ "$old" != "$("$engine" image inspect --format '{{.Id}}' "$tag")" ]; then
    "$engine" rmi "$old" >/dev/null 2>&1 || true
  fi
  echo "images: $tag built in $((SECONDS - start)) s ($engine, $((size / 1000000)) MB)"
done
