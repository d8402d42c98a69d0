"""The Kubernetes API as the operator speaks it: the REST client (`client`) and metav1.Time
(`times`). The bottom layer beside `names`: it imports nothing of the operator but names."""
