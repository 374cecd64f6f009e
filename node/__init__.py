"""The node application: model, engine, tasks, gossip, intake, store, trainer, sync, runtime and CLI."""
