"""adstream trainers room."""
