"""Reference models to run pipelines on."""

from cutpipe.models.mlp import mlp

__all__ = ["mlp"]
