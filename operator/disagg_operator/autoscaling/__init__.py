"""The autoscaler's pure parts: readings of pods' load, the decision per unit, and the
scrape of pod metrics. Beside rollout (neither imports the other); may import plan, k8s, names."""
