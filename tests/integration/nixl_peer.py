"""A nixl relay peer in its own process, for tests/integration/test_nixl_relay.py.

python -m tests.integration.nixl_peer send ENDPOINT KEYFILE NAME COUNT NBYTES
    sends COUNT payloads filled with their index, request ids NAME-i; prints "sent i"
python -m tests.integration.nixl_peer hang ENDPOINT KEYFILE NBYTES
    writes one payload into its granted slot, prints "written", never commits
python -m tests.integration.nixl_peer receive KEYFILE
    an ingress over a 64 MiB pool; prints its endpoint, then "got RID" per message
"""

from __future__ import annotations

import sys
import time

import torch

from disagg_runtime.memory.pool import MiB, Pool
from disagg_runtime.relay import Ingress, Message, connect
from disagg_runtime.relay.auth import read_key
from disagg_runtime.relay.backends import nixl


def send(endpoint: str, key: bytes, name: str, count: int, nbytes: int) -> None:
    relay = connect("nixl", endpoint, key=key, timeout=60.0)
    for i in range(count):
        relay.send(
            {"x": torch.full((nbytes,), i % 251, dtype=torch.uint8)}, request_id=f"{name}-{i}"
        )
        print(f"sent {i}", flush=True)
    relay.close()


def hang(endpoint: str, key: bytes, nbytes: int) -> None:
    real = nixl.Agent.write_prepped

    def write_then_hang(self: nixl.Agent, *args: object, **kwargs: object) -> str | None:
        state = real(self, *args, **kwargs)  # type: ignore[arg-type]
        print(f"written {state}", flush=True)
        time.sleep(3600)  # killed here: granted and written, never committed
        return state

    nixl.Agent.write_prepped = write_then_hang  # type: ignore[method-assign]
    relay = connect("nixl", endpoint, key=key, timeout=60.0)
    relay.send({"x": torch.ones(nbytes, dtype=torch.uint8)}, request_id="hung")


def receive(key: bytes) -> None:
    def got(msg: Message) -> None:
        print(f"got {msg.request_id}", flush=True)
        msg.release()

    pool = Pool.create(64 * MiB, device="cpu")
    ingress = Ingress("tcp://127.0.0.1:0", pool, key=key, on_message=got)
    print(ingress.endpoint, flush=True)
    time.sleep(3600)


def main(argv: list[str]) -> None:
    if argv[0] == "send":
        send(argv[1], read_key(argv[2]), argv[3], int(argv[4]), int(argv[5]))
    elif argv[0] == "hang":
        hang(argv[1], read_key(argv[2]), int(argv[3]))
    else:
        receive(read_key(argv[1]))


if __name__ == "__main__":
    main(sys.argv[1:])
