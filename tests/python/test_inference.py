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
from test_models import DEEPSEEK, GPT2, LLAMA, _hf_model

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
    for i, kind in enumerate(("llama", "deepseek", "gpt2")):
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


def _layout_body(rank, world, tp, pp, ep, fold, ref_path):
    import dsparallel
    from dsparallel.models import from_pretrained

    ref = torch.load(ref_path)
    state = dsparallel.init_parallel(tp, pp, expert_parallel_size=ep, experts_over_tp=fold)
    out = {}
    for kind, path in ref["dirs"].items():
        if ep > 1 and kind != "deepseek":
            continue
        model = from_pretrained(path, state)
        out[kind] = _generate_all(model, ref, kind)
        out[kind]["layers_here"] = len(model.layers)
    dsparallel.destroy_parallel()
    return out


# (tp, pp, ep, experts_over_tp): the last decodes 3 rows over 2 tp ranks,
# each routing its share (one padded).
LAYOUTS = [
    (1, 1, 1, False),
    (2, 1, 1, False),
    (4, 1, 1, False),
    (1, 2, 1, False),
    (2, 2, 1, False),
    (1, 1, 2, False),
    (2, 1, 2, True),
]


@pytest.fixture(scope="module")
def one_process(reference):
    from dsparallel.models import from_pretrained

    ref, _ = reference
    return {kind: _generate_all(from_pretrained(p), ref, kind) for kind, p in ref["dirs"].items()}


@pytest.mark.parametrize(
    "tp,pp,ep,fold",
    LAYOUTS,
    ids=[f"tp{t}-pp{p}-ep{e}{'-over-tp' * f}" for t, p, e, f in LAYOUTS],
)
def test_generate_equals_transformers_at_every_layout(reference, one_process, tp, pp, ep, fold):
    ref, ref_path = reference
    world = pp * ep if fold else tp * pp * ep
    ranks = run_ranks(_layout_body, world, tp, pp, ep, fold, ref_path, timeout=240)
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
            layers = {"llama": LLAMA, "deepseek": DEEPSEEK}.get(kind, {}).get("num_hidden_layers")
            share = got["layers_here"] / (layers or GPT2["n_layer"])
            if kind == "llama":
                share /= min(tp, LLAMA["num_key_value_heads"])
            if kind == "gpt2":  # its heads split over tp
                share /= tp
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


_DECODE_MEMORY = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from inference import decode_memory
from dsparallel.models import Llama
model = Llama(json.loads(sys.argv[2]), dtype=torch.float32)
print(json.dumps(decode_memory(model, torch.randint(3, 96, (1, 8)), 44)))
"""


def test_a_decode_step_allocates_nothing_new():
    """Past the first decode steps the bytes in use grow by less than one
    token's cache over 41 steps (a few bytes of Python's own objects) and
    the allocator takes nothing more from the system, where a cache grown
    by concatenation would add a token's cache every step (41 KiB here),
    and every token kept as its own tensor ~15 KiB; the cache never
    moves. Measured by glibc's
    counters in a process without its caches of freed chunks
    (benchmarks/inference.py's decode_memory, which the benchmark also
    runs for the 300M model at tp 2)."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "..", "benchmarks"))
    from inference import EXACT_MALLOC

    config = dict(LLAMA, model_type="llama", hidden_size=256, num_attention_heads=8)
    out = subprocess.run(
        [sys.executable, "-c", _DECODE_MEMORY, sys.path[0], json.dumps(config)],
        env={**os.environ, **EXACT_MALLOC},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["steps"] == 41 and not got["cache_moved"], got
    assert got["cache_bytes_per_token"] == 1024, got  # 2 layers x k, v x 4 heads x 32 x fp32
    assert got["in_use_growth_bytes"] < 1024 and got["held_growth_bytes"] == 0, got


# ------------------------------------------------ several stages per rank


def _stages_body(rank, world, path, placement, ids, mask):
    import dsparallel
    from dsparallel.inference import generate
    from dsparallel.models import from_pretrained

    state = dsparallel.init_parallel(1, 2)
    model = from_pretrained(path, state, stages_per_rank=2, stage_placement=placement)
    out = model(ids, labels=ids, return_logits=True)
    logits = None if out.logits is None else out.logits.tolist()
    loss = None if out.loss is None else out.loss.item()
    tokens = generate(model, ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0)
    dsparallel.destroy_parallel()
    return {"stages": model.stage_ids, "logits": logits, "loss": loss, "tokens": tokens.tolist()}


@pytest.mark.parametrize("placement", ["v", "loop"])
def test_several_stages_per_rank_evaluate_and_generate_as_transformers(tmp_path, placement):
    """A tied 4-layer Llama in 4 stages over 2 ranks, placed in a V (rank 0
    holds stages 0 and 3: the embedding and its copy as LM head) or looped
    (rank 0: 0 and 2): the forward's logits and loss, and generate's
    tokens, those of transformers in one process."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(5)
    values = dict(LLAMA, num_hidden_layers=4, tie_word_embeddings=True)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**values)).float().eval()
    path = str(tmp_path / "tied4")
    hf.save_pretrained(path)
    ids = torch.randint(3, 96, (3, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[2, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        want = hf(ids, labels=ids)
        tokens = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    ranks = run_ranks(_stages_body, 2, path, placement, ids, mask)
    last = 0 if placement == "v" else 1
    placed = [[0, 3], [1, 2]] if placement == "v" else [[0, 2], [1, 3]]
    assert [r["stages"] for r in ranks] == placed
    got = ranks[last]
    torch.testing.assert_close(torch.tensor(got["logits"]), want.logits, rtol=1e-5, atol=1e-5)
    assert got["loss"] == pytest.approx(want.loss.item(), rel=1e-5)
    assert ranks[1 - last]["loss"] is None
    for r in ranks:
        assert r["tokens"] == tokens.tolist()
