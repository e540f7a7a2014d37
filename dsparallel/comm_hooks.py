"""DDP communication hooks: ``hook(process_group, bucket) -> Future[Tensor]``.

They fit both ``dsparallel.DistributedDataParallel.register_comm_hook`` and
torch's. ``process_group`` is the state argument (None: the default group).
Annotations are real objects here (no postponed evaluation): torch's DDP
checks that ``bucket`` is annotated ``dist.GradBucket``.
"""

import torch
import torch.distributed as dist


def _group(process_group):
    return process_group if process_group is not None else dist.group.WORLD


def allreduce_hook(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages the bucket: divide by the world size, then sum across ranks."""
    group = _group(process_group)
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(group))
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _compress_hook(dtype):
    def hook(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = _group(process_group)
        buffer = bucket.buffer()
        # Divide before compressing: the sum of n values must fit the format.
        compressed = buffer.to(dtype).div_(dist.get_world_size(group))
        work = dist.all_reduce(compressed, group=group, async_op=True)

        def decompress(fut):
            buffer.copy_(fut.value()[0])
            return buffer

        return work.get_future().then(decompress)

    hook.__name__ = f"{str(dtype).split('.')[-1]}_compress_hook"
    hook.__doc__ = (
        f"Compresses the bucket to {dtype}, all-reduces it and writes the average back "
        "in the bucket's dtype: half the bytes on the wire, the format's precision."
    )
    return hook


fp16_compress_hook = _compress_hook(torch.float16)
bf16_compress_hook = _compress_hook(torch.bfloat16)

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"]
