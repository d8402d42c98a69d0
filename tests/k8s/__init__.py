"""A Kubernetes API server emulator for tests: kmock plus the fixes this project needs.

- ``emulator``: the request handler (``KubeEmulator``, a ``kmock.KubernetesEmulator`` subclass).
- ``server``: running it on a loopback port, in the current event loop or in a thread.
- ``semantics``: pure helpers (patches, selectors, printer columns, schema defaults).
- ``resources``: the resource types it serves (built-ins; CRDs register at creation).
- ``fixtures``: the pytest fixtures ``k8s``, ``kubeconfig``, ``kubectl``, ``k8s_client``.

Inside this package, imports are relative: pytest imports it as ``k8s`` (``tests/`` is on
``sys.path`` because ``tests/conftest.py`` is not in a package), mypy as ``tests.k8s``.
"""
