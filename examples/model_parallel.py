"""Manual model parallelism: one process, a model's layers on two devices.

    python examples/model_parallel.py

The first half of the network lives on one device and the second half on
another; the activation moves between them in forward (and its gradient back
in backward, which autograd does by itself). With two GPUs the devices are
``cuda:0`` and ``cuda:1``; otherwise both halves run on the CPU, which shows
the mechanics without the speed. The model learns a fixed random teacher; at
the end the result is checked against the same model run on one device.
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn


def devices() -> tuple[torch.device, torch.device]:
    if torch.cuda.device_count() >= 2:
        return torch.device("cuda:0"), torch.device("cuda:1")
    return torch.device("cpu"), torch.device("cpu")


def half(width: int, out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, out))


class TwoDeviceModel(nn.Module):
    def __init__(self, first: nn.Module, second: nn.Module, dev0, dev1):
        super().__init__()
        self.dev0, self.dev1 = dev0, dev1
        self.first, self.second = first.to(dev0), second.to(dev1)

    def forward(self, x):
        h = self.first(x.to(self.dev0))
        return self.second(h.to(self.dev1))  # the hop between devices


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--width", type=int, default=128)
    args = p.parse_args()

    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4)).requires_grad_(False)
    first, second = nn.Sequential(nn.Linear(32, args.width), nn.GELU()), half(args.width, 4)
    reference = nn.Sequential(copy.deepcopy(first), copy.deepcopy(second))
    dev0, dev1 = devices()
    model = TwoDeviceModel(first, second, dev0, dev1)
    print(f"first half on {dev0}, second half on {dev1}")

    opts = [torch.optim.Adam(m.parameters(), lr=3e-3) for m in (model, reference)]
    data = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=data)
        y = teacher(x)
        for m, opt in zip((model, reference), opts):
            opt.zero_grad()
            loss = (m(x).to("cpu") - y).square().mean()
            loss.backward()
            opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.5f}")
    with torch.no_grad():
        x = torch.randn(256, 32)
        diff = (model(x).cpu() - reference(x)).abs().max().item()
    print(f"done: max difference from the one-device model {diff:.2e}")
    if diff > 1e-4:
        raise SystemExit("the two-device model diverged from the one-device model")


if __name__ == "__main__":
    main()
