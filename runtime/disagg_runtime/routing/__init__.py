"""The routing layer: which replica of a downstream role gets a message, and getting it there.

`dispatch` (the choice: filters, then power of two choices over load reports), `peers`
(the replicas of each downstream role, resolved from DNS or a peers file, pinned per
request), `relays` (the relays kept open to them: a bounded shared cache, dedicated tcp
connections for uploads), `failover` (THE send-with-failover: once more, elsewhere, when a
replica is lost before anything was delivered), `forward` (a role's sends downstream and
to reply endpoints, through failover). Above the relay (it uses senders), below the role
and the client (both send through `failover`, so it is written once).
"""
