"""status."""
