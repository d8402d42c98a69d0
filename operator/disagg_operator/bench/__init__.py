"""`disagg bench operator`: a scale benchmark of the operator against a real API server. The
top layer: it may import every other layer (it drives the operator as a process)."""
