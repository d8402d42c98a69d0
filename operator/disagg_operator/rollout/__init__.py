"""Rollouts as pure steps: which unit may roll next (`steps`) and where each unit stands,
read from its StatefulSets (`state`). Beside autoscaling; may import plan, k8s, names."""
