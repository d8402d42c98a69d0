"""Images for the node: a pod's container runs from its image's root filesystem when the
image is in the local engine's storage (built by `make images`), else from the host's
virtual environment (the node's fallback "image", e.g. for the tests' own client pods).

With Podman the image is mounted once per image ID (`podman image mount`: the layers'
overlay, read-only for the node, shared by every container of it) and unmounted when the
node stops; with Docker it is exported once per image ID into the node's directory (a
container created and removed at once). Its configuration (entrypoint, cmd, env, user,
working directory) comes from `image inspect`; the kubelet merges it with the pod's
command, args and env as a kubelet does.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass, field

from tests.images import engine as engines


@dataclass(frozen=True)
class Image:
    ref: str
    id: str
    rootfs: str
    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str]
    user: str
    working_dir: str

    def argv(self, command: list[str], args: list[str]) -> list[str]:
        """The kubelet's rule: command replaces the entrypoint (and drops cmd), args replace
        cmd."""
        if command:
            return [*command, *args]
        return [*self.entrypoint, *(args or self.cmd)]

    def ids(self) -> tuple[int | None, int | None]:
        """The image's USER as (uid, gid): numeric, or a name looked up in its /etc/passwd
        and /etc/group."""
        if not self.user:
            return None, None
        name, _, group = self.user.partition(":")
        return _lookup(self.rootfs, "passwd", name), (
            _lookup(self.rootfs, "group", group) if group else _primary_gid(self.rootfs, name)
        )


def _lookup(rootfs: str, table: str, name: str) -> int:
    if name.isdigit():
        return int(name)
    with open(os.path.join(rootfs, "etc", table)) as f:
        for line in f:
            fields = line.split(":")
            if fields[0] == name:
                return int(fields[2])
    raise ValueError(f"the image's user {name!r} is not in its /etc/{table}")


def _primary_gid(rootfs: str, user: str) -> int | None:
    with contextlib.suppress(OSError), open(os.path.join(rootfs, "etc", "passwd")) as f:
        for line in f:
            fields = line.split(":")
            if fields[0] == user or (user.isdigit() and fields[2] == user):
                return int(fields[3])
    return None


@dataclass
class ImageStore:
    """The images of one engine, for one node (`close` unmounts / removes what it made)."""

    engine: engines.Engine
    root: str  # the node's directory (Docker exports go to <root>/images/<id>)
    _images: dict[str, Image | None] = field(default_factory=dict)
    _mounted: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def find(cls, root: str) -> ImageStore | str:
        """A store of the engine that runs here, or why there is none."""
        found = engines.find()
        return found if isinstance(found, str) else cls(found, root)

    def get(self, ref: str) -> Image | None:
        """The image `ref` from local storage (never pulled), None when absent."""
        with self._lock:
            if ref not in self._images:
                self._images[ref] = self._load(ref)
            return self._images[ref]

    def _load(self, ref: str) -> Image | None:
        if not ref or ref == "local" or not self.engine.has(ref):
            return None
        data = self.engine.inspect(ref)
        image_id = str(data["Id"]).removeprefix("sha256:")
        config = data.get("Config") or {}
        env = dict(str(e).split("=", 1) for e in config.get("Env") or [] if "=" in str(e))
        return Image(
            ref=ref,
            id=image_id,
            rootfs=self._rootfs(image_id),
            entrypoint=[str(w) for w in config.get("Entrypoint") or []],
            cmd=[str(w) for w in config.get("Cmd") or []],
            env=env,
            user=str(config.get("User") or ""),
            working_dir=str(config.get("WorkingDir") or ""),
        )

    def _rootfs(self, image_id: str) -> str:
        for image in self._images.values():
            if image is not None and image.id == image_id:
                return image.rootfs
        if self.engine.name == "podman":
            path = self.engine.run("image", "mount", image_id, timeout=120).strip()
            self._mounted.append(image_id)
            return path
        target = os.path.join(self.root, "images", image_id)
        os.makedirs(target)
        container = self.engine.run("create", image_id, "true", timeout=120).strip()
        try:
            export = subprocess.Popen(
                [self.engine.name, "export", container], stdout=subprocess.PIPE, env=self.engine.env
            )
            subprocess.run(["tar", "-x", "-C", target], stdin=export.stdout, check=True)
            export.wait()
        finally:
            self.engine.run("rm", "-f", container, check=False)
        return target

    def close(self) -> None:
        with self._lock:
            for image_id in self._mounted:
                self.engine.run("image", "unmount", image_id, check=False, timeout=120)
            self._mounted.clear()
            self._images.clear()
        shutil.rmtree(os.path.join(self.root, "images"), ignore_errors=True)
