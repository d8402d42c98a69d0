"""Errors a relay raises to its caller."""


class RelayError(RuntimeError):
    """A transfer failed; the message says which peer and why."""


class RelayTimeout(RelayError, TimeoutError):
    """A transfer did not complete in time (typically: the receiver's pool stayed full)."""


class NotAPeer(RelayError):
    """The other end did not prove the pipeline's peer key, or refused ours."""
