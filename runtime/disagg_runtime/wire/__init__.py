"""The wire layer: what crosses a socket, and nothing that moves it.

`codec` (allow-listed dtypes, tensor metas and buffers, strict JSON), `tree` (payload
trees: `flatten`, `unflatten`), `manifest` (where each tensor
lies in a slot), `envelope` (a request's metadata and replies), `load` (what a receiver
says of itself on welcome, grant and ack). Pure and torch-light, so every layer above can
parse and check a message before memory is touched. Imports nothing else of the runtime.
"""
