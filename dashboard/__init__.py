"""Terminal dashboard of swarm health (Textual); reads status snapshots, never imports torch or node."""
