"""DeepSeek-V3's auxiliary-loss-free balancing: after a training step,
``update_expert_bias`` moves each router's ``e_score_correction_bias`` by
0.001 towards the mean load, the load summed over the whole global batch.

The reference is the paper's rule computed in the test on ``transformers``'
routing of the whole batch in one process (the experts each token's router
chose, read from its gate's output): bias + 0.001 * sign(mean load - load).
Ours trains the same step at dp 2 (each rank half the batch), tp 2 with
sequence parallelism (each rank half of every sequence's tokens) and pp 2
(each rank the routers of its own layers).
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks

CONFIG = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
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
BATCH, SEQ, RATE = 4, 12, 1e-3


def _ids():
    return torch.randint(0, 96, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**CONFIG)).float()
    chosen = {}
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            # A bias already away from zero, so that it steers the routing.
            module.e_score_correction_bias.normal_(0.0, 0.05)
            layer = int(name.split(".")[2])
            module.register_forward_hook(
                lambda mod, args, out, layer=layer: chosen.__setitem__(layer, out[2])
            )
    path = str(tmp_path_factory.mktemp("ds") / "model")
    model.save_pretrained(path)
    with torch.no_grad():
        model(_ids())
    want = {}
    for layer, idx in chosen.items():
        bias = model.model.layers[layer].mlp.gate.e_score_correction_bias
        load = torch.bincount(idx.flatten(), minlength=CONFIG["n_routed_experts"]).float()
        want[layer] = bias + RATE * torch.sign(load.mean() - load)
        assert not torch.equal(want[layer], bias)
    return path, want


def _step_body(rank, world, path, layout):
    import dsparallel
    from dsparallel.models import from_pretrained
    from dsparallel.moe import update_expert_bias
    from dsparallel.pipeline import Schedule1F1B

    tp, pp = {"dp": (1, 1), "tp-sp": (2, 1), "pp": (1, 2)}[layout]
    state = dsparallel.init_parallel(tp, pp)
    model = from_pretrained(path, state, dtype=torch.float32, sequence_parallel=tp > 1)
    ids = _ids()
    if pp > 1:
        schedule = Schedule1F1B(model.pipeline_stage(), n_microbatches=2, loss_fn=model.loss_fn)
        if model.is_first:
            schedule.step(ids)
        else:
            schedule.step(target=ids)
    else:
        rows = ids.chunk(state.dp_size)[state.dp_rank]
        model(rows, labels=rows).loss.backward()
    update_expert_bias(model)
    biases = {
        int(name.split(".")[1]): b.tolist()  # plain lists cross the result queue
        for name, b in model.named_buffers()
        if name.endswith("e_score_correction_bias")
    }
    dsparallel.destroy_parallel()
    return biases


@pytest.mark.parametrize("layout", ["dp", "tp-sp", "pp"])
def test_correction_bias_moves_by_the_papers_rule(reference, layout):
    path, want = reference
    seen = set()
    for biases in run_ranks(_step_body, 2, path, layout, timeout=120):
        seen |= biases.keys()  # pp: each rank its own layers
        for layer, bias in biases.items():
            torch.testing.assert_close(torch.tensor(bias), want[layer], rtol=0, atol=0)
    assert seen == want.keys()
