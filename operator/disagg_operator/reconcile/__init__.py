"""Reconciling one pipeline: read what the cluster holds (watch cache), plan, apply and prune
the children, write the status, count it in metrics. May import autoscaling, rollout, plan,
k8s and names; never app (kopf's handlers call in, not the reverse)."""
