"""Enter a pod's namespaces: the pod sandbox ("pause") and each container start through this
script, run as root by the kubelet with ``python -I nsexec.py pause|container SPEC.json``.

Standard library only (it runs before anything of the "image" is on the path), one process,
no threads: ``setns`` of a mount namespace refuses multi-threaded callers.

pause      join the pod's network namespace (``/run/netns/<name>``), unshare IPC, mount and
           UTS namespaces, set the hostname to the pod name, mount every memory emptyDir
           as a tmpfs of its sizeLimit (mode 1777), print "ready", then wait for SIGTERM.
           The pod's namespaces live as long as this process (and its containers).
container  join the pause process's network, IPC, UTS and mount namespaces, unshare a
           mount namespace of its own (propagation private: nothing reaches the host),
           bind every volume at its mountPath (a missing mount point is made inside an
           overlay of its nearest existing parent, so the host's tree is never written),
           optionally remount / read-only, make the "image" (the interpreter's prefix)
           reachable when it sits under a private directory, bind the "image" (the
           virtual environment, the interpreter, the checkout) read-only back at its own
           path where a volume hides it (a checkout under /tmp and an emptyDir at /tmp),
           drop to runAsUser/runAsGroup, exec the command. With a "rootfs" (the
           pod's image, mounted by the node), the container's root is an overlay of it
           instead: /proc, /dev, /sys, the volumes and /etc files bound inside, chroot.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
from typing import Any, NoReturn

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    _check(
        _libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {source} on {target}",
    )


def setns(path: str, kind: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        _check(_libc.setns(fd, kind), f"setns {path}")
    finally:
        os.close(fd)


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def private_root() -> None:
    mount("none", "/", None, MS_REC | MS_PRIVATE, None)


def pause(spec: dict[str, Any]) -> None:
    setns(spec["netns"], CLONE_NEWNET)
    unshare(CLONE_NEWIPC | CLONE_NEWNS | CLONE_NEWUTS)
    private_root()
    socket.sethostname(spec["hostname"])
    for tmpfs in spec.get("tmpfs", []):
        options = "mode=1777" + (f",size={tmpfs['size']}" if tmpfs.get("size") else "")
        mount("tmpfs", tmpfs["path"], "tmpfs", MS_NOSUID | MS_NODEV, options)
    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    print("ready", flush=True)
    while not stop:
        signal.pause()


def _ensure_target(target: str, is_file: bool, scratch: str, overlays: list[str]) -> None:
    """Make `target` exist without writing to the host: overlay its nearest existing
    parent (lower = that parent, upper in the container's scratch tmpfs) and create it."""
    if os.path.lexists(target):
        return
    parent = os.path.dirname(target)
    while not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    if parent == "/":
        raise OSError(f"cannot create mount point {target} under /")
    if parent not in overlays:
        n = len(overlays)
        upper, work = f"{scratch}/upper{n}", f"{scratch}/work{n}"
        os.makedirs(upper)
        os.makedirs(work)
        mount("overlay", parent, "overlay", 0, f"lowerdir={parent},upperdir={upper},workdir={work}")
        overlays.append(parent)
    if is_file:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w"):
            pass
    else:
        os.makedirs(target, exist_ok=True)


def reveal(path: str, scratch: str, n: int) -> None:
    """Make `path` reachable for any user although an ancestor is private (e.g. an
    interpreter under /root, mode 0700): keep it aside, cover the first closed ancestor with
    an empty tmpfs (mode 0755) and bind it back at its own path."""
    parts = path.strip("/").split("/")
    closed = None
    for i in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:i])
        if not os.stat(ancestor).st_mode & 0o001:
            closed = ancestor
            break
    if closed is None:
        return
    aside = f"{scratch}/reveal{n}"
    os.makedirs(aside)
    mount(path, aside, None, MS_BIND | MS_REC, None)
    mount("tmpfs", closed, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    os.makedirs(path)
    mount(aside, path, None, MS_BIND | MS_REC, None)


def _same(path: str, fd: int) -> bool:
    try:
        a, b = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def keep_visible(paths: list[str], held: list[int]) -> None:
    """Bind each of `paths` (held open before the volumes were mounted) read-only back at
    its own path where a volume now hides it: the host's virtual environment is this
    node's image, and a checkout under /tmp sits below a pod's emptyDir at /tmp."""
    for path, fd in zip(paths, held, strict=True):
        if _same(path, fd):
            continue
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"the host environment {path} is hidden by a volume and no mount "
                f"point can be made for it there ({exc.strerror})",
            ) from None
        mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None)
        mount("none", path, None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)


def _make_target(target: str, is_file: bool) -> None:
    """A mount point inside the container's own root (an overlay: nothing is written to the
    image)."""
    if os.path.lexists(target):
        return
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if is_file:
        with open(target, "w"):
            pass
    else:
        os.makedirs(target)


def image_root(spec: dict[str, Any], scratch: str) -> None:
    """Enter the image's root filesystem: an overlay of it (the upper layer in the
    container's scratch tmpfs, so the image stays as it is) with /proc, /dev and /sys, then
    the pod's volumes and /etc files bound at their paths inside it (symlinks of the image,
    such as /var/run -> /run, resolve inside it), optionally read-only."""
    root, upper, work = f"{scratch}/root", f"{scratch}/rootup", f"{scratch}/rootwork"
    for d in (root, upper, work):
        os.makedirs(d)
    sources = [os.open(m["source"], os.O_PATH | os.O_CLOEXEC) for m in spec["mounts"]]
    is_file = [os.path.isfile(m["source"]) for m in spec["mounts"]]
    mount(
        "overlay", root, "overlay", 0, f"lowerdir={spec['rootfs']},upperdir={upper},workdir={work}"
    )
    for d in ("proc", "dev", "sys"):
        os.makedirs(f"{root}/{d}", exist_ok=True)
    mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    mount("/dev", f"{root}/dev", None, MS_BIND | MS_REC, None)
    mount("/sys", f"{root}/sys", None, MS_BIND | MS_REC, None)
    os.chroot(root)
    os.chdir("/")
    for m, fd, file in zip(spec["mounts"], sources, is_file, strict=True):
        _make_target(m["target"], file)
        mount(f"/proc/self/fd/{fd}", m["target"], None, MS_BIND | MS_REC, None)
        os.close(fd)
        if m.get("readOnly"):
            mount("none", m["target"], None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
    if spec.get("readOnlyRoot"):
        mount("none", "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)


def container(spec: dict[str, Any]) -> None:
    pid = spec["pid"]
    for name, kind in (("net", CLONE_NEWNET), ("ipc", CLONE_NEWIPC), ("uts", CLONE_NEWUTS)):
        setns(f"/proc/{pid}/ns/{name}", kind)
    setns(f"/proc/{pid}/ns/mnt", CLONE_NEWNS)
    unshare(CLONE_NEWNS)
    private_root()
    scratch = spec["scratch"]
    size = "64m" if spec.get("rootfs") else "16m"  # an image's overlay: the root's writes
    mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700,size={size}")
    if spec.get("rootfs"):
        image_root(spec, scratch)
        _exec(spec)
    for n, path in enumerate(spec.get("reveal", [])):
        reveal(path, scratch, n)
    # the sources are held open before any overlay: an overlay of a parent such as /run
    # (for /var/run/secrets/...) would otherwise stand between a source under it and the mount
    sources = [os.open(m["source"], os.O_PATH | os.O_CLOEXEC) for m in spec["mounts"]]
    image = sorted(spec.get("keep", []), key=len)  # parents first
    held = [os.open(p, os.O_PATH | os.O_CLOEXEC) for p in image]
    overlays: list[str] = []
    for m in spec["mounts"]:
        _ensure_target(m["target"], os.path.isfile(m["source"]), scratch, overlays)
    for m, fd in zip(spec["mounts"], sources, strict=True):
        mount(f"/proc/self/fd/{fd}", m["target"], None, MS_BIND | MS_REC, None)
        os.close(fd)
        if m.get("readOnly"):
            mount("none", m["target"], None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
    keep_visible(image, held)
    for fd in held:
        os.close(fd)
    if spec.get("readOnlyRoot"):
        mount("none", "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
        for parent in overlays:
            mount("none", parent, None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
    _exec(spec)


def _exec(spec: dict[str, Any]) -> NoReturn:
    uid, gid = spec.get("uid"), spec.get("gid")
    if gid is not None:
        os.setgroups([int(g) for g in spec.get("groups", [])])
        os.setgid(int(gid))
    if uid is not None:
        os.setuid(int(uid))
    os.chdir(spec.get("workingDir") or "/")
    argv = [str(a) for a in spec["argv"]]
    env = {str(k): str(v) for k, v in spec["env"].items()}
    os.execvpe(argv[0], argv, env)


def main() -> None:
    mode, path = sys.argv[1], sys.argv[2]
    with open(path) as f:
        spec = json.load(f)
    try:
        {"pause": pause, "container": container}[mode](spec)
    except OSError as exc:
        print(f"nsexec {mode}: {exc}", file=sys.stderr, flush=True)
        sys.exit(128)


if __name__ == "__main__":
    main()
