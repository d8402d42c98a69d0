"""Errors a relay raises to its caller."""


class RelayError(RuntimeError):
    """A transfer failed; the message says which peer and why."""


class RelayTimeout(RelayError, TimeoutError):
    """A transfer did not complete in time (typically: the receiver's pool stayed full)."""


class Overloaded(RelayTimeout):
    """The receiver had no room to queue the payload now (too much waits there already)
    and said so at once: nothing of it was kept; retry later or on another replica."""


class NeverFits(RelayError):
    """The payload is larger than the receiver's pool can ever hold (its largest block):
    waiting or retrying cannot help."""


class NotAPeer(RelayError):
    """The other end did not prove the pipeline's peer key, or refused ours."""


class PeerLost(NotAPeer):
    """The receiver no longer holds this sender's authenticated session (its process
    restarted, or the connection the handshake proved was lost): nothing of the payload was
    delivered. The caller reconnects (a fresh handshake) and may send it again."""


class WrongRole(PeerLost):
    """The endpoint proved the peer key but serves another role of the pipeline: its
    address was reused by another pod before this sender's name lookup caught up. Nothing
    was sent to it; the caller looks the role up afresh."""


class Unanswered(PeerLost):
    """The endpoint did not complete the handshake in the time allowed for it (its pod is
    gone while a name lookup still lists it, or it cannot be reached). Nothing was sent;
    the caller may spend the time left on another replica (peers.CONNECT_S)."""
