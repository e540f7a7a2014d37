"""The trainer's configuration: one TOML file of sections, each field
overridable from the command line as ``--section.field=value``.

Every field has a default (the dataclasses below), so a file names only
what it changes. An unknown section or field, or a value of the wrong
type, is an error naming it: a typo must not train with a default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, get_type_hints

import tomllib


@dataclass
class ModelConfig:
    # llama | deepseek_v3 (a small built-in config), a Hugging Face
    # checkpoint directory (its weights), or a config.json (fresh weights).
    name: str = "llama"
    # Fields over the config named above (hidden_size, num_hidden_layers, ...).
    config: dict = field(default_factory=dict)
    # The parameters' dtype: float32 | float64 | bfloat16 (pure bf16); by
    # default a checkpoint's own, float32 for fresh weights.
    dtype: str = ""
    # none | bf16: compute in bf16 over float32 master weights.
    mixed_precision: str = "none"
    # DeepSeek-V3: how far each step moves a router's correction bias
    # towards the mean expert load (the paper's 0.001; 0 keeps it as loaded).
    expert_bias_update_rate: float = 1e-3
    # DeepSeek-V3: the sequence-wise balance loss's weight (the paper's
    # alpha, 0.0001; 0: off).
    balance_loss_weight: float = 1e-4
    # DeepSeek-V3: multi-token-prediction depth (-1: as many MTP layers as
    # the checkpoint holds, none for fresh weights; 0: none) and its loss
    # weight (the paper's lambda).
    mtp_depth: int = -1
    mtp_loss_weight: float = 0.3


@dataclass
class ParallelConfig:
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    # The expert-parallel group spans the tensor-parallel ranks (expert a
    # multiple of tensor): no routed expert replicated over tp.
    experts_over_tp: bool = False
    context: int = 1  # data parallel is what is left of the world
    cp_mode: str = "ring"  # ring | ulysses
    sequence_parallel: bool = False
    zero_stage: int = 0  # 0, 1 (optimizer state sharded) or 2 (and gradients)
    fsdp: bool = False  # torch's fully_shard (FSDP2) instead of our DDP
    # gpipe | 1f1b | interleaved_1f1b | zb1p | zbv | dualpipev
    schedule: str = "1f1b"
    stages_per_rank: int = 0  # 0: the schedule's own (2 for interleaved_1f1b, zbv, dualpipev)
    micro_batches: int = 1  # per step under a pipeline
    recompute: bool = False  # each layer's activations recomputed in backward


@dataclass
class DataConfig:
    train: list = field(default_factory=list)  # file patterns: .txt, .jsonl, .parquet
    eval: list = field(default_factory=list)
    text_field: str = "text"  # of .jsonl and .parquet rows
    txt_sample_by: str = "document"  # a .txt file is one document, or one per paragraph/line
    # A directory with tokenizer.json; by default the model's checkpoint directory.
    tokenizer: str = ""
    seq_len: int = 256
    global_batch: int = 8  # sequences per step, over every data-parallel rank
    streaming: bool = False  # read files as they are consumed (large corpora)
    add_bos: bool = False  # a beginning-of-text token before each document


@dataclass
class OptimConfig:
    name: str = "AdamW"  # any torch.optim optimizer
    lr: float = 3e-4
    weight_decay: float = 0.1  # not on norms, biases and embeddings
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 0
    decay: str = "cosine"  # cosine | linear | constant | wsd
    min_lr_ratio: float = 0.1  # the last step's learning rate over lr
    wsd_decay_ratio: float = 0.2  # under wsd: the share of the steps that decays
    grad_clip: float = 1.0  # the whole model's gradient norm; 0: no clipping


@dataclass
class TrainConfig:
    steps: int = 100
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0  # 0: only at the end (when there is eval data)
    eval_steps: int = 10


@dataclass
class CheckpointConfig:
    dir: str = ""  # step-N folders; empty: no checkpoints
    every: int = 0  # steps between checkpoints; 0: only at the end
    keep: int = 2  # the last K kept; 0: all
    # Write in the background while training goes on (the state is copied
    # first, so the step after the call changes nothing written).
    async_save: bool = False
    resume: str = "auto"  # auto (latest complete checkpoint in dir) | a path | none
    export_hf: str = ""  # a Hugging Face checkpoint written at the end


@dataclass
class MetricsConfig:
    jsonl: str = ""  # one JSON object per logged step and per evaluation
    tensorboard: str = ""  # a directory for torch.utils.tensorboard
    progress: bool = True  # a line per logged step on rank 0
    plot: str = ""  # a PNG of the loss curves, written at the end
    # FLOP/s of one process for MFU; 0: measured at start (a matmul).
    peak_flops: float = 0.0


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The whole configuration, every field, as TOML (what a run prints
        at start, and what reproduces it)."""
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items())
            lines.append("")
        return "\n".join(lines)


# TOML's name for the field Python cannot call ``async``.
_ALIASES = {("checkpoint", "async"): "async_save"}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def _coerce(where: str, kind: type, value: Any) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is list and isinstance(value, str):  # one pattern given alone
        return [value]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{where}: expected {kind.__name__}, got {value!r}")
    return value


def from_dict(values: dict) -> JobConfig:
    """A JobConfig from nested sections (a parsed TOML file)."""
    job = JobConfig()
    for section, fields in values.items():
        if not hasattr(job, section) or not isinstance(fields, dict):
            known = ", ".join(f.name for f in dataclasses.fields(JobConfig))
            raise ValueError(f"config: unknown section [{section}] (sections: {known})")
        target = getattr(job, section)
        hints = get_type_hints(type(target))
        for key, value in fields.items():
            name = _ALIASES.get((section, key), key)
            if name not in hints:
                known = ", ".join(f.name for f in dataclasses.fields(target))
                raise ValueError(f"config: [{section}] has no field {key!r} (fields: {known})")
            setattr(target, name, _coerce(f"[{section}] {key}", hints[name], value))
    return job


def _parse_override(text: str) -> tuple[list[str], Any]:
    if not text.startswith("--") or "=" not in text:
        raise ValueError(f"override {text!r}: expected --section.field=value")
    key, raw = text[2:].split("=", 1)
    path = key.replace("-", "_").split(".")
    if len(path) < 2:
        raise ValueError(f"override {text!r}: expected --section.field=value")
    try:  # a TOML value (numbers, booleans, lists, quoted strings) ...
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:  # ... or a bare string
        value = raw
    return path, value


def load(path: str | None, overrides: list[str] = ()) -> JobConfig:
    """The configuration in the TOML file ``path`` (None: the defaults)
    with ``overrides`` (``--section.field=value``; ``--model.config.hidden_size=64``
    reaches into a table) applied in order."""
    values: dict = {}
    if path:
        with open(path, "rb") as f:
            try:
                values = tomllib.load(f)
            except tomllib.TOMLDecodeError as e:
                raise ValueError(f"config {path}: {e}") from None
    for text in overrides:
        keys, value = _parse_override(text)
        node = values
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {text!r}: {k} is not a table")
        node[keys[-1]] = value
    return from_dict(values)
