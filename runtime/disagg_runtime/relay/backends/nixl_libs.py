"""Why a process that starts a NIXL agent on an RDMA node died with SIGSEGV at exit, and the fix.

The nixl wheel bundles rdma-core (a renamed `libibverbs`, `libnl-3`, `libnl-route-3`) and
loads them into the global symbol scope. Its `libibverbs` reads /etc/libibverbs.d and
dlopens the system's providers (package `ibverbs-providers`), which need the system's
`libibverbs.so.1`, and through it the system's `libnl-route-3.so.200`. That second
libnl-route's relocations bind to the first copy found in the global scope, the bundled
one, so its constructor's `rtnl_tc_register` calls land in the bundled copy (which has
those traffic-control kinds already and refuses them: nothing is linked), and at exit its
destructor's `rtnl_tc_unregister` runs the bundled copy's list unlink on entries that
were never linked: SIGSEGV in `_dl_fini`, after all of Python's work is done (the
process printed its output and then exited 139). Seen with gdb:

    #0 rtnl_tc_unregister () from nixl_cu13.libs/libnl-route-3-3ad497a3.so.200.26.0
    #1 _dl_call_fini ()  #2 _dl_fini ()  #3 __run_exit_handlers ()

The fix: before NIXL is imported, load the system's libnl-route (and its libnl-3) with
RTLD_DEEPBIND, so that copy binds its own symbols first, registers in and unregisters from
its own lists, and the two copies never meet. Where the system has no libnl-route (no
libibverbs installed), nothing is loaded. UCX's RDMA transports are untouched (hiding
them, `UCX_MODULES=^ib`, also stops the crash but takes RDMA away).
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)
SYSTEM_LIBNL = ("libnl-3.so.200", "libnl-route-3.so.200")  # the sonames libibverbs.so.1 needs

_held: dict[str, ctypes.CDLL] = {}  # loaded once per process, kept for its lifetime
_tried = False


def isolate_system_libnl() -> list[str]:
    """Load the system's libnl libraries self-bound (see the module doc); returns the ones
    loaded (empty where the system has none). Idempotent."""
    global _tried
    deepbind = getattr(os, "RTLD_DEEPBIND", 0)  # glibc only: elsewhere no such clash
    if not _tried and deepbind:
        _tried = True
        for soname in SYSTEM_LIBNL:
            try:
                _held[soname] = ctypes.CDLL(soname, mode=os.RTLD_NOW | os.RTLD_LOCAL | deepbind)
            except OSError:
                continue  # absent: no system libibverbs to clash with
        if _held:
            log.debug("nixl: the system's %s loaded self-bound", ", ".join(_held))
    return list(_held)
