"""disagg runtime: the data plane every role process runs, and the CLI, in layers.

Top down, each importing only from layers below it (import-linter, pyproject.toml):

    cli | bench | local | gateway, models, demo | role, client | routing | relay | memory | wire

- `wire`: what crosses a socket (codec, manifest, envelope, load reports); pure checks.
- `memory`: where payloads live (allocator, pools, layouts, copies, intake).
- `relay`: moving a payload to one receiver (protocol, sender = link + session, ledger,
  `ingress/`, `backends/`); `relay.ingress` and `relay.backends` are independent: a
  backend reaches the ingress only through its `Landing`.
- `routing`: which replica, and sending there with failover (`forward`).
- `role` and `client`: the role process; the caller's side (gateway, `disagg up`).

Where this differs from the first plan (issue "The runtime's layers as folders"), and
why: `Load`/`View` live in `wire/load.py` (the relay carries and checks them, so they
cannot be routing's); the sender is cut into `relay/link.py` (the connection) and
`relay/sender.py` (how payloads go) besides `relay/session.py`, because the connection
alone was 450 lines; `role/health.py` holds the HTTP side of the metrics; the codec's
payload trees are `wire/tree.py` (the codec keeps dtypes, metas, buffers and strict JSON),
and its whole-message `encode`/`decode` are `bench/frames.py`, built from the validators
the codec now makes public (the property tests import them from there); the tcp chunk
landing is `relay/backends/tcp/land.py`, behind `Landing.take` (the ingress hands it the
sender's next messages).
"""

__version__ = "0.1.0"
