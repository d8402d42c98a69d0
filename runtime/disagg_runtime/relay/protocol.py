"""Relay control messages: what travels between a sender (ZMQ DEALER) and an ingress (ROUTER).

Every message is `[header, *data]`, the header a JSON object with "op" and the protocol
version "pv". Large payloads use a credit handshake so that a full receive pool stalls
the sender instead of dropping or over-allocating (DESIGN.md section 7):

    sender                               ingress (owns the receive pool)
    hello {relay, nonce}           -->
                                   <--   challenge {nonce}
    auth {mac}                     -->   (relay/auth.py: both ends prove the peer key)
                                   <--   welcome {pool, pool_device, pool_size,
                                                  max_allocation, lease_s,
                                                  lane_id[, lane_port | lane_path],
                                                  [inline_wire, commit_wire,] inline_ack,
                                                  load, [compat,] [role,] mac}
    inline {rid, manifest[, xid]} + slot bytes -->  small payloads: the slot travels in the
                                         message; with an `xid` (over ZMQ, where
                                         `inline_ack` is offered) it is answered:
                                   <--   ack {xid} | overloaded {rid[, xid], reason} | nack
                                         (without one only a refusal is: `overloaded`)
    reserve {rid, xid, nbytes[, lane]} -->   queued until the pool has room
                                   <--   grant {xid, offset, lease_s} | deny {xid, reason[,
                                         timeout][, overloaded]}
    (shm: sender writes the slot in the shared pool)
    commit {rid, xid, offset, manifest[, chunk][, next]} [+ chunk frames for tcp]  -->
                                   <--   ack {xid[, spare]} | nack {xid, reason}
    (tcp: a chunk frame of the wrong size fails the transfer; the ingress reads the
    rest of its chunks, frees the slot and nacks. A sender cuts a transfer it cannot
    finish so: its remaining chunks go empty, relay/backends/tcp/send.py `ChunkStream.cut`)
    cancel {xid}                   -->   sender gave up waiting: drop the reservation/grant
    abort {rid}                    -->   free every slot the request holds
                                   <--   refused {reason[, xid]}: the sender is not (or no
                                         longer) an authenticated peer here
                                   <--   load {load}: every LOAD_EVERY_S while it changes
                                         (at least every LOAD_KEEPALIVE_S), to senders that
                                         sent something in the last LOAD_ACTIVE_S; over ZMQ
                                         even where replies go on the lane
                                   <--   goodbye {reason}: the receiver is closing; send
                                         nothing more here (what came before it is served)

`load` (Load: queued, active, workers, free_bytes, pool_bytes, draining) is the
receiver's own account of how busy it is, for senders choosing among replicas
(routing/dispatch.py); it rides on the welcome, every grant and ack, and the periodic `load`
message (inline payloads get no reply, so that is how their senders hear). A malformed
one fails the connection (welcome) or the reply it came on, like any bad field.

Credit (on the wire a "spare"): a commit may ask for a slot for the sender's next
payload, `next {xid, nbytes}` (a fresh xid); the ack then may grant it at once, `spare
{xid, offset, lease_s}`, with a short lease, within the receiver's credit bounds
(relay/credit.py). The sender writes its next payload that fits there and commits it
under that xid without a reservation (no round trip before the data goes), or cancels
it; the reservation handshake comes back only when credit runs out. A malformed `next`
refuses its commit (nack); a commit under an xid the sender holds no grant or credit for
is refused likewise.

`goodbye` is the last thing a closing receiver (a role at the end of its drain) tells every
peer, and every sender that completes a handshake after it. It keeps serving for a short
linger after saying it, so what crossed it on the wire still lands; a sender that read it
sends nothing more on that connection (PeerLost: the caller picks a replica afresh). An
inline payload gets no reply, so without it a sender that had not yet heard that the
receiver is going (its DNS view lagging) would send into a socket about to close.

`compat` ({token, accepts}) is the receiving replica's compat token (disagg_core.compat):
senders route a request only to replicas whose token pairs with their own. Absent (a
client's or gateway's reply ingress): it pairs with anything.

`overloaded` is the answer of an ingress that has no room to queue something now: an
inline payload over ZMQ that finds the inline budget full (on a lane, the sender stalls
instead), or a reservation beyond what may wait in all (relay/ledger.py PendingBounds:
a `deny` with `overloaded`). Nothing of it is kept; the sender may retry, elsewhere or
later (relay/sender.py reserves a refused inline payload: the pool's flow control).

`xid` numbers each operation of a sender so that a late grant for an operation that timed
out is never mistaken for the current one (completions are per operation).

The inline lane (relay/lane.py) is a plain socket beside the ZMQ one that carries `inline`
and `abort` messages in the same JSON: the welcome says where it listens and under which
one-time id (`lane_id`) the sender introduces itself there; a reservation's `lane` is how many lane
frames the sender had written before it, and it is granted only once they are all taken.

`inline_wire` (a version, 1) says the ingress reads inline payloads on the lane with a
binary header instead of this JSON (relay/inline_wire.py): struct-packed lengths, the
manifest's layout cached per lane by its bytes. Senders use it only where offered.
`commit_wire` (a version, 1) says the same for an shm sender's `commit` on a control lane:
its fields (rid, xid, offset, manifest, meta, next) in a binary header of the same form.

`pool_device` (shm, cpu, cpu-pinned, cuda) says where the ingress lands staged payloads; a
sender picks its inline limit by it (relay/backends/tcp/send.py: medium payloads inline
to host pools).

`role` names the role an ingress serves, under the welcome's mac: a sender that dialled
a role's address checks it, so an address another role's pod has taken over (before the
sender's DNS lookup caught up) is refused rather than sent to (WrongRole).

cuda-ipc (relay/backends/cuda_ipc/) adds two fields: the welcome to a `hello {relay: "cuda-ipc"}`
carries `cuda` (the CUDA pool's IPC export for this peer) or `cuda_unavailable` (why not),
and its commits carry `event` (the sender's interprocess CUDA event; the receiver delivers
only once it has completed).
"""

from __future__ import annotations

import re
from typing import Any

from disagg_core.compat import Compat, CompatError
from disagg_runtime.wire.codec import CodecError, decode_header, encode_header

PROTOCOL_VERSION = 1
MAX_CONTROL_BYTES = 4 << 20
MAX_INLINE_MESSAGE_BYTES = 16 << 20  # the most slot bytes an inline message may carry
MAX_FRAME_BYTES = MAX_INLINE_MESSAGE_BYTES  # no ZMQ frame may be longer (tcp chunks included)
OPS_TO_INGRESS = frozenset({"hello", "auth", "inline", "reserve", "commit", "cancel", "abort"})
OPS_TO_SENDER = frozenset(
    {
        "challenge",
        "welcome",
        "refused",
        "grant",
        "deny",
        "ack",
        "nack",
        "load",
        "goodbye",
        "overloaded",
    }
)
INLINE_ACK_VERSION = 1  # the welcome's `inline_ack`: inline payloads with an xid are answered
HANDSHAKE_OPS = frozenset({"hello", "auth"})  # all an unauthenticated peer may send
MAX_HANDSHAKE_BYTES = 4096  # and no longer than this
LOAD_EVERY_S = 0.1  # how often an ingress tells its active senders its load, when it changed
LOAD_KEEPALIVE_S = 0.5  # and at least this often while they stay active
LOAD_ACTIVE_S = 2.0  # a sender silent for longer gets no more `load` messages (nor reads them)


class ProtocolError(ValueError):
    """A control message is malformed or unexpected."""


def pack(op: str, **fields: Any) -> bytes:
    """A control header; CodecError when it is over MAX_CONTROL_BYTES (a payload tree too
    large to describe: the sender fails rather than the receiver)."""
    header = encode_header({"v": 1, "pv": PROTOCOL_VERSION, "op": op, **fields})
    if len(header) > MAX_CONTROL_BYTES:
        raise CodecError(
            f"relay {op} header would be {len(header)} bytes, over the limit of "
            f"{MAX_CONTROL_BYTES}; move large values into tensors"
        )
    return header


def unpack(frame: Any, allowed: frozenset[str]) -> dict[str, Any]:
    """Parse a control header and check its op; raises ProtocolError."""
    try:
        msg = decode_header(frame, max_bytes=MAX_CONTROL_BYTES)
    except CodecError as exc:
        raise ProtocolError(f"bad control message: {exc}") from None
    if msg.get("pv") != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported relay protocol version {msg.get('pv')!r}")
    op = msg.get("op")
    if op not in allowed:
        raise ProtocolError(f"unexpected relay op {op!r}")
    return msg


def field(msg: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """Fetch a typed field; bools are not ints here."""
    value = msg.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ProtocolError(f"relay {msg.get('op')}: field {name!r} missing or not {kind}")
    return value


def compat(msg: dict[str, Any]) -> Compat | None:
    """The welcome's advertised compat token, validated; None when it advertises none."""
    if "compat" not in msg:
        return None
    try:
        return Compat.from_wire(msg["compat"], f"relay {msg.get('op')}: field 'compat'")
    except CompatError as exc:
        raise ProtocolError(str(exc)) from None


def role(msg: dict[str, Any]) -> str | None:
    """The role a welcome says its ingress serves (a DNS label); None when it names none
    (a client's or gateway's reply ingress, or an older runtime)."""
    if "role" not in msg:
        return None
    name: str = field(msg, "role", str)
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", name):
        raise ProtocolError(f"relay {msg.get('op')}: field 'role' is not a role name")
    return name


def meta(msg: dict[str, Any]) -> dict[str, Any] | None:
    """A message's `meta` (the sender's routing metadata, unread by relays), if any."""
    value = msg.get("meta")
    if value is not None and not isinstance(value, dict):
        raise ProtocolError("relay message: 'meta' must be an object")
    return value


def nonneg_int(msg: dict[str, Any], name: str) -> int:
    value: int = field(msg, name, int)
    if value < 0:
        raise ProtocolError(f"relay {msg.get('op')}: field {name!r} is negative")
    return value
