"""The operator process: kopf handlers, the autoscaler's loop, flags, the liveness probe and
`main` (what `disagg operator` runs). The top layer: it may import every layer below
(reconcile, autoscaling, rollout, plan, k8s, names) and nothing imports it but bench."""
