"""local/groupshm.py's /proc/PID/maps parsing (pure)."""

from __future__ import annotations

from disagg_runtime.local.groupshm import shm_paths


def test_maps_parsing_keeps_live_shm_files_only() -> None:
    maps = "\n".join(
        [
            "7f00-7f10 rw-s 00000000 00:1a 12 /dev/shm/psm_1234abcd",
            "7f10-7f20 rw-s 00000000 00:1a 13 /dev/shm/sem.mp-x1",
            "7f20-7f30 rw-s 00000000 00:1a 14 /dev/shm/psm_gone (deleted)",
            "7f30-7f40 rw-s 00000000 00:1a 15 /dev/shm/disagg-p-r-1-0",
            "7f40-7f50 r-xp 00000000 08:01 16 /usr/lib/libc.so.6",
            "7f50-7f60 rw-p 00000000 00:00 0 ",
            "7f60-7f70 rw-s 00000000 00:1a 17 /dev/shm/a dir/x",
            "garbage",
        ]
    )
    assert shm_paths(maps, skip_prefix="disagg-") == {
        "/dev/shm/psm_1234abcd",
        "/dev/shm/sem.mp-x1",
    }
    assert "/dev/shm/disagg-p-r-1-0" in shm_paths(maps)
