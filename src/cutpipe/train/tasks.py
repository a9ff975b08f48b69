"""What a run trains: a model, its loss, its batches and how it is cut into stages by default.

The trainer is the same for every model; what differs is here. A ``LanguageModelTask`` trains a
transformer (a cutpipe model file or a Hugging Face ``config.json``) on text, next-token cross
entropy, its stages balanced by the planner's cost model. A ``RegressionTask`` trains the
example MLP (``--model mlp`` or a file with ``family: mlp``) to imitate a teacher of its own
shape on synthetic data, its blocks shared out evenly: a quick look at a schedule running.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from cutpipe.model_config import load_training_model
from cutpipe.models.router import RoutingOptions
from cutpipe.schedule.schedule import Schedule
from cutpipe.spec import MlpSpec, ModelSpec, spec_differences

if TYPE_CHECKING:
    import torch
    from torch import nn

    from cutpipe.data.tokens import Tokens
    from cutpipe.train.options import TrainOptions


class Loader(Protocol):
    """Endless ``(inputs, targets)`` batches whose position a checkpoint keeps."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...
    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Task(Protocol):
    """What the trainer needs to know about the model it trains."""

    name: str
    #: samples per microbatch (sequences, or rows of the regression)
    microbatch_size: int
    #: what one sample counts for in the throughput: its tokens (the sequence length), or 1
    tokens_per_sample: int
    #: how the summary names the loss
    loss_words: str
    #: routed experts (the trainer reads their routing after each step)
    is_moe: bool

    def num_blocks(self) -> int:
        """The blocks the model runs one after another (what stages are cut from)."""
        ...

    def num_parameters(self) -> int:
        """The whole model's parameters (what every rank builds before cutting its stages)."""
        ...

    def default_sizes(self, schedule: Schedule) -> list[int]:
        """Blocks per stage when no plan gives them."""
        ...

    def build(self, seed: int, blocks: Collection[int] | None = None) -> nn.Module:
        """The model from ``seed``, its ``blocks`` (by position; default all) built with the
        values the whole model holds; a model may leave the others unallocated (meta)."""
        ...

    def loss(self) -> nn.Module: ...

    def recompute_unit(self) -> type[nn.Module] | None:
        """The module class recompute wraps (None: each block of a stage)."""
        ...

    def check_experts(self, ep: int) -> None:
        """Refuse an expert-parallel size the model cannot take (one line)."""
        ...

    def stage_maker(self, overlap: bool) -> Callable[[nn.Module, Sequence[str]], nn.Module]:
        """What builds a stage from the model and its blocks' names (``cut_module``)."""
        ...

    def loader(self, batch: int, seed: int) -> Loader: ...

    def validation(self) -> Tokens | None:
        """The held-out tokens of ``--val-data`` or ``--val-fraction`` (None: no validation
        set), once ``loader`` has read the training tokens."""
        ...

    def baseline(self) -> float | None:
        """A loss to read the run's against (a context-free model's), once the data is loaded."""
        ...


def task_for(options: TrainOptions) -> Task:
    """The task of ``options.model`` (its sequence length overridden by ``--seq-len``); with
    ``--init-from DIR`` and no ``--model``, the folder's own config."""
    model = options.model
    if options.init_from and model == "mlp":
        model = options.init_from
    spec = load_training_model(model, seq_len=options.seq_len)
    if options.init_from:
        _check_weights(spec, options.init_from, options.seq_len)
    if isinstance(spec, MlpSpec):
        if options.validates:
            raise ValueError(
                f"--model {options.model} is the example MLP, which trains on fresh synthetic "
                "batches every step (its training loss is already on unseen samples): drop "
                "--val-data/--val-fraction, or train a language model (--model FILE)"
            )
        if options.data or options.tokenizer:
            raise ValueError(
                f"--model {options.model} is the example MLP on synthetic data: drop --data and "
                "--tokenizer, or train a language model (--model FILE)"
            )
        return RegressionTask(spec)
    steering = options.routing_bias_rate > 0 or options.capacity_factor is not None
    if steering and not spec.moe:
        raise ValueError(
            f"--routing-bias-rate and --capacity-factor steer an MoE's routing; {spec.name} has "
            "no experts: drop them"
        )
    routing = RoutingOptions(options.capacity_factor, bias=options.routing_bias_rate > 0)
    held_out = {"val_data": options.val_data, "val_fraction": options.val_fraction}
    return LanguageModelTask(
        spec, options.data, options.aux_weight, routing, tokenizer=options.tokenizer, **held_out
    )


def _check_weights(spec: ModelSpec | MlpSpec, folder: str, seq_len: int | None) -> None:
    """``--init-from`` names a Hugging Face folder of this model's weights (one line if not)."""
    from cutpipe.model_config import load_model_config

    if isinstance(spec, MlpSpec):
        raise ValueError("--init-from loads a language model's weights: give --model FILE too")
    theirs = load_model_config(folder, seq_len=seq_len or spec.seq_len)
    differ = spec_differences(spec, theirs, ignore=("name", "microbatch_size", "dtype"))
    if differ:
        raise ValueError(
            f"--init-from {folder} holds another model than --model: {'; '.join(differ[:4])}"
        )
    from cutpipe.models.hf import weight_files

    weight_files(folder)  # the weights are there


@dataclass
class LanguageModelTask:
    """A decoder-only transformer on text: next-token cross entropy (plus the MoE balance)."""

    spec: ModelSpec
    data: tuple[str, ...] = ()
    aux_weight: float = 0.01
    routing: RoutingOptions | None = None  # an MoE's capacity and balancing bias
    tokenizer: str | None = None  # --tokenizer: a tokenizer.json, or a folder holding one
    #: the validation set: other data, or the last share of ``data`` (which training then skips)
    val_data: tuple[str, ...] = ()
    val_fraction: float | None = None
    loss_words = "nats/token"

    def __post_init__(self) -> None:
        self.name = self.spec.name
        self.is_moe = self.spec.moe
        self.microbatch_size = self.spec.microbatch_size
        self.tokens_per_sample = self.spec.seq_len
        self._entropy: float | None = None
        #: the digest of the tokenizer the data was made by (``BYTES`` for bytes), once loaded
        self.data_tokenizer: str | None = None
        self._held_out: Tokens | None = None

    def num_blocks(self) -> int:
        return self.spec.layers + 2  # the embedding, the layers, the head

    def num_parameters(self) -> int:
        from cutpipe.plan.costs.model import gpu, model_items

        return int(sum(item.parameters for item in model_items(self.spec, gpu("H100"))))

    def default_sizes(self, schedule: Schedule) -> list[int]:
        """The planner's balanced partition, priced on a nominal GPU: only the ratios of the
        blocks' costs matter, and they depend on the model, not the machine."""
        from cutpipe.plan.costs.model import gpu, model_items, p2p_time, w_memory
        from cutpipe.plan.partition import balance

        hardware = gpu("H100")
        items = model_items(self.spec, hardware)
        if len(items) < schedule.num_stages:
            raise ValueError(
                f"{self.name} has {self.spec.layers} layers plus embedding and head, "
                f"{len(items)} blocks, too few for the {schedule.num_stages} stages of "
                f"{schedule.name}: use a model with more layers or fewer ranks"
            )
        comm = p2p_time(self.spec, hardware, within_node=True)
        return balance(schedule, items, comm, w_memory(self.spec)).sizes

    def build(self, seed: int, blocks: Collection[int] | None = None) -> nn.Module:
        from cutpipe.models.transformer import language_model

        names = ["embed", *(f"layers.{i}" for i in range(self.spec.layers)), "head"]
        wanted = None if blocks is None else [names[i] for i in blocks]
        return language_model(self.spec, seed=seed, routing=self.routing, blocks=wanted)

    def loss(self) -> nn.Module:
        from cutpipe.models.transformer import LanguageModelLoss

        return LanguageModelLoss(self.aux_weight)

    def recompute_unit(self) -> type[nn.Module] | None:
        from cutpipe.models.transformer import Layer

        return Layer

    def check_experts(self, ep: int) -> None:
        from cutpipe.parallel.mesh import check_experts

        check_experts(self.spec.experts, ep, self.spec.top_k if self.spec.moe else None)

    def stage_maker(self, overlap: bool) -> Callable[[nn.Module, Sequence[str]], nn.Module]:
        """An MoE model's stages run as phases around their all-to-alls, so that an overlapped
        F&B pair can hide one half's exchanges behind the other's compute (the overlap hook,
        off with ``overlap=False``); a dense model's are plain stages."""
        from cutpipe.runtime.stages import Stage

        if not self.spec.moe:
            return Stage
        from cutpipe.parallel.moe_stage import MoEStage

        def make(model: nn.Module, blocks: Sequence[str]) -> nn.Module:
            return MoEStage(model, blocks, overlap=overlap)

        return make

    def loader(self, batch: int, seed: int) -> Loader:
        from cutpipe.data import TokenLoader, check_vocab, load_tokens, unigram_entropy

        tokens = load_tokens(self.data, tokenizer=self.tokenizer)
        check_vocab(self.spec.vocab, tokens.vocab, tokens.tokenizer, tokens.source)
        self.data_tokenizer = tokens.tokenizer
        if self.val_fraction is not None:  # training never reads the held-out tokens
            tokens, self._held_out = tokens.split(self.val_fraction)
        elif self.val_data:
            self._held_out = load_tokens(self.val_data, tokenizer=self.tokenizer)
            held = self._held_out
            check_vocab(self.spec.vocab, held.vocab, held.tokenizer, held.source)
            if held.tokenizer != tokens.tokenizer:
                raise ValueError(
                    f"--val-data {held.source} was made by another tokenizer than --data "
                    f"{tokens.source} ({held.tokenizer[:12]} vs {tokens.tokenizer[:12]}): prepare "
                    "both with the same one"
                )
        self._entropy = unigram_entropy(tokens)
        return TokenLoader(tokens, self.spec.seq_len, batch, seed=seed)

    def validation(self) -> Tokens | None:
        return self._held_out

    def baseline(self) -> float | None:
        return self._entropy


@dataclass
class RegressionTask:
    """The example MLP imitating a teacher MLP: mean squared error on synthetic batches."""

    spec: MlpSpec
    tokens_per_sample = 1
    loss_words = "mean squared error"
    is_moe = False

    def __post_init__(self) -> None:
        self.name = self.spec.name
        self.microbatch_size = self.spec.microbatch_size

    def num_blocks(self) -> int:
        return self.spec.blocks

    def num_parameters(self) -> int:
        return self.spec.blocks * (self.spec.width + 1) * self.spec.width

    def default_sizes(self, schedule: Schedule) -> list[int]:
        from cutpipe.runtime.stages import even_split

        return even_split(self.spec.blocks, schedule.num_stages, "blocks")

    def build(self, seed: int, blocks: Collection[int] | None = None) -> nn.Module:
        from cutpipe.models.mlp import mlp  # small: built whole

        return mlp(self.spec.blocks, self.spec.width, seed=seed)

    def loss(self) -> nn.Module:
        from torch import nn

        return nn.MSELoss()

    def recompute_unit(self) -> type[nn.Module] | None:
        return None

    def check_experts(self, ep: int) -> None:
        if ep > 1:
            raise ValueError(f"--model {self.name} (the example MLP) has no experts: drop --ep")

    def stage_maker(self, overlap: bool) -> Callable[[nn.Module, Sequence[str]], nn.Module]:
        from cutpipe.runtime.stages import Stage

        return Stage

    def loader(self, batch: int, seed: int) -> Loader:
        """Batches labelled by a teacher of the model's own shape, with weights of another seed."""
        from cutpipe.data.loader import epoch_seed
        from cutpipe.data.synthetic import RegressionLoader
        from cutpipe.models.mlp import mlp

        teacher = mlp(self.spec.blocks, self.spec.width, seed=epoch_seed(seed, -1))
        return RegressionLoader(self.spec.width, batch, seed, teacher)

    def validation(self) -> Tokens | None:
        return None  # refused in task_for: every batch is new

    def baseline(self) -> float | None:
        return None
