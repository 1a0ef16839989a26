"""bpt: the Blockwise Parallel Transformer in JAX/Flax."""

__version__ = "0.1.0"
