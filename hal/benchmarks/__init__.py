"""Benchmarks: each prints ratios measured side by side in one run (the machine is shared and noisy)."""
