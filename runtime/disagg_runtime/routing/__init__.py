"""The routing layer: which replica of a downstream role gets a message.

`dispatch` (the choice: filters, then power of two choices over load reports), `peers`
(the replicas of each downstream role, resolved from DNS or a peers file, with one relay
each), `forward` (send to a replica, with one failover when it is lost or refuses).
Above the relay (it uses senders), below the role and the client (both forward through
it, so failover is written once).
"""
