"""``torchrun --nproc-per-node N -m dsparallel.train --config job.toml
[--section.field=value ...]``: one training job (see the "Training on your
data" guide)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m dsparallel.train",
        description="Train a model on your text at any layout (run it under torchrun).",
        epilog="Any field is overridden as --section.field=value, e.g. --train.steps=200 "
        "--parallel.tensor=2 --model.config.hidden_size=256.",
    )
    p.add_argument("--config", help="the job's TOML file (default: every field's default)")
    args, rest = p.parse_known_args(argv)
    overrides: list[str] = []
    for token in rest:  # --section.field value, as --section.field=value
        if overrides and "=" not in overrides[-1] and not token.startswith("--"):
            overrides[-1] += "=" + token
        else:
            overrides.append(token)
    import dsparallel
    from dsparallel.train import Trainer, load

    try:
        config = load(args.config, overrides)
    except (OSError, ValueError) as e:
        p.error(str(e))
    try:
        Trainer(config).fit()
    finally:
        dsparallel.destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
