"""The configuration: every run's settings, their checks, presets and config files.

- bpt.config.schema: the tree and its defaults (base_config; every setting with its comment);
- bpt.config.checks: check_config, check_mesh and model_config (the family's dataclass);
- bpt.config.presets: the default run, paper_config, flash_config, agentic_config;
- bpt.config.loader: load_config_file, override and the unknown-key check.

This package is itself a config file (it has get_config()): bpt-train uses it when no --config
is given. Config files in configs/ call base_config() or a preset and override a few fields.
"""

from bpt.config.checks import (
    STATE_DTYPES,
    check_config,
    check_mesh,
    check_state_dtype,
    model_config,
)
from bpt.config.loader import check_keys, config_keys, load_config_file, override, switch_family
from bpt.config.presets import (
    BASELINES,
    FLASH_RECIPES,
    UNROLLED_SIZES,
    agentic_config,
    flash_config,
    get_config,
    matched_depth,
    paper_config,
)
from bpt.config.schema import (
    ADDED_SETTINGS,
    DATASETS,
    FROM_DATA,
    MODEL_SIZES,
    RANGES,
    base_config,
    data_section,
    family_fields,
    init_section,
    mesh_section,
    model_section,
    set_family,
    train_section,
)

__all__ = [
    "BASELINES",
    "FLASH_RECIPES",
    "ADDED_SETTINGS",
    "DATASETS",
    "FROM_DATA",
    "MODEL_SIZES",
    "RANGES",
    "STATE_DTYPES",
    "UNROLLED_SIZES",
    "agentic_config",
    "base_config",
    "check_config",
    "check_keys",
    "check_mesh",
    "check_state_dtype",
    "config_keys",
    "data_section",
    "family_fields",
    "flash_config",
    "get_config",
    "init_section",
    "load_config_file",
    "matched_depth",
    "mesh_section",
    "model_config",
    "model_section",
    "override",
    "paper_config",
    "set_family",
    "switch_family",
    "train_section",
]
