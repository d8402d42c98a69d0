#!/usr/bin/env bash
# Make the images' base where no registry can be reached (this project's CI): Debian
# bookworm by debootstrap (minbase) from the mirror apt already uses, Debian's python3 (3.11)
# and a virtual environment at /opt/venv first on PATH (so `python`, `pip` and installed
# scripts are found as in python:3.11-slim), imported into Podman or Docker under the tag the
# Dockerfiles build FROM by default. Cached: when that tag exists already, nothing is done.
#
#   docker/local-base.sh [TAG]        (root: debootstrap; ~90 s cold, 0 s cached)
#
# Users with a registry never need this: `make images` pulls python:3.11-slim.
set -euo pipefail
TAG="${1:-docker.io/library/python:3.11-slim}"
. "$(dirname "$0")/engine.sh"

if "$engine" image inspect "$TAG" >/dev/null 2>&1; then
  echo "local-base: $TAG exists ($engine), nothing to do"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "local-base: debootstrap is missing" >&2; exit 1; }

# the first Debian mirror of apt's sources (deb822 or one-line format)
mirror="$(
  { grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}'
    grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | awk '{print $2}'
  } | grep -v -- '-security' | head -n1 || true
)"
mirror="${mirror:-http://deb.debian.org/debian}"

dir="$(mktemp -d /var/tmp/disagg-base.XXXXXX)"
trap 'rm -rf "$dir"' EXIT
start=$SECONDS
echo "local-base: debootstrap bookworm from $mirror"
debootstrap --variant=minbase --include=passwd,python3,python3-venv \
  bookworm "$dir/root" "$mirror" >"$dir/debootstrap.log" 2>&1 \
  || { tail -n 30 "$dir/debootstrap.log" >&2; exit 1; }
chroot "$dir/root" python3 -m venv /opt/venv
chroot "$dir/root" /opt/venv/bin/pip --version >/dev/null
# what a slim image leaves out: docs, manuals, locales, apt's lists and caches
rm -rf "$dir"/root/usr/share/{doc,man,info,locale}/* "$dir"/root/var/lib/apt/lists/* \
  "$dir"/root/var/cache/apt/* "$dir"/root/var/cache/debconf/*-old "$dir"/root/var/log/*
find "$dir/root" -name __pycache__ -prune -exec rm -rf {} +

tar -C "$dir/root" --numeric-owner -c . | "$engine" import \
  --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'LABEL org.opencontainers.image.description=disagg-local-base-bookworm' \
  --change 'CMD ["python3"]' \
  - "$TAG" >/dev/null
echo "local-base: $TAG imported ($engine, $((SECONDS - start)) s)"
