"""Reference models to run pipelines on."""

from cutpipe.model_config import load_model_config
from cutpipe.models.expert_parallel import ExpertParallel, expert_parameters, shard_experts
from cutpipe.models.mlp import mlp
from cutpipe.models.moe_stage import MoEStage, moe_stages
from cutpipe.models.transformer import LanguageModel, LanguageModelLoss, language_model

__all__ = [
    "ExpertParallel",
    "LanguageModel",
    "LanguageModelLoss",
    "MoEStage",
    "expert_parameters",
    "language_model",
    "load_model_config",
    "mlp",
    "moe_stages",
    "shard_experts",
]
