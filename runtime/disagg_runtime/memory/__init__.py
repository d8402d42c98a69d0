"""The memory layer: where a payload lands and how bytes get there.

`allocator` (the buddy allocator over one pool), `pool` (pre-faulted shared/pinned/device
memory and its segment names), `layout` (a payload laid out in a slot, and read back as
views), `copies` (host/device copies and their fences), `intake` (the memory a landing
writes into: a pool's host bytes or a device's). Below the relay so a relay never owns
memory, only moves it. Imports only the wire layer.
"""
