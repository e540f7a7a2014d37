"""Hugging Face checkpoints in and out of a model split any way.

``from_pretrained`` builds the model for this rank's place in the layout
and fills each parameter from its own blocks of the safetensors files
(``safe_open(...).get_slice``): a rank reads its shard, never a whole
tensor it does not keep. ``save_pretrained`` cuts every parameter back
into blocks of checkpoint tensors, gathers each pipeline stage's blocks
on that stage's first rank, which writes them as one file, and writes the
index and ``config.json`` on rank 0. Replicated blocks (data-parallel
copies, norms every tensor-parallel rank holds, key/value heads
replicated for grouped-query attention) arrive several times with equal
values; each element of every tensor must arrive at least once.
"""

from __future__ import annotations

import contextlib
import json
import os
import re

import torch
import torch.distributed as dist

from . import fp8
from .agreement import raise_if_any_failed
from .hf_map import Piece

INDEX = "model.safetensors.index.json"
PARTIAL = ".partial"  # a file being written
SINGLE = "model.safetensors"


def model_classes() -> dict:
    from .deepseek_v3 import DeepseekV3
    from .gpt2 import GPT2
    from .llama import Llama

    return {cls.model_type: cls for cls in (Llama, DeepseekV3, GPT2)}


def from_pretrained(path: str, state=None, dtype: torch.dtype | None = None, **kwargs):
    """This rank's part of the model in the checkpoint directory ``path``
    (``config.json`` and one or several ``*.safetensors`` with their
    index), in ``dtype`` (by default the checkpoint's; float32 masters
    with ``mixed_precision=dsparallel.MixedPrecision()``). ``kwargs`` go to
    the model (``checkpoint=True`` recomputes activations)."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"from_pretrained: {config_file} does not exist")
    with open(config_file) as f:
        config = json.load(f)
    # A block-quantized fp8 checkpoint loads dequantized: the model it makes
    # is not quantized, and its saved config must not say it is.
    block = fp8.block_size(config, path)
    config.pop("quantization_config", None)
    cls = model_class(config, f"from_pretrained: {path}")
    weight_map = _weight_map(path)
    missing = sorted({f for f in weight_map.values() if not os.path.isfile(os.path.join(path, f))})
    if missing:
        raise FileNotFoundError(
            f"from_pretrained: the checkpoint in {path} lacks the shard file(s) "
            f"{', '.join(missing)} that its index names"
        )
    if kwargs.get("mixed_precision") is not None:
        dtype = dtype or torch.float32  # the masters; the policy casts for compute
    elif dtype is None:
        dtype = getattr(torch, config_dtype(config))
    kwargs = {**cls.checkpoint_options(config, weight_map), **kwargs}
    model = cls(config, state, dtype=dtype, _initialize=False, **kwargs)
    reader = _Reader(path, weight_map, block)
    try:
        used, error = model.load_hf(reader.read) | reader.scales_read, None
    except Exception as e:  # a corrupt file too (safetensors' error): every rank learns of it
        used, error = set(), e
    _agree(model, weight_map, used, error, path)
    return model


def model_class(config: dict, where: str):
    """The ``dsparallel.models`` class of ``config``'s ``model_type``; a
    ValueError beginning with ``where`` when there is none."""
    classes = model_classes()
    kind = config.get("model_type")
    if kind not in classes:
        raise ValueError(
            f"{where} holds a {kind!r} model ({config.get('architectures')}); "
            f"dsparallel.models loads {', '.join(sorted(classes))}"
        )
    return classes[kind]


def config_dtype(config: dict) -> str:
    """The dtype a config says its tensors are stored in (float32 when it
    does not say)."""
    return config.get("dtype") or config.get("torch_dtype") or "float32"


def _weight_map(path: str) -> dict[str, str]:
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return json.load(f)["weight_map"]
    single = os.path.join(path, SINGLE)
    if not os.path.isfile(single):
        raise FileNotFoundError(f"from_pretrained: {path} has neither {INDEX} nor {SINGLE}")
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return dict.fromkeys(f.keys(), SINGLE)


class _Reader:
    """Blocks of checkpoint tensors, each read through its slice; fp8
    blocks dequantized with the scales of ``block`` (``fp8.py``)."""

    def __init__(self, path: str, weight_map: dict[str, str], block=None):
        self.path, self.weight_map, self.block, self.files = path, weight_map, block, {}
        self.scales_read: set[str] = set()

    def _file(self, key: str):
        name = self.weight_map.get(key)
        if name is None:
            raise KeyError(f"from_pretrained: the checkpoint in {self.path} lacks {key}")
        if name not in self.files:
            from safetensors import safe_open

            self.files[name] = safe_open(os.path.join(self.path, name), "pt")
        return self.files[name]

    def read(self, piece: Piece) -> torch.Tensor:
        f = self._file(piece.key)
        sl = f.get_slice(piece.key)
        shape = tuple(sl.get_shape())
        if shape != piece.shape:
            raise ValueError(
                f"from_pretrained: {piece.key} has shape {shape} in the checkpoint, the config "
                f"gives {piece.shape}"
            )
        end = piece.start + piece.length
        if piece.dim is None:
            block = f.get_tensor(piece.key)
        else:
            block = sl[piece.start : end] if piece.dim == 0 else sl[:, piece.start : end]
        if block.dtype not in fp8.FP8:
            return block
        scale_key = piece.key + fp8.SCALE_SUFFIX
        if self.block is None or scale_key not in self.weight_map:
            why = (
                "the config has no quantization_config"
                if self.block is None
                else f"the checkpoint lacks {scale_key}"
            )
            raise ValueError(
                f"from_pretrained: {piece.key} is {block.dtype}, but {why}: its scales are unknown"
            )
        self.scales_read.add(scale_key)
        return fp8.dequantize(block, piece, self._file(scale_key).get_slice(scale_key), self.block)


def _agree(model, weight_map, used, error, path) -> None:
    """Every rank learns whether any rank failed to read its part (a
    tensor only another stage reads can be the bad one), and whether every
    checkpoint tensor was read by some rank, except the layers past
    ``num_hidden_layers`` (DeepSeek-V3's multi-token-prediction layers
    when the model is built without them, as ``transformers`` drops them,
    and the copies of the embedding and LM head they hold); each raises
    the same error."""
    raise_if_any_failed(error, "from_pretrained")
    everyone = [used]
    if model.layout.mesh is not None:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, used)
    read = set().union(*everyone)
    layers = model.config.num_hidden_layers
    extra = sorted(
        k
        for k in weight_map
        if k not in read
        and not ((m := re.match(r"model\.layers\.(\d+)\.", k)) and int(m.group(1)) >= layers)
    )
    if extra:
        raise ValueError(
            f"from_pretrained: {len(extra)} tensor(s) of {path} have no place in "
            f"{type(model).__name__}: {', '.join(extra[:5])}"
        )


def _assemble(block_lists) -> dict[str, torch.Tensor]:
    full, covered = {}, {}
    for blocks in block_lists:
        for piece, block in blocks:
            if piece.key not in full:
                full[piece.key] = torch.empty(piece.shape, dtype=block.dtype)
                covered[piece.key] = torch.zeros(piece.shape, dtype=torch.bool)
            full[piece.key][piece.index()] = block
            covered[piece.key][piece.index()] = True
    for key, seen in covered.items():
        if not bool(seen.all()):
            raise RuntimeError(f"save_pretrained: no rank holds part of {key} (a mapping bug)")
    return full


def gather_full(model, grads: bool = False) -> dict[str, torch.Tensor]:
    blocks = model.hf_blocks(grads)
    if model.layout.mesh is None:
        return _assemble([blocks])
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, blocks)
    return _assemble(everyone)


def save_pretrained(model, path: str) -> None:
    """Every file is written under a temporary name (``.partial``) and takes
    its own once every rank has written its part: a rank that fails (a full
    disk) makes every rank raise the same error, and leaves the files of a
    previous checkpoint in ``path`` as they were. Other files in ``path``
    (a tokenizer) are kept."""
    from safetensors.torch import save_file

    lay = model.layout
    blocks = model.hf_blocks()
    file = f"model-{lay.pp_rank + 1:05d}-of-{lay.pp_size:05d}.safetensors"
    one_process = lay.mesh is None
    if one_process:
        stage_blocks, writer = [blocks], True
    else:
        group = _stage_group(model)
        writer = group.rank() == 0
        stage_blocks = [None] * group.size() if writer else None
        dist.gather_object(blocks, stage_blocks, group=group, group_dst=0)
    names: dict[str, str] = {}
    sizes, error = 0, None
    if writer:
        try:
            os.makedirs(path, exist_ok=True)
            tensors = _assemble(stage_blocks)
            save_file(tensors, os.path.join(path, file + PARTIAL), metadata={"format": "pt"})
            names = dict.fromkeys(tensors, file)
            sizes = sum(t.numel() * t.element_size() for t in tensors.values())
        except Exception as e:  # every rank must learn of it
            error = e
    try:
        raise_if_any_failed(error, "save_pretrained")
    except Exception:
        if writer:  # what the other stages wrote is dropped too
            with contextlib.suppress(OSError):
                os.remove(os.path.join(path, file + PARTIAL))
        raise
    everyone = [(names, sizes)]
    if not one_process:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (names, sizes))
    error = None
    if one_process or dist.get_rank() == 0:
        weight_map = {k: f for n, _ in everyone for k, f in n.items()}
        index = {
            "metadata": {"total_size": sum(s for _, s in everyone)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        try:
            for name, value in ((INDEX, index), ("config.json", model.config_dict())):
                with open(os.path.join(path, name + PARTIAL), "w") as f:
                    json.dump(value, f, indent=2)
            # Complete: every file takes its name (the shards before the
            # index that names them).
            for name in sorted(set(weight_map.values())) + [INDEX, "config.json"]:
                os.replace(os.path.join(path, name + PARTIAL), os.path.join(path, name))
        except Exception as e:
            error = e
    raise_if_any_failed(error, "save_pretrained")


def _stage_group(model):
    """The ranks of this rank's pipeline stage (made once; every rank makes
    every stage's group, in one order)."""
    if getattr(model, "_stage_group", None) is None:
        grid = model.layout.mesh.mesh  # [pp, dp, tp]
        for stage in range(grid.shape[0]):
            ranks = sorted(int(r) for r in grid[stage].flatten())
            group = dist.new_group(ranks)
            if stage == model.layout.pp_rank:
                model._stage_group = group
    return model._stage_group
