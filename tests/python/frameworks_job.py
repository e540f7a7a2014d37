"""One framework's few training steps on 2 ranks under torchrun, over
"dsp" or gloo, as a user would write them (``test_frameworks.py`` runs it):

    torchrun --nproc-per-node 2 frameworks_job.py FRAMEWORK BACKEND OUT

FRAMEWORK: ddp (torch DDP, the group made by ``init_process_group()``
without a backend after ``dsparallel.use_as_default()``), env (the same
with ``DSPARALLEL_DEFAULT_BACKEND=1`` and no dsparallel import), fsdp2
(``fully_shard`` over ``init_device_mesh("cpu", ...)`` made with no group
yet), tp (``parallelize_module``), compile (``torch.compile`` of DDP),
hf_trainer (the ``transformers`` ``Trainer``), accelerate, lightning (DDP
and ModelParallel strategies). Rank 0 writes the trained weights and the
backend the framework's group used to OUT.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

STEPS = 3


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8 * STEPS, 8, generator=g), torch.randn(8 * STEPS, 1, generator=g)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _init(backend: str) -> None:
    if backend == "dsp":
        import dsparallel

        dsparallel.use_as_default()
        dist.init_process_group()  # no backend named: the default's
    else:
        dist.init_process_group(backend)


def _plain_steps(module, params, x, y, rank):
    """SGD steps on this rank's half of each batch of 8."""
    opt = torch.optim.SGD(params, lr=0.1)
    for s in range(STEPS):
        rows = slice(8 * s + 4 * rank, 8 * s + 4 * rank + 4)
        nn.functional.mse_loss(module(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()


def _full(state: dict) -> dict:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in state.items()
    }


def run(framework: str, backend: str):
    """(weights, the backend of the framework's group)."""
    x, y = _data()
    if framework in ("ddp", "env"):
        if framework == "env":  # set by the test; nothing imported from dsparallel
            dist.init_process_group() if backend == "dsp" else dist.init_process_group(backend)
        else:
            _init(backend)
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = _model()
        ddp = DDP(model)
        _plain_steps(ddp, ddp.parameters(), x, y, dist.get_rank())
        return _full(model.state_dict()), dist.get_backend(ddp.process_group)
    if framework in ("fsdp2", "tp"):
        from torch.distributed.device_mesh import init_device_mesh

        if backend == "dsp":
            import dsparallel

            dsparallel.use_as_default()
        else:
            dist.init_process_group(backend)
        mesh = init_device_mesh("cpu", (2,))  # creates the default group where none is
        model = _model()
        if framework == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            fully_shard(model, mesh=mesh)
            _plain_steps(model, model.parameters(), x, y, dist.get_rank())
        else:
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )

            parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
            _plain_steps(model, model.parameters(), x, y, 0)  # every tp rank the same rows
        return _full(model.state_dict()), dist.get_backend(mesh.get_group())
    if framework == "compile":
        _init(backend)
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = _model()
        ddp = DDP(model)
        compiled = torch.compile(ddp, backend="aot_eager")
        _plain_steps(compiled, ddp.parameters(), x, y, dist.get_rank())
        return _full(model.state_dict()), dist.get_backend(ddp.process_group)
    if framework == "accelerate":
        if backend == "dsp":
            dist.init_process_group("dsp")  # first: accelerate would pick gloo itself
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)  # without cpu=True it skips DDP on a CPU machine
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        wrapped, opt = acc.prepare(model, opt)
        assert isinstance(wrapped, nn.parallel.DistributedDataParallel), type(wrapped)
        rank = dist.get_rank()
        for s in range(STEPS):
            rows = slice(8 * s + 4 * rank, 8 * s + 4 * rank + 4)
            acc.backward(nn.functional.mse_loss(wrapped(x[rows]), y[rows]))
            opt.step()
            opt.zero_grad()
        return _full(model.state_dict()), dist.get_backend(wrapped.process_group)
    if framework == "hf_trainer":
        return _hf_trainer(backend)
    if framework in ("lightning", "lightning_mp"):
        return _lightning(framework, backend, x, y)
    raise SystemExit(f"unknown framework {framework}")


def _hf_trainer(backend: str):
    import tempfile

    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    if backend == "dsp":
        dist.init_process_group("dsp")  # first: the Trainer asks accelerate, which picks gloo
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    ids = torch.randint(0, 32, (4 * STEPS, 8), generator=torch.Generator().manual_seed(1))

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,  # without it the ranks would train apart
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        **({"ddp_backend": "gloo"} if backend == "gloo" else {}),
    )
    trainer = Trainer(model=model, args=args, train_dataset=Rows())
    trainer.train()
    wrapped = trainer.model_wrapped
    assert isinstance(wrapped, nn.parallel.DistributedDataParallel), type(wrapped)
    return _full(model.state_dict()), dist.get_backend(wrapped.process_group)


def _lightning(framework: str, backend: str, x, y):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _model()

        def training_step(self, batch, _):
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    if framework == "lightning":
        strategy = DDPStrategy(process_group_backend=backend)
    else:
        from torch.distributed.fsdp import fully_shard

        class Module(Module):  # noqa: F811  (the same, sharded by FSDP2)
            def configure_model(self):
                fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        if backend == "dsp":
            dist.init_process_group("dsp")  # first: the strategy takes the group it finds
        else:
            dist.init_process_group("gloo")
    module = Module()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data)
    return _full(module.net.state_dict()), dist.get_backend()


def main():
    framework, backend, out = sys.argv[1:4]
    weights, used = run(framework, backend)
    if dist.get_rank() == 0:
        torch.save({"weights": weights, "backend": str(used)}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
