"""The role layer: one role process, from receive to handler to send on.

`runtime` (the role's lifecycle: start, serve, drain, stop), `requests` (the request
table: work queues, fan-in joins, aborts), `handling` (what a worker does with a message:
handler, emit, fail), `handler` (loading and running the user's handler), `batching`,
`metrics` (the Prometheus families, the contract table) and `health` (the probe server).
Uses routing to send on and the relay to receive.
"""
