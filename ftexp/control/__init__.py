"""The control plane for chaos soak tests: a K8s-flavoured HTTP API over the training cells, a
per-cell health checker and a mini controller that heals unhealthy cells."""
