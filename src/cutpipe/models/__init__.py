"""Reference models to run pipelines on."""

from cutpipe.models.mlp import mlp
from cutpipe.models.transformer import LanguageModelLoss, language_model

__all__ = ["LanguageModelLoss", "language_model", "mlp"]
