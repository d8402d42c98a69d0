"""The relay backends, one module (or package) per kind: `shm`, `tcp`, `nixl`, `cuda_ipc`.

Each registers a `registry.Backend` (its sender and its landing) and is imported only when
a role selects it (`registry.backend`), so a role that never uses NIXL or CUDA never
imports them. A backend imports the relay's protocol modules and the memory layer, never
the ingress nor another backend.
"""
