"""Distribution: devices, clusters, strategies, the local cluster."""
