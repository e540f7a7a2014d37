"""The split planner (dsparallel.plan) held against what the jobs hold."""

from __future__ import annotations

import os
import sys

import torch
from dist_utils import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (tp, pp, ep, cp, zero, schedule, moe experts) of the GPT job on 4 processes
GPT_LAYOUTS = [
    (1, 1, 1, 1, 0, "1f1b", 0),
    (2, 1, 1, 1, 1, "1f1b", 0),
    (1, 1, 1, 1, 2, "1f1b", 0),
    (2, 2, 1, 1, 0, "1f1b", 0),
    (1, 2, 1, 1, 2, "1f1b", 0),
    (1, 2, 1, 1, 1, "interleaved_1f1b", 0),
    (1, 2, 1, 1, 0, "zbv", 0),
    (1, 4, 1, 1, 0, "gpipe", 0),
    (4, 1, 1, 1, 0, "1f1b", 0),
    (1, 1, 2, 1, 1, "1f1b", 4),
    (1, 1, 4, 1, 2, "1f1b", 4),
    (2, 1, 1, 2, 2, "1f1b", 0),
    (1, 2, 1, 2, 1, "1f1b", 0),
]


def _gpt_body(rank, world, layouts):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_gpt

    import dsparallel
    from dsparallel.models import GPTConfig
    from dsparallel.plan.layout import Layout
    from dsparallel.plan.measure import held
    from dsparallel.plan.memory import model_state
    from dsparallel.plan.model import rank_tensors, read_model

    corpus = train_gpt.load_corpus()
    out = []
    for tp, pp, ep, cp, zero, schedule, experts in layouts:
        cfg = GPTConfig(hidden=64, layers=4, seq_len=32, moe_experts=experts, moe_shared_experts=1)
        job = train_gpt.make_job(
            cfg,
            tp,
            pp,
            4,
            16,
            zero_stage=zero,
            schedule=schedule,
            expert_parallel=ep,
            context_parallel=cp,
        )
        ddps = [st.submod for st in job.stages if hasattr(st.submod, "zero_stage")]
        # Counted after the optimizer's step, before the gradients are let go.
        measured, zero_grad = [], job.opt.zero_grad

        def count_then_zero(
            set_to_none=True, job=job, ddps=ddps, measured=measured, zero_grad=zero_grad
        ):
            measured.append(held(job.module, job.opt, ddps))
            zero_grad(set_to_none)

        job.opt.zero_grad = count_then_zero
        train_gpt.train_step(job, corpus, 0)
        s = job.state
        lay = Layout(tp=tp, pp=pp, dp=s.dp_size, ep=ep, cp=cp, zero=zero, schedule=schedule)
        model = read_model(cfg)
        stages = lay.stages_of(s.pp_rank)
        expected = [
            t.shape for st in stages for t in rank_tensors(model, tp, lay.num_stages, ep, st)
        ]
        got = [tuple(p.shape) for p in job.module.parameters()]
        assert got == expected, (lay, got, expected)
        predicted = model_state(model, lay, s.pp_rank, s.dp_rank, s.cp_rank)
        out.append((lay, measured[0], predicted))
        dsparallel.destroy_parallel()
    return out


def test_model_state_bytes_equal_what_the_gpt_job_holds():
    """Parameter, gradient and optimizer bytes per rank, predicted for each
    rank's place in the layout, equal the bytes of the job's tensors after a
    step: every rank, every layout (dp, tp, pp with 1F1B, interleaved, ZBV
    and GPipe, ZeRO 1 and 2, expert and context parallelism)."""
    results = run_ranks(_gpt_body, 4, GPT_LAYOUTS, timeout=400)
    for rank, per_rank in enumerate(results):
        for lay, measured, predicted in per_rank:
            assert measured == predicted, (
                f"rank {rank}, {lay}: held {measured}, planned {predicted}"
            )


# (model, tp, pp, ep, cp, zero, dtype) of Llama / DeepSeek-V3 on 4 processes
HF_LAYOUTS = [
    ("llama", 2, 2, 1, 1, 1, "float32"),
    ("llama", 1, 1, 1, 2, 2, "float32"),
    ("llama_tied", 1, 2, 1, 1, 0, "float32"),
    ("llama", 4, 1, 1, 1, 2, "bfloat16"),
    ("deepseek", 1, 1, 2, 1, 2, "float32"),
    ("deepseek", 2, 1, 2, 1, 1, "bfloat16"),
    ("deepseek", 1, 2, 2, 1, 0, "bfloat16"),
    ("deepseek", 1, 1, 4, 2, 1, "float32"),
]


def _hf_body(rank, world, layouts):
    from test_models import MODELS

    import dsparallel
    from dsparallel.models import DeepseekV3, Llama
    from dsparallel.pipeline import Schedule1F1B
    from dsparallel.plan.layout import Layout
    from dsparallel.plan.measure import held
    from dsparallel.plan.memory import model_state
    from dsparallel.plan.model import rank_tensors, read_model

    out = []
    for kind, tp, pp, ep, cp, zero, dtype in layouts:
        cls = DeepseekV3 if kind == "deepseek" else Llama
        config = dict(MODELS[kind], model_type=cls.model_type)
        state = dsparallel.init_parallel(tp, pp, expert_parallel_size=ep, context_parallel_size=cp)
        model = cls(config, state, dtype=getattr(torch, dtype))
        replicas = state.dp_cp_group
        ddps = []

        def wrap(m, zero=zero, replicas=replicas, ddps=ddps):
            ddps.append(
                dsparallel.DistributedDataParallel(
                    m, process_group=replicas, zero_stage=2 if zero == 2 else 0
                )
            )
            return ddps[-1]

        wrapped = replicas.size() > 1
        if pp > 1:
            stage = model.pipeline_stage(wrap=wrap if wrapped else None)
            schedule = Schedule1F1B(stage, n_microbatches=2, loss_fn=model.loss_fn)
        else:
            runner = wrap(model) if wrapped else model
        params = list(model.parameters())
        if zero:
            opt = dsparallel.ZeroRedundancyOptimizer(
                params, torch.optim.AdamW, process_group=replicas, lr=1e-3
            )
        else:
            opt = torch.optim.AdamW(params, lr=1e-3)
        ids = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(0))
        if pp == 1:
            runner(ids, labels=ids).loss.backward()
        elif model.is_first:
            schedule.step(ids)
        else:
            schedule.step(target=ids, losses=[])
        opt.step()
        measured = held(model, opt, ddps)
        lay = Layout(tp=tp, pp=pp, dp=state.dp_size, ep=ep, cp=cp, zero=zero, dtype=dtype)
        plan_model = read_model(config)
        shapes = [t.shape for t in rank_tensors(plan_model, tp, pp, ep, state.pp_rank)]
        assert [tuple(p.shape) for p in model.parameters()] == shapes, (kind, lay)
        predicted = model_state(plan_model, lay, state.pp_rank, state.dp_rank, state.cp_rank)
        out.append((kind, lay, measured, predicted))
        dsparallel.destroy_parallel()
    return out


def test_model_state_bytes_equal_what_llama_and_deepseek_hold():
    """The same for Llama (GQA with replicated key/value heads, tied
    embeddings across stages) and DeepSeek-V3 (latent attention, experts
    over ep, a float32 router), in float32 and bfloat16 (ZeRO's float32
    master copies)."""
    results = run_ranks(_hf_body, 4, HF_LAYOUTS, timeout=400)
    for rank, per_rank in enumerate(results):
        for kind, lay, measured, predicted in per_rank:
            assert measured == predicted, (
                f"rank {rank}, {kind} {lay}: held {measured}, planned {predicted}"
            )
