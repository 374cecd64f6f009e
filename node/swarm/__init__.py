"""The swarm: everything that talks to hivemind (p2pd, the DHT) lives here, nothing else in hivespec does.

The rest of the node sees `Gossip` (rollouts: publish a batch and sample peers' fresh ones by
recency; weight topics: publish a body under a topic and slot, fetch or wait for others'), never
a hivemind type; import-linter holds that line (`pyproject.toml`). Only
`hivespec doctor`'s network checks import hivemind outside this package, on purpose.

- `gossip.py`: `Gossip` (hivemind `P2P` + `DHTNode` on a private event-loop thread, built from
  the `swarm` section: start, status, shutdown, and the thread-safe calls), `Fetched`, `GossipError`.
- `rollouts.py`: `RolloutGossip` (our batches announced by recency and kept findable, peers'
  sampled and relayed).
- `slots.py`: `SlotGossip` (the weight topics, one key per topic and slot).
- `machinery.py`: `Machinery` (what those two share: records, body store, fetcher, counters).
- `records.py`: `IndexRecords` (our signed index record under a key, everyone's read back and
  checked), `Holder`.
- `bodies.py`: `BodyStore` (the bodies we serve, bounded by age and bytes, and their stream handler).
- `fetching.py`: `Fetcher` (a claim's body from one of its holders: size and sha256 checked,
  liars scored down), `Fetched`.
- `index.py`: the rollout index by recency (time buckets, a tree of bounded keys, choosing K
  fresh batches by peer score with exploration); pure functions.
- `transfer.py`: the body stream "hivespec.rollouts.v1" (request by sha256; the length and the
  hash are checked against the announced ones), `BadBody`.
- `dht_guard.py`: `AnnounceValidator` (a hivemind `RecordValidatorBase` for our index records)
  and `harden` (size and shape checks on hivemind's own DHT requests and replies).
- `bootstrap.py`: where to join from (`bootstrap_candidates`: config, env, peers file,
  `PeerCache`), `Joiner`, `HomeLock` / `IdentityInUse` (one process per home).
- `private_files.py`: a private swarm's allowlist and secret (`load_private_swarm`) and whether the allowlist
  leaves a process anything to do (`check_member`); no hivemind, so the doctor reads them offline.
- `p2pd.py`: `start_p2pd` (p2pd in a session of its own, its sockets in a directory of ours,
  stale ones swept; static relays behind NAT).
- `nat.py`: behind NAT: relay and circuit addresses, `ReachService` / `check_reachability`
  (peers measure our reachability).
- `clock.py`: `ClockCheck` (our clock against our peers', asked after each (re)join).
- `ports.py`: `port_in_use`, `wait_for_port` (a fixed `swarm.port` another process listens on,
  asked before p2pd starts: p2pd would share it silently), `PortClaim` (the port number claimed
  machine-wide from that question until p2pd listens: two nodes starting at once).
- `peers.py`: `PeerScores` (gossipsub v1.1-style scores, saved in the home).
- `supervisor.py`: `GossipSupervisor` (probes the gossip each round, rebuilds a dead one with
  `Backoff`).

`node/build.py` builds every process's gossip the same way (`make_gossip`).
"""
