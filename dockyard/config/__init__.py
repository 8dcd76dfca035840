"""Job configuration: one YAML file plus dot overrides, validated into MasterConfig.

    loading.py (YAML, overrides, bounds, messages) ──> master.py: MasterConfig
        sections: policy.py + sampling.py, loss.py, grpo.py, env.py + tools.py + reward_spec.py,
                  data.py, cluster.py, logger.py, checkpointing.py, sft.py, distillation.py
        launch_rules.py: every cross-field rule;  reference.py: docs/configuration.md's tables

Guarantees: a bad value fails at load, before any service starts, with a message that names the
field; every section accepts extra keys (kept, not used). This package imports only the standard
library, pydantic, yaml and omegaconf, never the rest of dockyard, so every layer may import it.
Every public name is re-exported here: `from dockyard.config import X` is the way in.
"""

from dockyard.config.checkpointing import CheckpointingConfig
from dockyard.config.choices import IS_CORRECTIONS, KL_TYPES, REDUCTIONS, SCALES
from dockyard.config.cluster import ClusterConfig
from dockyard.config.data import DataConfig, DatasetConfig, FieldsConfig, SourceConfig
from dockyard.config.distillation import OnPolicyDistillationConfig
from dockyard.config.env import (
    JUDGE_PLACEHOLDERS,
    JUDGE_TEMPLATE,
    MAX_REWARD_TERMS,
    EnvConfig,
    JudgeConfig,
    RewardTerm,
    SandboxLimits,
)
from dockyard.config.grpo import (
    AdvantageConfig,
    AdvantageEstimatorConfig,
    AsyncConfig,
    DynamicSamplingConfig,
    GRPOConfig,
    RewardScalingConfig,
    RewardShapingConfig,
    ToggleConfig,
)
from dockyard.config.launch_rules import ENV_SOURCES, STATE_SCORED_ENVS, config_errors, launch_errors
from dockyard.config.loading import (
    CONFIG_PARSE_SECONDS,
    MAX_CONFIG_BYTES,
    MAX_CONFIG_DEPTH,
    MAX_CONFIG_INT,
    MAX_CONFIG_NODES,
    closest_key,
    load_config,
    load_config_text,
    parse_config,
    parse_config_text,
)
from dockyard.config.logger import (
    LoggerConfig,
    MlflowConfig,
    SignaturesConfig,
    SwanlabConfig,
    TensorboardConfig,
    WandbConfig,
)
from dockyard.config.loss import LossConfig
from dockyard.config.master import MasterConfig
from dockyard.config.policy import LORA_TARGETS, BootstrapConfig, LoraConfig, OptimizerConfig, PolicyConfig
from dockyard.config.reward_spec import BUILTIN_REWARDS
from dockyard.config.sampling import (
    ANTHROPIC_MAX_TEMPERATURE,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MAX_TOP_P,
    MIN_TEMPERATURE,
    MIN_TOP_K,
    OPENAI_MAX_TEMPERATURE,
    TOP_P_ABOVE,
    VLLM_MAX_TEMPERATURE,
    GenerationConfig,
    SamplingConfig,
)
from dockyard.config.section import (
    MAX_BATCH,
    MAX_GROUP,
    MAX_SEED,
    MAX_STEPS,
    MAX_TOKENS,
    ConfigError,
    Section,
)
from dockyard.config.sft import SFTConfig
from dockyard.config.tools import (
    BUILTIN_TOOL_PARAMETERS,
    FILE_CHANGING_TOOLS,
    SCAFFOLD_ENV_NAMES,
    ScaffoldConfig,
    ToolConfig,
    ToolKind,
)

__all__ = [
    "ANTHROPIC_MAX_TEMPERATURE",
    "BUILTIN_REWARDS",
    "BUILTIN_TOOL_PARAMETERS",
    "CONFIG_PARSE_SECONDS",
    "ENV_SOURCES",
    "FILE_CHANGING_TOOLS",
    "IS_CORRECTIONS",
    "JUDGE_PLACEHOLDERS",
    "JUDGE_TEMPLATE",
    "KL_TYPES",
    "LORA_TARGETS",
    "MAX_BATCH",
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_INT",
    "MAX_CONFIG_NODES",
    "MAX_GROUP",
    "MAX_REWARD_TERMS",
    "MAX_SEED",
    "MAX_STEPS",
    "MAX_TEMPERATURE",
    "MAX_TOKENS",
    "MAX_TOP_K",
    "MAX_TOP_P",
    "MIN_TEMPERATURE",
    "MIN_TOP_K",
    "OPENAI_MAX_TEMPERATURE",
    "REDUCTIONS",
    "SCAFFOLD_ENV_NAMES",
    "SCALES",
    "STATE_SCORED_ENVS",
    "TOP_P_ABOVE",
    "VLLM_MAX_TEMPERATURE",
    "AdvantageConfig",
    "AdvantageEstimatorConfig",
    "AsyncConfig",
    "BootstrapConfig",
    "CheckpointingConfig",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "DatasetConfig",
    "DynamicSamplingConfig",
    "EnvConfig",
    "FieldsConfig",
    "GRPOConfig",
    "GenerationConfig",
    "JudgeConfig",
    "LoggerConfig",
    "LoraConfig",
    "LossConfig",
    "MasterConfig",
    "MlflowConfig",
    "OnPolicyDistillationConfig",
    "OptimizerConfig",
    "PolicyConfig",
    "RewardScalingConfig",
    "RewardShapingConfig",
    "RewardTerm",
    "SFTConfig",
    "SamplingConfig",
    "SandboxLimits",
    "ScaffoldConfig",
    "Section",
    "SignaturesConfig",
    "SourceConfig",
    "SwanlabConfig",
    "TensorboardConfig",
    "ToggleConfig",
    "ToolConfig",
    "ToolKind",
    "WandbConfig",
    "closest_key",
    "config_errors",
    "launch_errors",
    "load_config",
    "load_config_text",
    "parse_config",
    "parse_config_text",
]
