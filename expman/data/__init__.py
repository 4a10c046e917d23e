"""The data stages: prepare (the verifier), generate (its own responses), extract (hidden-state shards), vocab."""
