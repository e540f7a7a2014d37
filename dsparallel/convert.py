"""``python -m dsparallel.convert SRC DST --to hf|torch``: a training
checkpoint (``dsparallel.save_checkpoint``, or the trainer's checkpoint
directory, whose latest complete ``step-N`` is taken) as

- ``--to hf``: a Hugging Face checkpoint (``config.json``, safetensors),
  which ``transformers`` and ``from_pretrained`` load: the model of
  ``--model`` (a Hugging Face checkpoint directory or a ``config.json``;
  the trainer's runs hold the config in the checkpoint directory's
  ``config.json`` when exported, else name it) is built in this process,
  filled from the checkpoint and saved; the tokenizer files beside
  ``--model`` are copied along;
- ``--to torch``: one ``torch.save`` file of every tensor, whole
  (torch's ``dcp_to_torch_save``: the weights under ``model.<name>``, the
  optimizer's state under ``optim.<name>.<state>``), as DeepSpeed's
  ``zero_to_fp32`` gives.

Both run in one process, with no process group: the checkpoint is keyed by
name and global offsets, never by rank, whatever layout wrote it. (This is
not ``python -m dsparallel.checkpoint``: ``dsparallel.checkpoint`` is
activation recomputation.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def _source(path: str) -> str:
    """``path`` itself when it is a checkpoint (a ``.metadata`` file in it),
    else the latest complete checkpoint of a trainer's directory."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path
    from .train.checkpoints import complete

    found = complete(path) if os.path.isdir(path) else []
    if not found:
        raise FileNotFoundError(
            f"convert: {path} is neither a training checkpoint (no .metadata) nor a directory "
            "holding complete step-N checkpoints"
        )
    return found[-1][1]


def to_hf(src: str, dst: str, model: str, dtype: str | None = None) -> None:
    """The training checkpoint ``src`` as a Hugging Face checkpoint in
    ``dst``, for the model of ``model`` (a checkpoint directory or a
    ``config.json``), saved in ``dtype`` (default: the config's)."""
    from torch.distributed.checkpoint import FileSystemReader

    from .models.checkpoint_io import config_dtype, model_class
    from .training_checkpoint import load_checkpoint

    config_file = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"convert: --model {model}: {config_file} does not exist")
    with open(config_file) as f:
        config = json.load(f)
    config.pop("quantization_config", None)  # what it loads is not quantized
    cls = model_class(config, f"convert: --model {model}")
    name = dtype or config_dtype(config)
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"convert: {name!r} is not a torch dtype")
    # What the checkpoint holds implies the model's options (DeepSeek-V3's
    # MTP layers), as a Hugging Face checkpoint's tensors do for
    # from_pretrained: the weights are its "model.<checkpoint name>" keys.
    keys = FileSystemReader(src).read_metadata().state_dict_metadata
    held = {k.removeprefix("model."): src for k in keys if k.startswith("model.")}
    built = cls(config, None, dtype=getattr(torch, name), **cls.checkpoint_options(config, held))
    load_checkpoint(src, built)
    built.save_pretrained(dst)
    if os.path.isdir(model):
        for file in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(model, file)):
                shutil.copy2(os.path.join(model, file), os.path.join(dst, file))


def to_torch(src: str, dst: str) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(src, dst)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dsparallel.convert", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("src", help="a training checkpoint, or a trainer's checkpoint directory")
    ap.add_argument("dst", help="the Hugging Face directory, or the torch.save file")
    ap.add_argument("--to", choices=["hf", "torch"], required=True)
    ap.add_argument("--model", help="--to hf: a Hugging Face checkpoint directory or config.json")
    ap.add_argument("--dtype", help="--to hf: the saved dtype (default: the config's)")
    a = ap.parse_args(argv)
    try:
        src = _source(a.src)
        if a.to == "hf":
            if not a.model:
                raise ValueError("convert: --to hf needs --model (whose config the weights fill)")
            to_hf(src, a.dst, a.model, a.dtype)
        else:
            to_torch(src, a.dst)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.dst} from {src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
