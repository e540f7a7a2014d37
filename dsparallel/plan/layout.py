"""A layout as the planner takes it: ``init_parallel``'s sizes plus what the
training job chooses around them."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb1p", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1  # carved out of dp x cp, as init_parallel does (or tp x dp x cp:)
    experts_over_tp: bool = False  # the expert-parallel group spans the tp ranks
    cp: int = 1
    zero: int = 0  # 0, 1 or 2 (dsparallel's ZeroRedundancyOptimizer, DDP zero_stage=2)
    schedule: str = "1f1b"
    stages_per_rank: int | None = None  # None: what the schedule runs (2 for V shapes)
    recompute: bool = False  # every block recomputed in backward
    sequence_parallel: bool = False
    cp_mode: str = "ring"
    micro_batch: int = 1  # sequences per micro-batch and data-parallel replica
    micro_batches: int = 1  # per step
    dtype: str = "float32"

    @classmethod
    def of(cls, state, **choices) -> Layout:
        """The sizes of ``init_parallel``'s ``state``, with the job's other
        ``choices`` (zero, schedule, micro-batches, ...)."""
        return cls(
            tp=state.tp_size,
            pp=state.pp_size,
            dp=state.dp_size,
            ep=state.ep_size,
            cp=state.cp_size,
            experts_over_tp=state.experts_over_tp and state.tp_size > 1,
            **choices,
        )

    @property
    def expert_split(self) -> int:
        """How many data-parallel (x cp) replicas one expert-parallel group
        spans: ep, or ep / tp when the group spans the tp ranks. The expert
        data-parallel group (the replicas of one rank's experts) is dp x cp
        over it."""
        return self.ep // self.tp if self.experts_over_tp else self.ep

    @property
    def tokens_split_for_experts(self) -> bool:
        """Each tp rank routes only its own part of the tokens (sequence
        parallelism, or the experts split over tp)."""
        return self.tp > 1 and (self.sequence_parallel or self.experts_over_tp)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def per_rank(self) -> int:
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 2 if self.schedule in V_SHAPED + ("interleaved_1f1b",) else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.per_rank

    def stages_of(self, pp_rank: int) -> list[int]:
        """The pipeline stages rank ``pp_rank`` of the pipeline holds."""
        if self.schedule in V_SHAPED:
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [pp_rank + k * self.pp for k in range(self.per_rank)]

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def check(self, world: int | None = None) -> None:
        """Raises ValueError naming what is wrong."""
        for name in ("tp", "pp", "dp", "ep", "cp", "micro_batch", "micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"plan: layout {name} must be a positive integer, got {value!r}")
        if world is not None and self.world != world:
            raise ValueError(
                f"plan: tp {self.tp} x pp {self.pp} x dp {self.dp} x cp {self.cp} = "
                f"{self.world} ranks, but the cluster has {world} devices"
            )
        if self.experts_over_tp and (self.ep % self.tp or (self.dp * self.cp) % self.expert_split):
            raise ValueError(
                f"plan: with experts over tp, ep {self.ep} must be tp {self.tp} times a divisor "
                f"of dp x cp = {self.dp * self.cp}"
            )
        if not self.experts_over_tp and (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"plan: ep {self.ep} must divide dp x cp = {self.dp * self.cp} (expert-parallel "
                "groups are carved out of those ranks)"
            )
        if self.zero not in (0, 1, 2):
            raise ValueError(f"plan: zero must be 0, 1 or 2, got {self.zero!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"plan: schedule {self.schedule!r} is not one of {SCHEDULES}")
        if self.schedule in V_SHAPED and self.per_rank != 2:
            raise ValueError(f"plan: {self.schedule} runs 2 stages per rank (a V)")
        if self.per_rank > 1 and self.schedule not in V_SHAPED + ("interleaved_1f1b", "zb1p"):
            raise ValueError(f"plan: {self.schedule} runs one stage per rank")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"plan: dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        if self.cp_mode not in ("ring", "ulysses"):
            raise ValueError(f"plan: cp_mode must be 'ring' or 'ulysses', got {self.cp_mode!r}")
