"""FLASH tiny: configs/tiny.py's run with 4 Gated Attention Units (twice its layers, about its
parameters), mixed chunk attention in chunks of 64, the FLASH paper's LM recipe (FLASHConfig's
defaults); 60 steps take about a minute on a CPU."""

from pathlib import Path

from bpt.config import load_config_file, set_family


def get_config():
    c = load_config_file(Path(__file__).with_name("tiny.py"))
    set_family(c, "flash")  # tiny.py's GPT settings (heads, chunk sizes) unset
    c.model.num_layers = 4
    c.model.chunk_size = 64
    c.model.qk_dim = 64
    return c
