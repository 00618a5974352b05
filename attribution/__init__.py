"""adstream attribution room."""
