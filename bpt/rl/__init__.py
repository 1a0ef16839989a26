"""Offline RL on ExoRL-format dm_control data: collection, reward relabeling and the
sequences the Agentic Transformer trains on (install with the `rl` extra)."""
