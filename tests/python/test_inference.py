"""``dsparallel.inference.generate`` against ``transformers``' ``generate``.

Tiny random Llama (grouped-query attention, 2 kv heads) and DeepSeek-V3
models are built from a config, seeded and saved; ``transformers``
generates greedily from a batch of three prompts of different lengths
(left padded), once without an eos token and once with one that stops a
sequence early. Each layout loads the checkpoint with ``from_pretrained``
and must produce the same tokens on every rank; sampling with a seed must
give the same tokens on every rank and in two runs, and at tp 2 the same
as one process.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from test_models import DEEPSEEK, LLAMA, _hf_model

NEW = 20
SAMPLED = 12
SAMPLING = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("gen")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 96, (3, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :5] = 0
    ids = ids.masked_fill(mask == 0, 0)
    ref = {"ids": ids, "mask": mask, "dirs": {}, "greedy": {}, "eos": {}, "stopped": {}}
    ref["plain"] = {}  # prompts without padding: the layers take no mask
    for i, kind in enumerate(("llama", "deepseek")):
        torch.manual_seed(20 + i)
        model = _hf_model(kind).float().eval()
        path = str(root / kind)
        model.save_pretrained(path)
        ref["dirs"][kind] = path
        args = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            greedy = model.generate(ids, **args, eos_token_id=None)
            # An eos that row 0 produces early: it stops there and pads.
            eos = int(greedy[0, ids.shape[1] + 4])
            stopped = model.generate(ids, **args, eos_token_id=eos)
            ref["plain"][kind] = model.generate(
                ids[:, 5:], max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None
            )
        ref["greedy"][kind], ref["eos"][kind], ref["stopped"][kind] = greedy, eos, stopped
    torch.save(ref, root / "ref.pt")
    return ref, str(root / "ref.pt")


def _generate_all(model, ref, kind):
    from dsparallel.inference import KVCache, generate

    ids, mask = ref["ids"], ref["mask"]
    greedy = generate(model, ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0)
    stopped = generate(
        model,
        ids,
        attention_mask=mask,
        max_new_tokens=NEW,
        eos_token_id=ref["eos"][kind],
        pad_token_id=0,
    )
    plain = generate(model, ids[:, 5:], max_new_tokens=NEW)
    sampled = [
        generate(
            model,
            ids,
            attention_mask=mask,
            max_new_tokens=SAMPLED,
            generator=torch.Generator().manual_seed(7),
            **SAMPLING,
        )
        for _ in range(2)
    ]
    cache = KVCache(model, ids.shape[0], ids.shape[1] + NEW, torch.float32).nbytes
    # Lists: tensors would go back to the test through shared memory that
    # the rank's exit takes away.
    return {
        "greedy": greedy.tolist(),
        "stopped": stopped.tolist(),
        "plain": plain.tolist(),
        "sampled": [s.tolist() for s in sampled],
        "cache_bytes": cache,
    }


def _layout_body(rank, world, tp, pp, ep, ref_path):
    import dsparallel
    from dsparallel.models import from_pretrained

    ref = torch.load(ref_path)
    state = dsparallel.init_parallel(tp, pp, expert_parallel_size=ep)
    out = {}
    for kind, path in ref["dirs"].items():
        if ep > 1 and kind != "deepseek":
            continue
        model = from_pretrained(path, state)
        out[kind] = _generate_all(model, ref, kind)
        out[kind]["layers_here"] = len(model.layers)
    dsparallel.destroy_parallel()
    return out


LAYOUTS = [(1, 1, 1), (2, 1, 1), (4, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2)]


@pytest.fixture(scope="module")
def one_process(reference):
    from dsparallel.models import from_pretrained

    ref, _ = reference
    return {kind: _generate_all(from_pretrained(p), ref, kind) for kind, p in ref["dirs"].items()}


@pytest.mark.parametrize("tp,pp,ep", LAYOUTS, ids=[f"tp{t}-pp{p}-ep{e}" for t, p, e in LAYOUTS])
def test_generate_equals_transformers_at_every_layout(reference, one_process, tp, pp, ep):
    ref, ref_path = reference
    ranks = run_ranks(_layout_body, tp * pp * ep, tp, pp, ep, ref_path, timeout=240)
    for kind in ranks[0]:
        single = one_process[kind]
        for rank, got in enumerate(r[kind] for r in ranks):
            where = f"{kind}, rank {rank}"
            assert got["greedy"] == ref["greedy"][kind].tolist(), where
            assert got["stopped"] == ref["stopped"][kind].tolist(), where
            assert got["plain"] == ref["plain"][kind].tolist(), where
            first, second = got["sampled"]
            assert first == second, f"{where}: sampling with one seed differs"
            assert first == ranks[0][kind]["sampled"][0], f"{where}: ranks differ"
            if pp == 1:  # under a pipeline micro-batches draw in another order
                assert first == single["sampled"][0], f"{where}: differs from tp 1"
            # The cache: this stage's layers, this rank's heads (Llama: 2 kv
            # heads, replicated beyond tp 2), DeepSeek's latent whole.
            share = (
                got["layers_here"] / (LLAMA if kind == "llama" else DEEPSEEK)["num_hidden_layers"]
            )
            if kind == "llama":
                share /= min(tp, LLAMA["num_key_value_heads"])
            assert got["cache_bytes"] == single["cache_bytes"] * share, where


def test_the_deepseek_cache_holds_the_latent(one_process):
    """Per token and layer: kv_lora_rank + rope dims, not the heads'
    expanded keys and values."""
    per_token = DEEPSEEK["kv_lora_rank"] + DEEPSEEK["qk_rope_head_dim"]
    expanded = DEEPSEEK["num_attention_heads"] * (
        DEEPSEEK["qk_nope_head_dim"] + DEEPSEEK["qk_rope_head_dim"] + DEEPSEEK["v_head_dim"]
    )
    tokens = 3 * (8 + NEW) * DEEPSEEK["num_hidden_layers"]
    assert one_process["deepseek"]["cache_bytes"] == tokens * per_token * 4
    assert per_token < expanded


def _bad_input_body(rank, world, path):
    import dsparallel
    from dsparallel.inference import generate
    from dsparallel.models import from_pretrained

    state = dsparallel.init_parallel(2, 1)
    model = from_pretrained(path, state)
    ids = torch.randint(0, 96, (2, 8))
    errors = []
    for kwargs in (
        dict(input_ids=torch.randint(0, 96, (1, 60)), max_new_tokens=10),
        dict(input_ids=ids, max_new_tokens=-1),
        dict(input_ids=ids, max_new_tokens=4, attention_mask=torch.ones(3, 8, dtype=torch.long)),
    ):
        try:
            generate(model, **kwargs)
        except ValueError as e:
            errors.append(str(e))
    dsparallel.destroy_parallel()
    return errors


def test_bad_input_is_refused_on_every_rank(reference):
    ref, _ = reference
    for errors in run_ranks(_bad_input_body, 2, ref["dirs"]["llama"], timeout=120):
        assert len(errors) == 3, errors
        assert "more than the model's max_position_embeddings=64" in errors[0]
        assert "max_new_tokens must be an integer >= 0, got -1" in errors[1]
        assert "attention_mask has shape (3, 8), input_ids (2, 8)" in errors[2]
