"""The node application, one subpackage per subsystem of the data flow.

engine (`model/`, drafts from `speculation/`) -> own rollouts -> `swarm/` (gossip) -> peers'
rollouts -> `training/` (intake, journal, trainer) -> `weights/` (engine sync, leader and
followers) -> engine. Each subpackage's `__init__.py` maps its classes to its files and imports
nothing (`tasks/` only its light task families), so `hivespec status` never loads torch or hivemind.

At the top:
- `config.py`: `NodeConfig` and its sections (typed dataclasses with help and validation),
  `load_config`, `ConfigError`, `InputError`.
- `build.py`: the composition root: `build_node`, `open_follower`, `open_bootstrap_peer`, all
  with gossip from `make_gossip(config.swarm, ...)` (`GossipFactory`).
- `runtime.py`: `Node` and its round loop (`run`, `run_round`); the round's steps live in
  `own_rollouts.py` (`make_rollouts`), `exchange.py` (`RoundExchange`: publish and collect),
  `progress.py` (`RoundProgress`) and the subpackages; `report.py`: `RoundReport` and its row.
- `cli.py`: the `hivespec` command; `demo.py`: N local nodes; `doctor.py`: `hivespec doctor`;
  `inputs.py`: swarm inputs checked before anything heavy starts.
- `supervise.py`: `Watchdog`, out-of-memory split-and-retry; `faults.py`: fault points for
  chaos tests; `identity_file.py`: the node's key file; `hub.py`: Hugging Face snapshots.
- `tasks/`: task families, `TaskSource` (prompts, rewards, regenerating a peer's task);
  `status/`: the status board and its HTTP server.
"""
