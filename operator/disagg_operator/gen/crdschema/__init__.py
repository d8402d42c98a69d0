"""A CustomResourceDefinition's schema as the Kubernetes API server treats it: its field errors
in the server's wording (`errors`), the values a schema admits, prunes and defaults
(`values`), CEL rules compiled, costed and evaluated (`cel`), and the rules a CRD's schema
must follow to be accepted (`structural`: what `make verify` checks the generated CRD for).

The product's check of its own CRD and the test emulator's admission of custom resources
(tests/k8s) share it, so both say what the real server says.
"""
