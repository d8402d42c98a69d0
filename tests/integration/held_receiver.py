"""A receiver that keeps every message it gets (its pool fills, so a later sender waits
for a grant), in its own process so a test can kill -9 it: for test_killed_receiver.py.

python -m tests.integration.held_receiver KEYFILE POOL_BYTES
    prints its endpoint, then "got RID" per message (never released)
"""

from __future__ import annotations

import sys
import time

from disagg_runtime.memory.pool import Pool
from disagg_runtime.relay import Ingress, Message
from disagg_runtime.relay.auth import read_key


def main(keyfile: str, size: int) -> None:
    held: list[Message] = []

    def got(msg: Message) -> None:
        held.append(msg)
        print(f"got {msg.request_id}", flush=True)

    pool = Pool.create(size, device="cpu")
    ingress = Ingress("tcp://127.0.0.1:0", pool, key=read_key(keyfile), on_message=got)
    print(ingress.endpoint, flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
