"""Relays move payloads between two role processes: `shm` on one node, `tcp` (ZMQ) across nodes."""
