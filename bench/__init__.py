"""Benchmarks: each prints its numbers next to a peer measured in the same run."""
