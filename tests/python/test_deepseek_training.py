"""DeepSeek-V3 trained at its layouts and under every pipeline schedule,
with the sequence-wise balance loss (paper, eq. 17-20) weighted by alpha:
one SGD step's gradients against one process of ``transformers``' model
whose loss has the balance loss added, written in the test from plain
torch ops on what each router saw (its input, read by a forward hook) and
chose (its output):

    f_i = E / (K T) * #(tokens of the sequence choosing i)
    P_i = mean over the sequence's tokens of s_i / sum_j s_j  (sigmoid scores)
    loss = lm + alpha * sum over MoE layers of mean over sequences of sum_i f_i P_i

Ours: dp 2 (each rank half the sequences), tp 2 with sequence parallelism
and cp 2 (each rank part of every sequence: the counts and score sums are
summed over the group), ep 2, and pp 2 under 1F1B, interleaved 1F1B, ZBV
and DualPipeV (two stages a rank, the last two in a V; each of the M
micro-batches carries 1/M of the weight), DualPipeV also at pp 2 x ep 2;
and with the experts split over the tp ranks too (``experts_over_tp``,
tp 2 x ep 2 and tp 2 x dp 2 x ep 4, with and without sequence
parallelism).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks

CONFIG = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=5,  # four MoE layers: one per stage at two stages a rank
    num_attention_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=64,
)
BATCH, SEQ, ALPHA = 8, 12, 0.3  # alpha large enough to move the routers visibly


def _ids():
    return torch.randint(0, 96, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))


def _balance(hidden, chosen, weight):
    """The paper's loss of one layer, from its router's input [b, s, h] and
    chosen experts [b * s, k]."""
    e, k = CONFIG["n_routed_experts"], CONFIG["num_experts_per_tok"]
    scores = torch.sigmoid(F.linear(hidden.reshape(BATCH, SEQ, -1).float(), weight.float()))
    p = (scores / scores.sum(-1, keepdim=True)).mean(1)
    counts = torch.zeros(chosen.shape[0], e).scatter_(1, chosen, 1.0)
    f = counts.view(BATCH, SEQ, e).sum(1) * e / (k * SEQ)
    return (f * p).sum(-1).mean()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _reference(str(tmp_path_factory.mktemp("ds") / "model"))


def _reference(path: str):
    """(checkpoint, gradients with the balance loss, without it)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**CONFIG)).float()
    seen = []
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.e_score_correction_bias.normal_(0.0, 0.05)
            module.register_forward_hook(
                lambda mod, args, out: seen.append(_balance(args[0], out[2], mod.weight))
            )
    model.save_pretrained(path)
    grads = []
    for alpha in (ALPHA, 0.0):
        seen.clear()
        model.zero_grad()
        ids = _ids()
        lm = model(ids, labels=ids).loss
        (lm + alpha * sum(seen)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return path, grads[0], grads[1]


LAYOUTS = {  # processes, tp, pp, ep, cp, sequence parallel, schedule
    "dp2": (2, 1, 1, 1, 1, False, "1f1b"),
    "tp2-sp": (2, 2, 1, 1, 1, True, "1f1b"),
    "cp2": (2, 1, 1, 1, 2, False, "1f1b"),
    "ep2": (2, 1, 1, 2, 1, False, "1f1b"),
    "pp2-1f1b": (2, 1, 2, 1, 1, False, "1f1b"),
    "pp2-interleaved": (2, 1, 2, 1, 1, False, "interleaved_1f1b"),
    "pp2-zbv": (2, 1, 2, 1, 1, False, "zbv"),
    "pp2-dualpipev": (2, 1, 2, 1, 1, False, "dualpipev"),
    "pp2-ep2-dualpipev": (4, 1, 2, 2, 1, False, "dualpipev"),
    # experts_over_tp: the expert-parallel group spans the tp ranks
    "tp2-ep2-fold": (2, 2, 1, 2, 1, False, "1f1b"),
    "tp2-ep4-fold": (4, 2, 1, 4, 1, False, "1f1b"),
    "tp2-sp-ep4-fold": (4, 2, 1, 4, 1, True, "1f1b"),
}


def _step_body(rank, world, path, out, layout):
    import dsparallel
    from dsparallel.models import from_pretrained
    from dsparallel.models.deepseek_v3 import Router
    from dsparallel.train.step import make_step, stage_layout

    _, tp, pp, ep, cp, sp, schedule = LAYOUTS[layout]
    state = dsparallel.init_parallel(
        tp,
        pp,
        expert_parallel_size=ep,
        context_parallel_size=cp,
        experts_over_tp=layout.endswith("-fold"),
    )
    per_rank, placement = stage_layout(schedule)
    model = from_pretrained(
        path,
        state,
        dtype=torch.float32,
        sequence_parallel=sp,
        stages_per_rank=per_rank,
        stage_placement=placement,
    )
    for m in model.modules():
        if isinstance(m, Router):
            m.balance_loss_weight = ALPHA
            m.bias_update_rate = 0.0  # the weights alone are compared
    step = make_step(
        model,
        state,
        lambda model, zero: torch.optim.SGD(model.parameters(), lr=1.0),
        schedule=schedule,
        micro_batches=4 if schedule == "dualpipev" else 2,  # DualPipeV: 2 a direction
    )
    ids = _ids()
    step.step(ids.chunk(state.dp_size)[state.dp_rank])
    model.save_pretrained(out)
    dsparallel.destroy_parallel()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_step_equals_transformers_with_the_balance_loss(reference, tmp_path, layout):
    from transformers import DeepseekV3ForCausalLM

    path, want, without = reference
    out = str(tmp_path / "out")
    run_ranks(_step_body, LAYOUTS[layout][0], path, out, layout, timeout=180)
    before = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    after = DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    moved_by_balance = 0
    for name, g in want.items():
        got = before[name] - after[name]  # SGD at lr 1: the gradient
        scale = g.abs().max().item()
        torch.testing.assert_close(got, g, rtol=0, atol=2e-5 * max(scale, 1e-2), msg=name)
        if (g - without[name]).abs().max().item() > 1e-3 * max(scale, 1e-3):
            moved_by_balance += 1
    # The balance loss changed the routers' gradients (and the layers before).
    assert moved_by_balance >= 2
