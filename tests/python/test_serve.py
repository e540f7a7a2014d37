"""``python -m dsparallel.serve`` at tp 2 under torchrun, driven by the real
``openai`` client, against ``transformers``' ``generate``.

A tiny random Llama and DeepSeek-V3 (weights drawn wider than usual, so
that greedy decoding does not settle on one token) share a byte-level BPE
tokenizer trained on the docs and a chat template. Every greedy choice,
streamed or not, alone or among 8 clients that start at different times,
must be ``transformers``' tokens for its prompt, token for token
(``return_token_ids``). The pool is small enough that the long request
beside the short ones makes sequences wait and be preempted. In one
process: the paged cache against ``generate`` under preemption, and the
queue bound's 429.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch
from dist_utils import free_port
from test_models import DEEPSEEK, LLAMA

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CONTEXT = 256
BLOCKS = 20  # of 16 positions: 320, less than the long test's requests need together


def _checkpoint(root, kind: str):
    from dsparallel.train.tokenizer import train_tokenizer

    tok_dir = str(root / "tokenizer")
    train_tokenizer(sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))), 384, tok_dir)
    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    tok.chat_template = TEMPLATE
    eos = tok.eos_token_id
    base = LLAMA if kind == "llama" else DEEPSEEK
    values = dict(
        base,
        # One more than the tokenizer's 384: a vocabulary tp 2 does not
        # divide, padded inside the embedding and head.
        vocab_size=len(tok) + 1,
        max_position_embeddings=CONTEXT,
        eos_token_id=eos,
        bos_token_id=eos,
        initializer_range=0.1,
    )
    torch.manual_seed(3)
    if kind == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**values))
    else:
        hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**values))
    hf = hf.float().eval()
    path = str(root / kind)
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    # The checkpoint's defaults: greedy unless a request samples.
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"do_sample": False, "eos_token_id": eos, "bos_token_id": eos}, f)
    return path, hf, tok


def _greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=hf.config.eos_token_id,
            pad_token_id=hf.config.eos_token_id,
        )
    return out[0, len(prompt) :].tolist()


def _health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def _server(path: str, *extra: str, tp: int = 2, pp: int = 1):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(tp * pp),
        "--master-port",
        str(free_port()),
        "-m",
        "dsparallel.serve",
        "--model",
        path,
        "--tensor-parallel",
        str(tp),
        "--pipeline-parallel",
        str(pp),
        "--port",
        str(port),
        "--num-blocks",
        str(BLOCKS),
        *extra,
    ]
    log = open(os.path.join(os.path.dirname(path), f"server-{port}.log"), "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                _health(url)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    pytest.fail(f"the server did not start:\n{log.read()[-4000:]}")
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path, hf, tok = _checkpoint(tmp_path_factory.mktemp("serve"), "llama")
    with _server(path) as url:
        yield url, hf, tok


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=g)
    return [torch.randint(1, 384, (int(k),), generator=g).tolist() for k in lengths]


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_greedy_completions_equal_transformers(llama):
    url, hf, tok = llama
    client = _client(url)
    for prompt in _prompts(3):
        want = _greedy(hf, prompt, 12)
        out = client.completions.create(
            model="llama",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        assert _ids(out.choices[0]) == want
        assert out.choices[0].text == tok.decode(want, skip_special_tokens=True)
        assert out.usage.prompt_tokens == len(prompt)
        assert out.usage.completion_tokens == len(want)
        streamed = client.completions.create(
            model="llama",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
        )
        ids, text = [], ""
        for chunk in streamed:
            ids += _ids(chunk.choices[0])
            text += chunk.choices[0].text
        assert ids == want and text == out.choices[0].text
    # No temperature: generation_config.json's do_sample false makes it greedy.
    prompt = _prompts(1, seed=12)[0]
    out = client.completions.create(
        model="llama", prompt=prompt, max_tokens=12, extra_body={"return_token_ids": True}
    )
    assert _ids(out.choices[0]) == _greedy(hf, prompt, 12)


def test_chat_uses_the_template(llama):
    url, hf, tok = llama
    messages = [{"role": "user", "content": "How do I split a model?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    want = _greedy(hf, prompt, 10)
    client = _client(url)
    out = client.chat.completions.create(
        model="llama",
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert _ids(out.choices[0]) == want
    assert out.usage.prompt_tokens == len(prompt)
    parts = client.chat.completions.create(
        model="llama", messages=messages, max_tokens=10, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert text == out.choices[0].message.content


def _concurrent(url, jobs):
    """Runs each (delay, kwargs) in its own thread and client; the generated
    ids of each (or its exception) in job order."""
    results = [None] * len(jobs)

    def run(i, delay, kwargs):
        time.sleep(delay)
        try:
            out = _client(url).completions.create(**kwargs)
            if kwargs.get("stream"):
                results[i] = [t for chunk in out for t in _ids(chunk.choices[0])]
            else:
                results[i] = _ids(out.choices[0])
        except Exception as e:  # noqa: BLE001 -- reported by the test
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results


def _greedy_clients(url, hf, model, prompts, tokens, spacing, streamed=lambda i: False):
    """One client a prompt, the i-th starting ``spacing`` x i seconds in (the
    ones ``streamed(i)`` streamed), each greedy output held to
    ``transformers``'; returns the outputs."""
    jobs = [
        (
            spacing * i,
            dict(
                model=model,
                prompt=p,
                max_tokens=n,
                temperature=0,
                stream=streamed(i),
                extra_body={"return_token_ids": True},
            ),
        )
        for i, (p, n) in enumerate(zip(prompts, tokens))
    ]
    results = _concurrent(url, jobs)
    for prompt, n, out in zip(prompts, tokens, results):
        assert not isinstance(out, Exception), out
        assert out == _greedy(hf, prompt, n)
    return results


def test_eight_concurrent_clients_keep_every_greedy_output(llama):
    url, hf, _ = llama
    prompts = _prompts(8, seed=1)
    tokens = [16 + 3 * i for i in range(8)]
    before = _health(url)["steps"]
    results = _greedy_clients(url, hf, "llama", prompts, tokens, 0.03, lambda i: i % 2 == 1)
    # Batched: fewer steps than the tokens generated one request at a time.
    steps = _health(url)["steps"] - before
    assert steps < sum(len(r) for r in results)


def test_a_long_request_beside_many_short_ones(llama):
    """The pool (320 positions) cannot hold these together: sequences wait
    for blocks or are preempted and recomputed, and every output stays
    ``transformers``'; the pool is whole again after."""
    url, hf, _ = llama
    g = torch.Generator().manual_seed(5)
    long_prompt = torch.randint(1, 384, (150,), generator=g).tolist()
    jobs = [
        (
            0.0,
            dict(
                model="llama",
                prompt=long_prompt,
                max_tokens=90,
                temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            ),
        )
    ]
    shorts = _prompts(6, seed=6)
    jobs += [
        (
            0.01 * i,
            dict(
                model="llama",
                prompt=p,
                max_tokens=60,
                temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            ),
        )
        for i, p in enumerate(shorts)
    ]
    before = _health(url)["preemptions"]
    results = _concurrent(url, jobs)
    assert _health(url)["preemptions"] > before
    for (_, kwargs), out in zip(jobs, results):
        assert not isinstance(out, Exception), out
        prompt, n = kwargs["prompt"], kwargs["max_tokens"]
        with torch.no_grad():
            want = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=n,
                do_sample=False,
                min_new_tokens=n,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert out == want
    _wait_pool_whole(url)


def _wait_pool_whole(url):
    deadline = time.monotonic() + 30
    while True:
        h = _health(url)
        if h["kv_blocks_free"] == h["kv_blocks"] and h["running"] == 0 and h["waiting"] == 0:
            return
        assert time.monotonic() < deadline, f"the pool did not return to full: {h}"
        time.sleep(0.2)


def test_stop_strings_n_and_seeded_sampling(llama):
    url, hf, tok = llama
    client = _client(url)
    prompt = _prompts(1, seed=9)[0]
    whole = (
        client.completions.create(
            model="llama",
            prompt=prompt,
            max_tokens=20,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    assert len(whole) > 6
    stop = whole[3:5]
    cut = client.completions.create(
        model="llama",
        prompt=prompt,
        max_tokens=20,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
        stream=True,
    )
    chunks = list(cut)
    assert "".join(c.choices[0].text for c in chunks) == whole[: whole.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"

    def sampled(seed):
        out = client.completions.create(
            model="llama",
            prompt=prompt,
            max_tokens=15,
            temperature=0.9,
            top_p=0.95,
            n=3,
            seed=seed,
            extra_body={"top_k": 50, "return_token_ids": True},
        )
        return [_ids(c) for c in sorted(out.choices, key=lambda c: c.index)]

    first = sampled(11)
    assert len(first) == 3
    assert sampled(11) == first  # reproducible, whatever else runs
    assert sampled(12) != first


def test_bad_requests_get_errors_and_the_server_goes_on(llama):
    url, hf, _ = llama
    client = _client(url)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context of 256"):
        client.completions.create(model="llama", prompt=[5] * 250, max_tokens=10)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="llama", prompt="hi", max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model="llama", prompt=[100000], max_tokens=2)
    request = urllib.request.Request(
        url + "/v1/completions", data=b"{not json", headers={"content-type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=10)
    assert e.value.code == 400 and "not valid JSON" in e.value.read().decode()
    prompt = _prompts(1, seed=2)[0]
    out = client.completions.create(
        model="llama",
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert _ids(out.choices[0]) == _greedy(hf, prompt, 5)


def test_a_client_that_disconnects_frees_its_blocks(llama):
    url, _, _ = llama
    body = json.dumps(
        {
            "prompt": _prompts(1, seed=3)[0],
            "max_tokens": 200,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    request = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    response = urllib.request.urlopen(request, timeout=30)
    assert response.readline().startswith(b"data: ")
    assert _health(url)["kv_blocks_free"] < BLOCKS  # it holds blocks now
    response.close()
    _wait_pool_whole(url)
    assert _health(url)["status"] == "ok"


def test_deepseek_v3_greedy_streamed_and_concurrent(tmp_path_factory):
    path, hf, _ = _checkpoint(tmp_path_factory.mktemp("serve-ds"), "deepseek")
    prompts = _prompts(4, seed=4)
    with _server(path) as url:
        results = _greedy_clients(url, hf, "deepseek", prompts, [10] * len(prompts), 0.2)
        streamed = _client(url).completions.create(
            model="deepseek",
            prompt=prompts[0],
            max_tokens=10,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
        )
        assert [t for c in streamed for t in _ids(c.choices[0])] == results[0]
        _wait_pool_whole(url)


@pytest.mark.parametrize(
    "kind,dtype",
    [
        ("llama", torch.float32),
        ("deepseek", torch.float32),
        ("gpt2", torch.float32),
        ("llama", torch.bfloat16),
        ("deepseek", torch.bfloat16),
    ],
)
def test_paged_engine_equals_generate_under_preemption(tmp_path, kind, dtype):
    """One process, no HTTP: four prompts through a pool of 12 blocks of 4
    positions (they need 69 together) and steps of 7 tokens, so prefills
    are chunked, sequences wait and are preempted; each greedy output is
    ``transformers``' in float32, and in bfloat16 our own ``generate``'s
    (the dense cache, the same bfloat16 kernels)."""
    from test_models import _hf_model

    from dsparallel.inference import generate
    from dsparallel.inference.paged import BlockPool
    from dsparallel.models import from_pretrained
    from dsparallel.serve import Engine, SamplingParams

    torch.manual_seed(20)
    hf = _hf_model(kind).float().eval()
    hf.save_pretrained(tmp_path)
    model = from_pretrained(str(tmp_path), dtype=dtype)
    pool = BlockPool(model, 12, 4, dtype)
    engine = Engine(model, None, pool, max_model_len=64, max_num_batched_tokens=7)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]
    got = {i: [] for i in range(len(prompts))}
    done = threading.Semaphore(0)

    def sink_of(i):
        def sink(event):
            got[i].extend(event.token_ids)
            if event.finish_reason:
                done.release()

        return sink

    engine.start()
    try:
        for i, p in enumerate(prompts):
            engine.submit(p, SamplingParams(max_tokens=10, temperature=0), sink_of(i))
        for _ in prompts:
            assert done.acquire(timeout=60)
    finally:
        engine.stop()
    assert engine.preemptions > 0
    assert pool.num_free == pool.num_blocks
    for i, p in enumerate(prompts):
        if dtype == torch.float32:
            with torch.no_grad():
                want = hf.generate(
                    torch.tensor([p]),
                    max_new_tokens=10,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
        else:
            want = generate(model, torch.tensor([p]), max_new_tokens=10)
        assert got[i] == want[0, len(p) :].tolist()


def test_a_full_queue_answers_429(tmp_path):
    from fastapi.testclient import TestClient
    from test_models import _hf_model

    from dsparallel.inference.paged import BlockPool
    from dsparallel.models import from_pretrained
    from dsparallel.serve import Engine
    from dsparallel.serve.api import Server, make_app

    _hf_model("llama").save_pretrained(tmp_path)
    model = from_pretrained(str(tmp_path))
    engine = Engine(
        model, None, BlockPool(model, 4, 4, torch.float32), max_model_len=16, max_waiting=0
    )
    client = TestClient(make_app(Server(engine, None, "tiny", {})))
    r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 429
    assert r.json()["error"]["type"] == "rate_limit_error"
    r = client.post("/v1/completions", json={"prompt": "words", "max_tokens": 2})
    assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2, "n": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def _int8_against_float32(rank, world, path):
    import dsparallel
    from dsparallel.inference import KVCache, generate
    from dsparallel.inference.fast_linear import fast_decoding, quantize_int8
    from dsparallel.models import from_pretrained

    state = dsparallel.init_parallel(tensor_parallel_size=world) if world > 1 else None
    model = from_pretrained(path, state).eval()
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12)[None].expand(2, -1)

    def last_logits():
        cache = KVCache(model, 2, 12, torch.float32)
        with fast_decoding(model):
            return model.cached_step(ids, positions, None, cache.layers, 0)

    ref, greedy = last_logits(), generate(model, ids, max_new_tokens=12)
    saved = quantize_int8(model)
    got, greedy_int8 = last_logits(), generate(model, ids, max_new_tokens=12)
    if state is not None:
        dsparallel.destroy_parallel()
    error = float((got - ref).abs().max() / ref.abs().max())
    return saved, len(model._int8_weights), error, torch.equal(greedy, greedy_int8)


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
@pytest.mark.parametrize("world", [1, 2])
def test_int8_logits_within_tolerance_of_float32(tmp_path, kind, world):
    """Int8 weight-only decoding: the last position's logits within 3% (of
    the largest logit) of float32's, and greedy decoding of the test
    prompts unchanged; the linear weights are quantized, the embedding
    and DeepSeek-V3's kv_b (read in einsums) are not."""
    from dist_utils import run_ranks
    from test_models import _hf_model

    torch.manual_seed(20)
    _hf_model(kind).float().save_pretrained(tmp_path)
    for saved, quantized, error, same in run_ranks(
        _int8_against_float32, world, str(tmp_path), timeout=120
    ):
        assert saved > 0 and quantized >= 9
        assert error < 0.03, error
        assert same


def test_pipeline_parallel_serving_equals_transformers(tmp_path_factory):
    """pp 2: each step's sequences split into two micro-batches in flight
    through the two stages; greedy outputs of 6 concurrent clients (one
    streamed) are ``transformers``'."""
    path, hf, _ = _checkpoint(tmp_path_factory.mktemp("serve-pp"), "llama")
    prompts = _prompts(6, seed=8)
    with _server(path, tp=1, pp=2) as url:
        health = _health(url)
        assert (health["tensor_parallel"], health["pipeline_parallel"]) == (1, 2)
        _greedy_clients(url, hf, "llama", prompts, [12] * len(prompts), 0.02, lambda i: i == 0)
        _wait_pool_whole(url)
