"""Load tests and side-by-side benchmarks.

Every benchmark here starts its own servers on free loopback ports, measures
them with the same clients in the same run, and prints ratios against a
reference (Redis, memcpy) rather than absolute figures alone: this host is
shared and noisy, and a ratio measured in one run survives that noise better.
"""
