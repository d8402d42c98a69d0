"""The container engine of the image tests and of the test node's images (the Python side of
docker/engine.sh): docker when its daemon answers, else podman when it runs, else None with
the reason. For Podman on a cgroups v1/hybrid host (crun fails there) and no CONTAINERS_CONF
of the user's, docker/podman-ci.conf is used (runc, cgroupfs, explicit ulimits, host
network)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CI_CONF = REPO / "docker" / "podman-ci.conf"
BASE_IMAGE = "docker.io/library/python:3.11-slim"
BUDGETS_MB = {"operator": 300, "runtime": 1300}  # the CPU build of the runtime


def version() -> str:
    for line in (REPO / "pyproject.toml").read_text().splitlines():
        if line.startswith("version = "):
            return line.split('"')[1]
    raise RuntimeError("no version in pyproject.toml")


def tag(image: str) -> str:
    """The tag the chart and the samples name: ghcr.io/disagg/<image>:<version>."""
    return f"ghcr.io/disagg/{image}:{version()}"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    if not env.get("CONTAINERS_CONF") and not _cgroup2():
        env["CONTAINERS_CONF"] = str(CI_CONF)
    return env


def _cgroup2() -> bool:
    """cgroups v2 alone (/sys/fs/cgroup is a cgroup2 mount, not a tmpfs of v1 hierarchies)."""
    try:
        with open("/proc/self/mounts") as f:
            return any(line.split()[1:3] == ["/sys/fs/cgroup", "cgroup2"] for line in f)
    except OSError:
        return False


@dataclass(frozen=True)
class Engine:
    name: str  # docker or podman
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 600, check: bool = True) -> str:
        done = subprocess.run(
            [self.name, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise RuntimeError(
                f"{self.name} {' '.join(args[:3])}... exited {done.returncode}: "
                f"{(done.stderr or done.stdout)[-3000:]}"
            )
        return done.stdout

    def has(self, image: str) -> bool:
        """Whether local storage has `image` (never pulled)."""
        probe = subprocess.run(
            [self.name, "image", "inspect", image], env=self.env, capture_output=True, timeout=60
        )
        return probe.returncode == 0

    def inspect(self, image: str) -> dict[str, Any]:
        data = json.loads(self.run("image", "inspect", image, timeout=60))
        return dict(data[0])


@functools.cache
def find() -> Engine | str:
    """The engine, or why there is none."""
    why = []
    for name in ("docker", "podman"):
        if shutil.which(name) is None:
            why.append(f"{name}: not installed")
            continue
        env = _env() if name == "podman" else dict(os.environ)
        probe = subprocess.run([name, "info"], env=env, capture_output=True, timeout=60)
        if probe.returncode == 0:
            return Engine(name, env)
        why.append(f"{name}: `{name} info` fails")
    return "no container engine can run here (" + "; ".join(why) + ")"


@dataclass
class Built:
    engine: Engine
    seconds: float
    sizes_mb: dict[str, int]


def build() -> Built:
    """`docker/build.sh` (both images; cached layers make a rebuild take seconds)."""
    engine = find()
    assert isinstance(engine, Engine), engine
    start = time.monotonic()
    done = subprocess.run(
        [str(REPO / "docker" / "build.sh")],
        env={**engine.env, "ENGINE": engine.name},
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"docker/build.sh exited {done.returncode}:\n{done.stderr[-4000:]}")
    sizes = {image: int(engine.inspect(tag(image))["Size"]) // 1_000_000 for image in BUDGETS_MB}
    return Built(engine, time.monotonic() - start, sizes)
