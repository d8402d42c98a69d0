# shellcheck shell=bash
# Sourced by docker/build.sh and docker/local-base.sh: sets `engine` to the container engine
# that can build and run here: $ENGINE if set, else docker when its daemon answers, else
# podman when it runs; fails (saying why on stderr) when none can. For Podman on a host with
# cgroups v1 or hybrid (where its default runtime, crun, fails) and no CONTAINERS_CONF of the
# user's, it exports CONTAINERS_CONF=docker/podman-ci.conf (runc, cgroupfs, explicit
# ulimits, host network). tests/images/engine.py does the same for the tests.
_why=()
engine="${ENGINE:-}"
if [ -z "$engine" ]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    engine=docker
  else
    _why+=("docker: $(command -v docker >/dev/null && echo 'no daemon answers' || echo 'not installed')")
  fi
fi
if [ -z "$engine" ] && command -v podman >/dev/null; then
  if [ -z "${CONTAINERS_CONF:-}" ] && [ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" != cgroup2fs ]; then
    CONTAINERS_CONF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/podman-ci.conf"
    export CONTAINERS_CONF
  fi
  if podman info >/dev/null 2>&1; then
    engine=podman
  else
    _why+=("podman: \`podman info\` fails")
  fi
elif [ -z "$engine" ]; then
  _why+=("podman: not installed")
fi
if [ -z "$engine" ]; then
  echo "no container engine can run here (${_why[*]})" >&2
  return 1 2>/dev/null || exit 1
fi
