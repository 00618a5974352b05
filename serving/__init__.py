"""adstream serving room."""
