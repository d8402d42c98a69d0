"""Benchmarks behind `disagg bench`: ratios against limits measured in the same run."""
