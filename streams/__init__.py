"""adstream streams room."""
