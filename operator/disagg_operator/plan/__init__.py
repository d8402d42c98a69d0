"""Pure planning: a parsed spec in, the children's manifests out (StatefulSets, Services,
gateway, PodMonitor, policy objects), no I/O. May import k8s and names only."""
