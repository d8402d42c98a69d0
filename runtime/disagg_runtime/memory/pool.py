"""Staging pools: a buddy allocator over one block of memory that is allocated once.

Why: fresh memory per message costs page faults, not copies (DESIGN.md section 3), so a
pool maps its memory once, reserves and faults every page in at creation (posix_fallocate
for shared memory, so a /dev/shm too small fails start-up instead of a SIGBUS later;
MAP_POPULATE), and hands out reusable slots. Backings:

    cpu         anonymous private memory; for tcp receives (recv_into a slot)
    shm         POSIX shared memory /dev/shm/disagg-<pipeline>-<role>-<pid>-<n>; other
                processes on the node attach by name; the owner unlinks it on close
    cpu-pinned  the same shared memory, page-locked and registered with CUDA
                (cudaHostRegister), so GPU peers copy in and out of it at DMA speed and
                the shm and tcp relays still land in it (needs CUDA)
    cuda        device memory on the current GPU; other processes on the same GPU map it
                through CUDA IPC (relay/backends/cuda_ipc/) (needs CUDA)

Ownership. The owner of a shared segment holds an exclusive flock on it for as long as it
lives; the kernel drops the lock when the owner dies, SIGKILL and OOM kill included. So a
segment whose lock is free is garbage: a dead incarnation's. Process ids cannot say this:
in a pod the role is PID 1 in every incarnation (same pid, so the same name, and /dev/shm
is an emptyDir that outlives the container), and pids are per namespace and recycled. A
segment is built unnamed (O_TMPFILE), locked and sized, then linked under its name, so a
name never shows a half-made or unlocked segment; a name taken by a dead owner's segment
is reclaimed (`reclaim_stale`), one taken by a live owner is refused with who holds it.

A slot holds one payload's tensors laid out by `manifest.layout` (layout.py writes and
reads them; copies.py moves them to and from GPUs); the pool is memory only.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import mmap
import os
import re
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

from disagg_core.spec import POOL_DEVICES, PoolDevice
from disagg_runtime.memory.allocator import AllocatorError, BuddyAllocator

SHM_DIR = "/dev/shm"
SHM_PREFIX = "disagg-"
SHM_NAME_MAX = 255  # NAME_MAX: a longer name is no file in /dev/shm
_SHM_NAME = re.compile(r"disagg-[A-Za-z0-9_.-]+")  # what shm_name makes (and nothing else)
MiB = 1 << 20
# a spec's pool devices, plus `shm`: the shared backing a node-local `cpu` pool gets
Device = Literal[PoolDevice, "shm"]
DEVICES: tuple[Device, ...] = (*POOL_DEVICES, "shm")
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context
_counter = itertools.count()
log = logging.getLogger(__name__)


class PoolError(RuntimeError):
    """A pool could not be created, attached or used as asked."""


def cuda_unavailable_reason() -> str | None:
    """Why CUDA cannot be used in this process, or None when it can."""
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    if not torch.cuda.is_available():
        return "no CUDA device is available (torch.cuda.is_available() is False)"
    return None


def _require_cuda(what: str) -> None:
    reason = cuda_unavailable_reason()
    if reason is not None:
        raise PoolError(f"{what} needs CUDA, and {reason}")


def shm_prefix(pipeline: str, role: str) -> str:
    """What every segment name of this pipeline and role starts with (then `<pid>-<n>`)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{pipeline}-{role}")[:160]
    return f"{SHM_PREFIX}{safe}-"


def shm_name(pipeline: str, role: str) -> str:
    """A /dev/shm name unique to this process, namespaced by pipeline and role."""
    return f"{shm_prefix(pipeline, role)}{os.getpid()}-{next(_counter)}"


# ---- ownership of shared segments --------------------------------------------------------------


def _try_lock(fd: int) -> bool:
    """Take the owner's lock on an open segment; False when a live process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _lock_holder(fd: int) -> int | None:
    """The pid (in this PID namespace) holding the flock on `fd`'s file, from /proc/locks;
    None when the holder is not visible from here (another PID namespace)."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with contextlib.suppress(OSError), open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == key:
                return int(fields[4]) or None
    return None


def _describe_owner(name: str, fd: int) -> str:
    pid = _lock_holder(fd)
    if pid is not None:
        cmdline = ""
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
        return f"pid {pid}" + (f" ({cmdline})" if cmdline else "")
    match = re.search(r"-(\d+)-\d+$", name)
    named = f"pid {match.group(1)} in its own PID namespace, " if match else ""
    return f"a live process outside this PID namespace ({named}by the segment's name)"


def _remove_if_stale(name: str) -> bool | str:
    """Unlink segment `name` if its owner is gone: True when it is gone (removed by us or
    already), else a description of the live owner."""
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True
    try:
        if not _try_lock(fd):
            return _describe_owner(name, fd)
        # ours now: nobody else can be reclaiming it; unlink it only if the name still is it
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
        return True
    finally:
        os.close(fd)  # drops the lock, after the name is gone


def reclaim_stale(prefix: str, *, why: str | None = "its owner is gone") -> dict[str, int]:
    """Unlink the segments named `prefix` + digits and dashes whose owner is dead (lock
    free); live owners' segments are left alone. Returns {name: size} of those removed,
    each logged with `why` (unless None: the caller says it)."""
    if not prefix.startswith(SHM_PREFIX) or "/" in prefix:
        raise PoolError(f"refusing to reclaim {prefix!r}: not a disagg shared-memory prefix")
    removed: dict[str, int] = {}
    try:
        names = sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(prefix) or not re.fullmatch(r"[0-9-]+", name[len(prefix) :]):
            continue
        size = _size_of(name)
        with contextlib.suppress(PermissionError):  # another user's: not ours to judge
            if size is not None and _remove_if_stale(name) is True:
                removed[name] = size
                if why is not None:
                    mib = size / MiB
                    log.warning("reclaimed shared-memory pool %s (%.1f MiB): %s", name, mib, why)
    return removed


def _size_of(name: str) -> int | None:
    try:
        return os.stat(os.path.join(SHM_DIR, name), follow_symlinks=False).st_size
    except FileNotFoundError:
        return None


def shm_namespace(pipeline: str) -> str:
    """The prefix every `shm_name` of `pipeline` starts with (senders map no other pool)."""
    return f"{SHM_PREFIX}{re.sub(r'[^A-Za-z0-9_.-]', '_', f'{pipeline}-')[:160]}"


def _map(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE)


def _cudart() -> Any:
    return cast(Any, torch.cuda).cudart()


class Backing:
    """Memory behind a pool, exposed as one flat uint8 tensor (`tensor`)."""

    def __init__(
        self,
        device: Device,
        tensor: torch.Tensor,
        *,
        name: str | None = None,
        mapping: mmap.mmap | None = None,
        owner: bool = True,
        lock_fd: int | None = None,
    ) -> None:
        self.device = device
        self.tensor = tensor
        self.name = name
        self.size = tensor.numel()
        self._mapping = mapping
        self._owner = owner
        self._lock_fd = lock_fd  # the owner's flock on the segment (see "Ownership")
        self._registered: int | None = None  # address passed to cudaHostRegister
        self.closed = False

    @property
    def has_buffer(self) -> bool:
        """Host memory reachable as a buffer (recv_into, zero-copy decode)."""
        return self._mapping is not None

    @property
    def pinned(self) -> bool:
        """Page-locked: GPU copies in and out of it run asynchronously, at DMA speed."""
        return self._registered is not None or (self.device == "cpu-pinned" and not self.closed)

    def buffer(self, offset: int, nbytes: int) -> memoryview:
        """Writable byte view of host memory (for recv_into); not for device memory."""
        if self._mapping is None:
            raise PoolError(f"{self.device} pool memory has no host buffer")
        return memoryview(self._mapping)[offset : offset + nbytes]

    def pin(self) -> None:
        """Page-lock this mapping and register it with CUDA (idempotent); PoolError if not."""
        if self._registered is not None or self.size == 0:
            return
        if self._mapping is None:
            raise PoolError(f"{self.device} pool memory is not a host mapping; cannot pin it")
        _require_cuda("pinning a pool")
        ptr = self.tensor.data_ptr()
        try:
            cudart = _cudart()
            err = cudart.cudaHostRegister(ptr, self.size, _HOST_REGISTER_PORTABLE)
            if err != cudart.cudaError.success:
                raise PoolError(f"cudaHostRegister failed: {cudart.cudaGetErrorString(err)}")
        except (RuntimeError, AssertionError) as exc:
            if isinstance(exc, PoolError):
                raise
            raise PoolError(f"cannot page-lock {self.size} B for CUDA: {exc}") from None
        self._registered = ptr

    def close(self) -> None:
        """Unlink (owner) and unmap. Views still alive keep the pages until they die."""
        if self.closed:
            return
        self.closed = True
        if self._registered is not None:
            with contextlib.suppress(Exception):  # best effort: the pages go with the mapping
                _cudart().cudaHostUnregister(self._registered)
            self._registered = None
        if self.name is not None and self._owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, self.name))
        if self._lock_fd is not None:  # after the unlink: the name is never free and unlocked
            os.close(self._lock_fd)
            self._lock_fd = None
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._mapping is not None:
            # with views still exported the mapping goes away with the last of them
            with contextlib.suppress(BufferError):
                self._mapping.close()


def _link(fd: int, path: str) -> None:
    """Give the unnamed file `fd` the name `path` (FileExistsError if it is taken)."""
    proc_fds = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:  # linkat(AT_SYMLINK_FOLLOW) through /proc: how an O_TMPFILE file gets a name
        os.link(str(fd), path, src_dir_fd=proc_fds, follow_symlinks=True)
    finally:
        os.close(proc_fds)


def _publish(fd: int, name: str) -> None:
    """Link the segment under `name`, reclaiming a dead owner's segment that has it."""
    path = os.path.join(SHM_DIR, name)
    for _ in range(3):  # a stale one removed, then (rarely) the name taken again: retry
        try:
            _link(fd, path)
            return
        except FileExistsError:
            size = _size_of(name)
            owner = _remove_if_stale(name)
            if owner is not True:
                raise PoolError(
                    f"shared-memory pool {name!r} already exists and its owner is alive: "
                    f"{owner}; a second process with the same pipeline, role, replica "
                    "and pid shares this /dev/shm"
                ) from None
            if size is not None:
                log.warning(
                    "reclaimed shared-memory pool %s (%.1f MiB): its owner is gone "
                    "(a previous incarnation of this process?)",
                    name,
                    size / MiB,
                )
    raise PoolError(f"shared-memory pool {name!r} keeps being created by another process")


def _reserve(fd: int, size: int) -> None:
    """Size the segment and reserve its pages now. `ftruncate` + MAP_POPULATE do not fail on
    a full tmpfs: the pages missing are a SIGBUS at the first touch, under load, after the
    role said it was ready. `posix_fallocate` allocates them or fails (ENOSPC), so a
    /dev/shm smaller than the pool is a clear error at start-up."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        free = _free_bytes(SHM_DIR)
        raise PoolError(
            f"cannot reserve a {size / MiB:.1f} MiB shared-memory pool in {SHM_DIR} "
            f"({free / MiB:.1f} MiB free there): {exc.strerror}; make {SHM_DIR} larger "
            "(a memory emptyDir's sizeLimit) or the pool smaller (transport.poolSize)"
        ) from None


def _free_bytes(path: str) -> int:
    try:
        stat = os.statvfs(path)
    except OSError:
        return 0
    return stat.f_bavail * stat.f_frsize


def _create_shm(device: Device, size: int, name: str) -> Backing:
    try:
        fd = os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError as exc:
        raise PoolError(f"cannot create a shared-memory pool in {SHM_DIR}: {exc}") from None
    mapping: mmap.mmap | None = None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh inode: nobody else has it
        _reserve(fd, size)
        mapping = _map(fd, size)
        _publish(fd, name)
    except BaseException:
        if mapping is not None:
            mapping.close()
        os.close(fd)
        raise
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)
    return Backing(device, tensor, name=name, mapping=mapping, lock_fd=fd)


def create_backing(device: Device, size: int, *, name: str | None = None) -> Backing:
    """Allocate `size` bytes once and fault every page in."""
    if device in ("cpu-pinned", "cuda"):
        _require_cuda(f"pool device {device!r}")
    if device == "cuda":
        index = torch.cuda.current_device()
        try:
            tensor = torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", index))
        except torch.OutOfMemoryError as exc:
            raise PoolError(f"cannot allocate a {size} B pool on cuda:{index}: {exc}") from None
        return Backing(device, tensor)
    if device == "cpu":
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_POPULATE
        try:  # (anonymous memory: no SIGBUS; too little is ENOMEM here, or the OOM killer)
            mapping = mmap.mmap(-1, size, flags=flags)
        except OSError as exc:
            raise PoolError(f"cannot allocate a {size / MiB:.1f} MiB pool: {exc}") from None
        return Backing(device, torch.frombuffer(mapping, dtype=torch.uint8), mapping=mapping)
    if device not in ("shm", "cpu-pinned"):
        raise PoolError(f"unknown pool device {device!r}; expected one of {', '.join(DEVICES)}")
    backing = _create_shm(device, size, name or shm_name("anon", "pool"))
    if device == "cpu-pinned":
        try:
            backing.pin()
        except BaseException:
            backing.close()
            raise
    return backing


def pinned_staging(size: int) -> Backing:
    """Private page-locked host memory (not shared): a bounce buffer for GPU tensors."""
    _require_cuda("a pinned staging buffer")
    return Backing("cpu-pinned", torch.empty(size, dtype=torch.uint8, pin_memory=True))


def check_shm_name(name: str) -> str:
    """`name` if it is one `shm_name` could have made; PoolError naming why not (NUL bytes,
    slashes, other characters, longer than a file name may be), echoing at most 80 of it."""
    if len(name) > SHM_NAME_MAX:
        raise PoolError(
            f"refusing {name[:80]!r}...: {len(name)} characters, not a disagg shared-memory "
            f"name (at most {SHM_NAME_MAX})"
        )
    if not _SHM_NAME.fullmatch(name):
        raise PoolError(f"refusing {name[:80]!r}: not a disagg shared-memory name")
    return name


def attach_backing(name: str) -> Backing:
    """Map another process's shared pool by name (not owned: closing does not unlink)."""
    check_shm_name(name)
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    except FileNotFoundError:
        raise PoolError(f"shared-memory pool {name!r} does not exist (peer gone?)") from None
    try:
        size = os.fstat(fd).st_size
        mapping = _map(fd, size)
    finally:
        os.close(fd)
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)
    return Backing("shm", tensor, name=name, mapping=mapping, owner=False)


@dataclass(frozen=True)
class PoolStats:
    total: int
    used: int  # bytes in live blocks (after the allocator's power-of-two rounding)
    largest_free: int
    occupancy: float  # used / total
    requested: int = 0  # bytes the live slots were asked for: the payloads themselves


class Pool:
    """A buddy allocator over a backing; slots are offsets into `backing.tensor`."""

    def __init__(self, backing: Backing, *, min_block: int = MiB) -> None:
        self.backing = backing
        self.allocator = BuddyAllocator(backing.size, min_block)

    @classmethod
    def create(
        cls, size: int, *, device: Device = "cpu", min_block: int = MiB, name: str | None = None
    ) -> Pool:
        if size < min_block:
            raise PoolError(f"pool size {size} B is smaller than the minimum block {min_block} B")
        try:
            BuddyAllocator(size, min_block)  # check the geometry before touching memory
        except AllocatorError as exc:
            raise PoolError(f"bad pool geometry: {exc}") from None
        return cls(create_backing(device, size, name=name), min_block=min_block)

    @property
    def name(self) -> str | None:
        return self.backing.name

    def stats(self) -> PoolStats:
        s = self.allocator.stats()
        occupancy = s.used / s.total if s.total else 0.0
        return PoolStats(
            total=s.total,
            used=s.used,
            largest_free=s.largest_free,
            occupancy=occupancy,
            requested=s.requested,
        )

    def allocate(self, nbytes: int) -> int | None:
        return self.allocator.allocate(max(nbytes, 1))

    def free(self, offset: int) -> None:
        self.allocator.free(offset)

    def close(self) -> None:
        self.allocator.reset()
        self.backing.close()
