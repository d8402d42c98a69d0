"""Submit payloads to a pipeline's entry roles; get results or chunk streams back.

    client = Client(entries=[Peer("encoder", ("127.0.0.1:7400",))], exits=["decoder"])
    video = client.submit({"prompt": tokens}, timeout=30)
    for frame in client.stream(payload): ...

A caller that makes a payload's bytes itself can write them straight into the entry
role's pool (shm entry relay, one entry role): `reserve(manifest)` holds a slot there,
the caller fills `Reserved.slot`, and `Reserved.start` submits it (`release` gives an
unused slot back). Over tcp it can stream them there as they come instead: `upload`
reserves a slot on a connection of the upload's own (peers.py `Dedicated`) and sends each
chunk once the caller says its bytes are in (`Upload.advance`); `Upload.start` submits
the request, `release` cuts the transfer, which frees the slot at once.

Its parts: `submit` (the `Client`: its pool, ingress, entry relays, deadlines, aborts),
`pending` (one request in flight and how its messages add up to a result: pure),
`direct` (`Reserved`, `Upload`), `errors` (how a request fails).
"""

from disagg_runtime.client.direct import Reserved, Upload, chunk_sources
from disagg_runtime.client.errors import (
    TOO_LARGE,
    RequestFailed,
    RequestOverloaded,
    RequestTimeout,
    UploadExpired,
)
from disagg_runtime.client.pending import Streamed, detach
from disagg_runtime.client.submit import Client

__all__ = [
    "TOO_LARGE",
    "Client",
    "RequestFailed",
    "RequestOverloaded",
    "RequestTimeout",
    "Reserved",
    "Streamed",
    "Upload",
    "UploadExpired",
    "chunk_sources",
    "detach",
]
