"""adstream deploy room."""
