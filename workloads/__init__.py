"""adstream workloads room."""
