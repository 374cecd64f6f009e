"""What a running node shows and who may steer it: the status snapshot, its HTTP server, pause and stop.

- `board.py`: `StatusBoard` (builds `protocol.status.StatusSnapshot`s on demand from what the
  loop reported), `RunControl` (pause, resume, stop at a safe point; `RoundStopped`),
  `LogBuffer` (recent warnings for the snapshot).
- `server.py`: `StatusServer` (loopback HTTP: `/status`, `/metrics`, `/control`),
  `write_status_file` / `read_status_url` (how `hivespec status` finds a local node).
"""
