"""Pure tensor functions (no I/O, no config): each a torch reference that runs on CPU."""
