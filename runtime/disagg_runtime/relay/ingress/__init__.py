"""The receiving end of every relay, in four parts over one I/O thread (see loop.py):

- `loop`: the `Ingress` itself: construction, the application side (`recv`, `abort`,
  `goodbye`, `close`), the I/O thread (poll, the ZMQ ROUTER, replies, expiry);
- `lanes`: the inline lane's server side;
- `session`: handshakes, welcomes, peers, load reports;
- `ops`: the op table (reserve, commit, inline, cancel, abort) and landing payloads.

`parts` declares the state they share. Independent of the relay backends (import-linter):
a relay kind reaches the ingress only through its `Landing` (relay/landing.py), as the
tcp chunks do (relay/backends/tcp/land.py: the loop hands it a sender's next messages).
"""

from disagg_runtime.relay.ingress.loop import Ingress, IngressStats

__all__ = ["Ingress", "IngressStats"]
