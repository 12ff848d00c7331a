"""`ClusterUp` (kept in loadtest/, which the benchmarks share with the tests)."""
from loadtest.cluster_up import ClusterUp  # noqa: F401
