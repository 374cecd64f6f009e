"""Wire contract between peers and between a node and its dashboard: stdlib, msgpack, cryptography and numpy only."""
