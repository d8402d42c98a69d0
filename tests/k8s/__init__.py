"""A Kubernetes API server emulator for tests: kmock plus the fixes this project needs.

- ``emulator``: the request handler (``KubeEmulator``, a ``kmock.KubernetesEmulator`` subclass).
- ``server``: running it on a loopback port, in the current event loop or in a thread.
- ``semantics``: pure helpers (patches, selectors, printer columns, schema defaults).
- ``resources``: the resource types it serves (built-ins; CRDs register at creation).
- ``fixtures``: the pytest fixtures ``k8s``, ``kubeconfig``, ``kubectl``, ``k8s_client``.

It is ``tests.k8s`` (``tests`` is a package): ``tests/conftest.py`` registers the fixtures
with ``pytest_plugins = ["tests.k8s.fixtures"]``; inside, imports are relative.
"""
