"""Models to run pipelines on: the example MLP and a decoder-only transformer (dense or MoE)."""

from cutpipe.model_config import load_model_config
from cutpipe.models.mlp import mlp
from cutpipe.models.router import RoutingOptions
from cutpipe.models.transformer import LanguageModel, LanguageModelLoss, language_model

__all__ = [
    "LanguageModel",
    "LanguageModelLoss",
    "RoutingOptions",
    "language_model",
    "load_model_config",
    "mlp",
]
