"""The one configuration tree (`tree.py`: a dataclass per section, invariants checked where a
section is built) and its YAML form (`yaml_io.py`). A YAML file in `configs/` maps onto the tree one
to one; `--set section.key=value` on the command line overrides a single key. An unknown key or
a value of the wrong type or range is a `ConfigError` whose message names the key.
"""

from tiered.config.tree import (
    AttentionConfig,
    AttentionKernel,
    CacheConfig,
    ClusterConfig,
    Config,
    ConfigError,
    DType,
    EngineConfig,
    ForwardConfig,
    ForwardMode,
    HostTierConfig,
    LoraConfig,
    ModelConfig,
    OnClose,
    RetentionPolicy,
    SchedulerConfig,
    SchedulerPolicy,
    ServerConfig,
    SuffixPolicy,
    WritePolicy,
)
from tiered.config.yaml_io import config_to_dict, load_config, with_overrides, write_config

__all__ = [
    "ForwardMode",
    "DType",
    "RetentionPolicy",
    "SuffixPolicy",
    "WritePolicy",
    "OnClose",
    "SchedulerPolicy",
    "ConfigError",
    "ModelConfig",
    "ForwardConfig",
    "HostTierConfig",
    "CacheConfig",
    "SchedulerConfig",
    "AttentionConfig",
    "AttentionKernel",
    "EngineConfig",
    "ServerConfig",
    "LoraConfig",
    "ClusterConfig",
    "Config",
    "config_to_dict",
    "load_config",
    "with_overrides",
    "write_config",
]
