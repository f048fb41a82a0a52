"""`perfx serve --parallel N` (``perfx.serve.batching``) driven by the official `openai` client from threads: every
answer of concurrent requests equals the answer the request gets alone (greedy, and sampled with a seed, each with
its own settings, stops and max tokens), nothing dropped with more requests than slots; a request joins while
others stream and leaves when done or when its client goes; the queue's 429, shutdown, and the CLI's
--parallel."""

import concurrent.futures
import json
import re
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import openai
import pytest

from helpers.family_models import family_tokenizer, make_family_model, write_family_gguf
from helpers.tiny_models import write_endless_gguf
from perfx import cli
from perfx.generate import SamplingConfig
from perfx.model import load_model
from perfx.serve.batching import PREFILL_PIECE, BatchEngine
from perfx.serve.engine import Engine
from perfx.serve.server import Server, ServeOptions

pytestmark = pytest.mark.one_implementation  # a server over a model: the default device only

MODEL = "tiny"
RECORDED = json.loads((Path(__file__).parent / "data" / "llamacpp_families.json").read_text())["families"]
TIMEOUT = 60  # seconds any one client call may take on a loaded machine

# (chat?, prompt, request settings): each its own sampling, stops and max tokens
REQUESTS = [
    (True, "question number one", {"max_tokens": 24, "temperature": 0}),
    (False, "Once upon a time", {"max_tokens": 17, "temperature": 0}),
    (True, "tell me a story about a dog and a cat", {"max_tokens": 30, "temperature": 0.9, "seed": 7}),
    (False, "A B C D", {"max_tokens": 12, "temperature": 0, "stop": ["e"]}),
    (True, "hello", {"max_tokens": 9, "temperature": 0.7, "seed": 3, "top_p": 0.8}),
    (True, "a longer prompt " * 20, {"max_tokens": 20, "temperature": 0, "frequency_penalty": 0}),
    (False, "The end", {"max_tokens": 5, "temperature": 0}),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A tiny random GGUF model (1024 positions) whose end-of-turn ids have zero rows in the lm_head: replies run
    until max_tokens or a stop string (as in test_serve.py)."""
    return write_endless_gguf(tmp_path_factory.mktemp("serve_batching"), MODEL, 1024)


@pytest.fixture(scope="module")
def loaded(tiny, opencl_device):
    model, source = load_model(tiny, opencl_device, progress=False)
    return model, source.tokenizer


@contextmanager
def running_server(engine):
    logs: list[str] = []
    options = ServeOptions(MODEL, default_max_tokens=16, log=logs.append)
    server = Server(("127.0.0.1", 0), engine, options)
    accepting = threading.Thread(target=server.serve_forever, daemon=True)
    accepting.start()
    try:
        server.logs = logs
        yield server
    finally:
        server.stop()
        accepting.join(TIMEOUT)


def client(server, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="unused",
                         timeout=TIMEOUT, **kwargs)


def ask(server, request, stream: bool = True, **client_options) -> tuple[str, str, int]:
    """(text, finish reason, completion tokens) of one request, streamed or not."""
    chat, prompt, settings = request
    api = client(server, **client_options)
    extra = {"stream_options": {"include_usage": True}} if stream else {}
    if chat:
        answer = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                             stream=stream, **extra, **settings)
    else:
        answer = api.completions.create(model=MODEL, prompt=prompt, stream=stream, **extra, **settings)
    if not stream:
        choice = answer.choices[0]
        return (choice.message.content if chat else choice.text), choice.finish_reason, answer.usage.completion_tokens
    chunks = list(answer)
    pieces = [(c.choices[0].delta.content if chat else c.choices[0].text) or "" for c in chunks if c.choices]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return "".join(pieces), reasons[-1], chunks[-1].usage.completion_tokens


def one_at_a_time(loaded) -> list[tuple[str, str, int]]:
    model, tokenizer = loaded
    with running_server(Engine(model, tokenizer, 16, SamplingConfig(seed=0))) as server:
        return [ask(server, request) for request in REQUESTS]


def test_concurrent_clients_get_what_each_gets_alone(loaded):
    """Seven requests from seven threads through three slots: each streamed answer is the one the request gets
    from the one-at-a-time server; every request completes."""
    alone = one_at_a_time(loaded)
    model, tokenizer = loaded
    engine = BatchEngine(model, tokenizer, 16, SamplingConfig(seed=0), parallel=3)
    with running_server(engine) as server:
        with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
            together = list(pool.map(lambda r: ask(server, r, stream=r[0]), REQUESTS, timeout=8 * TIMEOUT))
        stats = engine.stats()
    for request, got, want in zip(REQUESTS, together, alone):
        assert got == want, request
    assert (stats["completed"], stats["cancelled"], stats["failed"], stats["running"]) == (len(REQUESTS), 0, 0, 0)


class GatedBatch:
    """Holds each batched step until ``gate`` is set: requests stay running while the test acts."""

    def __init__(self, engine):
        self.gate, self.rows = threading.Event(), []
        step = engine.batch.step

        def gated(rows):
            assert self.gate.wait(TIMEOUT), "the test never opened the gate"
            self.rows.append(len(rows))
            return step(rows)
        engine.batch.step = gated


def test_a_request_joins_while_others_stream_and_a_gone_client_frees_its_slot(loaded):
    model, tokenizer = loaded
    engine = BatchEngine(model, tokenizer, 16, SamplingConfig(seed=0), parallel=2)
    gated = GatedBatch(engine)
    with running_server(engine) as server:
        api = client(server)
        long = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=900, stream=True)
        chunks = iter(long)
        next(chunks)                                           # the role chunk: running
        gated.gate.set()
        assert next(chunks).choices[0].delta.content is not None
        # a second request joins while the first streams, and finishes first
        joined = ask(server, REQUESTS[1])
        assert joined[1] == "length" and joined[2] == REQUESTS[1][2]["max_tokens"]
        assert 2 in gated.rows                                 # they were decoded together
        long.close()                                           # the first client goes away mid-stream
        assert engine.wait_for(lambda s: s["cancelled"] == 1 and s["running"] == 0, TIMEOUT)
        assert ask(server, REQUESTS[6])[1] == "length"         # its slot serves the next request
        stats = engine.stats()
        assert (stats["completed"], stats["cancelled"], stats["failed"]) == (2, 1, 0)
    cancelled = [line for line in server.logs if "(cancelled)" in line]
    assert len(cancelled) == 1 and int(re.search(r"completion (\d+)", cancelled[0])[1]) < 900, server.logs


def test_the_queue_limit_counts_every_slot_and_shutdown_stops_them_all(loaded):
    model, tokenizer = loaded
    engine = BatchEngine(model, tokenizer, 1, SamplingConfig(seed=0), parallel=2)
    gated = GatedBatch(engine)
    with running_server(engine) as server:
        api = client(server, max_retries=0)
        gated.gate.set()
        streams = [api.completions.create(model=MODEL, prompt=f"story {i}", max_tokens=900, stream=True)
                   for i in range(2)]
        for stream in streams:
            next(iter(stream))                                 # both streaming
        assert engine.wait_for(lambda s: s["running"] == 2, TIMEOUT)
        gated.gate.clear()                                     # both held at their next step
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # the answer itself, not the client's retry of a 503
            waiting = pool.submit(ask, server, REQUESTS[6], False, max_retries=0)
            assert engine.wait_for(lambda s: s["waiting"] == 1, TIMEOUT)
            with pytest.raises(openai.RateLimitError) as refused:
                api.completions.create(model=MODEL, prompt="one too many", max_tokens=3)
            assert "2 requests are running (--parallel 2) and 1 wait" in refused.value.response.json()["error"]["message"]
            # The stop begins with the steps held: a free-running tiny model finishes 900 tokens before a stop's
            # first half second (its wait for the accepting loop), and the waiting request would then run.
            stopping = threading.Thread(target=server.stop)
            stopping.start()                                   # every running request stopped, the waiting one 503
            with pytest.raises((openai.APIStatusError, openai.APIConnectionError)):
                waiting.result(TIMEOUT)
            gated.gate.set()                                   # the held step returns; the worker sees the stop
            stopping.join(TIMEOUT)
            assert not stopping.is_alive()
    stats = engine.stats()
    assert stats["rejected"] == 1 and stats["running"] == 0 and stats["cancelled"] == 3


def test_parallel_option(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--parallel N" in text and "Default auto: 4" in text
    assert "which is off with N > 1" in text
    assert cli.main(["serve", "--parallel", "0"]) == 2
    assert "--parallel must be a whole number ≥ 1 or auto, got '0'" in capsys.readouterr().err
    assert cli.main(["serve", "--parallel", "2", "--speculate", "lookup"]) == 2
    assert "runs with --parallel 1 only" in capsys.readouterr().err


def test_warm_up_and_engine_errors(loaded):
    model, tokenizer = loaded
    with pytest.raises(Exception, match="--parallel must be between 1 and"):
        BatchEngine(model, tokenizer, 4, SamplingConfig(), parallel=100_000)
    started = time.monotonic()
    engine = BatchEngine(model, tokenizer, 4, SamplingConfig(), parallel=2)
    engine.close()
    assert time.monotonic() - started < TIMEOUT and not engine.worker.is_alive()


def spied(engine) -> list[tuple[str, int]]:
    """The engine's prefills and steps, as they come: ("prefill", ids) and ("step", rows)."""
    calls = []
    prefill, step = engine.batch.prefill, engine.batch.step

    def spy_prefill(slot, tokens, start, logits=True):
        calls.append(("prefill", len(tokens)))
        return prefill(slot, tokens, start, logits)

    def spy_step(rows):
        calls.append(("step", len(rows)))
        return step(rows)
    engine.batch.prefill, engine.batch.step = spy_prefill, spy_step
    return calls


def test_a_long_prompt_is_prefilled_in_pieces_between_the_steps_of_running_streams(loaded):
    model, tokenizer = loaded
    engine = BatchEngine(model, tokenizer, 16, SamplingConfig(seed=0), parallel=2)
    calls = spied(engine)
    with running_server(engine) as server:
        api = client(server)
        streaming = api.completions.create(model=MODEL, prompt="go", max_tokens=600, stream=True)
        chunks = iter(streaming)
        next(chunks)
        calls.clear()
        long = ask(server, (False, "many words here " * 60, {"max_tokens": 3, "temperature": 0}), stream=False)
        assert long[2] == 3
        streaming.close()
    pieces = [n for kind, n in calls if kind == "prefill"]
    assert len(pieces) >= 3 and max(pieces) == PREFILL_PIECE, calls
    first, last = calls.index(("prefill", pieces[0])), len(calls) - calls[::-1].index(("prefill", pieces[-1])) - 1
    between = [kind for kind, _ in calls[first:last]]
    assert between.count("step") >= len(pieces) - 1, calls   # the running stream got a step after each piece


def test_short_prompts_waiting_together_join_the_next_step_together(loaded):
    """Prompts that wait together are prefilled, PREFILL_PIECE ids in all, before the next step, which then runs every
    one of them: not a step of one row, then two, then three, as when one prompt ran between two steps."""
    model, tokenizer = loaded
    engine = BatchEngine(model, tokenizer, 16, SamplingConfig(seed=0), parallel=4)
    calls = spied(engine)
    prompts = [tokenizer.encode(text) for text in ("alpha one", "bravo two two", "charlie", "delta four four four")]
    assert sum(map(len, prompts)) <= PREFILL_PIECE
    try:
        with engine.changed:   # (a reentrant lock) all four are waiting when the worker next looks
            jobs = [engine.job(ids, 5, {"temperature": 0}, []) for ids in prompts]
            for job in jobs:
                engine.submit(job)
        assert all(job.finished.wait(TIMEOUT) for job in jobs)
    finally:
        engine.close()
    first = calls.index(next(call for call in calls if call[0] == "step"))
    assert calls[:first + 1] == [("prefill", len(ids)) for ids in prompts] + [("step", 4)], calls
    assert [len(job.result.ids) for job in jobs] == [5] * 4


@pytest.mark.parametrize("family", ["lfm2", "qwen35"])
def test_hybrid_models_keep_each_request_s_recurrent_state(tmp_path, opencl_device, family):
    """LFM2's conv rings and Qwen3.5's Gated DeltaNet state per slot, through the server: three concurrent
    requests in two slots (one waits, then reuses a slot) answer what each answers alone."""
    settings = dict(RECORDED[family]["make_family_model"])
    made = make_family_model(settings.pop("family"), family_tokenizer(tmp_path, family),
                             np.random.default_rng(settings.pop("seed")), **settings)
    path = write_family_gguf(tmp_path / f"{family}.gguf", made, **RECORDED[family]["write_family_gguf"]).path
    model, source = load_model(str(path), opencl_device, ctx=256, progress=False)
    requests = [(False, text, {"max_tokens": 12, "temperature": 0}) for text in ("one two", "three", "four five six")]
    with running_server(Engine(model, source.tokenizer, 16, SamplingConfig(seed=0))) as server:
        alone = [ask(server, request, stream=False) for request in requests]
    engine = BatchEngine(model, source.tokenizer, 16, SamplingConfig(seed=0), parallel=2)
    with running_server(engine) as server:
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            together = list(pool.map(lambda r: ask(server, r, stream=False), requests, timeout=4 * TIMEOUT))
    assert together == alone and sum(tokens for _, _, tokens in alone) >= 2 * len(requests), alone
    assert engine.stats()["completed"] == len(requests)


@pytest.mark.slow
def test_the_default_model_answers_concurrent_chats_as_it_answers_each_alone(opencl_device):
    """The real default model, fp32 decode (``tuning=False``: the tuned int8-activation GEMVs of a request alone
    round its activations where the batched GEMMs do not, so greedy replies part at near-ties; docs/serve.md):
    six chats through four slots, each reply the one-at-a-time server's."""
    model, source = load_model("default", opencl_device, ctx=1024, progress=False, tuning=False)
    questions = ["How many legs does a spider have?", "What is the capital of France?", "Why is the sky blue?",
                 "Name a prime number larger than ten.", "Write a haiku about the sea.", "What do bees make?"]
    requests = [(True, question, {"max_tokens": 48, "temperature": 0}) for question in questions]
    with running_server(Engine(model, source.tokenizer, 16, SamplingConfig(seed=0))) as server:
        alone = [ask(server, request, stream=False) for request in requests]
    engine = BatchEngine(model, source.tokenizer, 16, SamplingConfig(seed=0), parallel=4)
    with running_server(engine) as server:
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            together = list(pool.map(lambda r: ask(server, r), requests, timeout=8 * TIMEOUT))
    assert together == alone
    assert "Paris" in alone[1][0]


def test_a_failed_request_fails_alone_and_its_slot_serves_the_next(loaded):
    model, tokenizer = loaded
    engine = BatchEngine(model, tokenizer, 16, SamplingConfig(seed=0), parallel=2)
    prefill = engine.batch.prefill

    def failing(slot, tokens, start, logits=True):
        if len(tokens) > 40:
            raise RuntimeError("a planted failure")
        return prefill(slot, tokens, start, logits)
    engine.batch.prefill = failing
    with running_server(engine) as server:
        api = client(server, max_retries=0)
        streaming = api.completions.create(model=MODEL, prompt="go on", max_tokens=200, stream=True)
        chunks = iter(streaming)
        next(chunks)
        with pytest.raises(openai.InternalServerError) as failed:
            api.completions.create(model=MODEL, prompt="word " * 60, max_tokens=3)
        assert "generation failed: RuntimeError: a planted failure" in failed.value.response.json()["error"]["message"]
        assert ask(server, REQUESTS[6], stream=False)[2] == REQUESTS[6][2]["max_tokens"]
        rest = list(chunks)
        assert rest[-1].choices[0].finish_reason == "length"    # the running stream, unharmed
    stats = engine.stats()
    assert (stats["completed"], stats["failed"]) == (2, 1)


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "legs", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "legs": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"enum": ["small", "big"]}, "maxItems": 3}}}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}}}}}


def test_constrained_requests_keep_their_grammars_while_decoded_together(loaded):
    """JSON-schema replies and forced tool calls from six threads through three slots, beside unconstrained
    requests: each constrained reply parses and validates (the tiny random model writes no JSON by itself, so
    that is the mask's work, applied per row), the unconstrained ones are unaffected."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    model, tokenizer = loaded
    engine = BatchEngine(model, tokenizer, 16, SamplingConfig(seed=0), parallel=3)
    schema_format = {"type": "json_schema", "json_schema": {"name": "animal", "schema": SCHEMA}}

    def structured(seed):
        reply = client(server).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"an animal {seed}"}], max_tokens=120,
            temperature=1.0, seed=seed, response_format=schema_format)
        return "schema", reply.choices[0]

    def called(seed):
        reply = client(server).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"weather {seed}"}], max_tokens=120,
            temperature=1.0, seed=seed, tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
        return "tool", reply.choices[0]

    def free(seed):
        return "free", ask(server, (True, f"free text {seed}", {"max_tokens": 12, "temperature": 0}))

    jobs = [structured, called, free] * 2
    with running_server(engine) as server:
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda job_seed: job_seed[0](job_seed[1]), zip(jobs, range(len(jobs))),
                                    timeout=8 * TIMEOUT))
    for kind, choice in results:
        if kind == "schema":
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        elif kind == "tool":
            assert choice.finish_reason == "tool_calls", choice
            (call,) = choice.message.tool_calls
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])
        else:
            assert choice[1] == "length" and choice[2] == 12


def test_logprobs_of_concurrent_requests_equal_those_of_each_alone(loaded):
    """Log-probabilities come from each row of a batched step's logits: within the batched-vs-alone rounding
    (tests/test_batch.py's 1e-4, relative to the largest logit: 10 here bounds the tiny model's), the ones the
    request gets alone, from the one-at-a-time server's host path."""
    model, tokenizer = loaded
    settings = [("hello", 0), ("tell me a story", 3), ("question number one", 1)]

    def logprobs(server, prompt, top):
        answer = client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                        max_tokens=8, temperature=0, logprobs=True, top_logprobs=top)
        return [(e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in answer.choices[0].logprobs.content]

    with running_server(Engine(model, tokenizer, 16, SamplingConfig(seed=0))) as server:
        alone = [logprobs(server, *s) for s in settings]
    with running_server(BatchEngine(model, tokenizer, 16, SamplingConfig(seed=0), parallel=3)) as server:
        with concurrent.futures.ThreadPoolExecutor(len(settings)) as pool:
            together = list(pool.map(lambda s: logprobs(server, *s), settings, timeout=4 * TIMEOUT))
    for (_, top), got, want in zip(settings, together, alone):
        assert [t for t, _, _ in got] == [t for t, _, _ in want] and len(got) == 8
        for (_, lp, tops), (_, lp_alone, tops_alone) in zip(got, want):
            assert len(tops) == top
            assert abs(lp - lp_alone) <= 10 * 1e-4 and np.allclose(tops, tops_alone, atol=10 * 1e-4)


def test_logit_bias_holds_for_a_request_decoded_with_others(loaded):
    model, tokenizer = loaded
    forced = tokenizer.encode("a")[-1]
    with running_server(BatchEngine(model, tokenizer, 16, SamplingConfig(seed=0), parallel=2)) as server:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            other = pool.submit(ask, server, REQUESTS[0])
            biased = client(server).completions.create(model=MODEL, prompt="Once upon", max_tokens=6, temperature=1,
                                                       seed=4, logit_bias={str(forced): 100})
            assert other.result(TIMEOUT)[1] == "length"
    assert biased.choices[0].text == tokenizer.decode([forced] * 6)


def spy_prefills(engine) -> list[int]:
    """The number of ids of each prefill the engine's batch runs, from now on."""
    prefilled = []
    prefill = engine.batch.prefill

    def spy(slot, tokens, start, logits=True):
        prefilled.append(len(tokens))
        return prefill(slot, tokens, start, logits)
    engine.batch.prefill = spy
    return prefilled


def test_n_choices_decode_together_from_one_prefill(loaded):
    """n > 1 through three slots: the prompt is prefilled once, the other choices get its state copied on the device,
    and the choices decode together (steps of 3 rows, their streamed chunks interleaved, each naming its index).
    Greedy, every choice is the reply of the request alone; sampled, choice i is what a request with the seed plus
    i gets alone, and the same request twice gives the same choices. Log-probabilities come with each choice."""
    model, tokenizer = loaded
    engine = BatchEngine(model, tokenizer, 16, SamplingConfig(seed=0), parallel=3)
    prefilled, gated = spy_prefills(engine), GatedBatch(engine)
    gated.gate.set()

    def question(text):
        return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 10}

    with running_server(engine) as server:
        api = client(server)
        greedy = api.chat.completions.create(temperature=0, n=3, **question("one prompt, three choices"))
        assert prefilled == [len(tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "user", "content": "one prompt, three choices"}]), add_bos=tokenizer.add_bos_token))]
        assert gated.rows.count(3) == 9 and set(gated.rows) == {3}     # the first token comes from the prompt
        assert [c.index for c in greedy.choices] == [0, 1, 2]
        assert greedy.usage.completion_tokens == 30 and greedy.usage.prompt_tokens == prefilled[0]
        alone = api.chat.completions.create(temperature=0, **question("one prompt, three choices"))
        assert [c.message.content for c in greedy.choices] == [alone.choices[0].message.content] * 3

        prefilled.clear()
        sampled = question("sampled choices")
        first = api.chat.completions.create(temperature=1, seed=11, n=3, **sampled)
        texts = [c.message.content for c in first.choices]
        assert len(prefilled) == 1 and len(set(texts)) > 1
        again = api.chat.completions.create(temperature=1, seed=11, n=3, **sampled)
        assert [c.message.content for c in again.choices] == texts
        assert texts == [api.chat.completions.create(temperature=1, seed=11 + i, **sampled).choices[0].message.content
                         for i in range(3)]

        chunks = list(api.chat.completions.create(temperature=1, seed=11, n=3, stream=True,
                                                  stream_options={"include_usage": True}, **sampled))
        streamed, order = {}, []
        for chunk in chunks:
            for choice in chunk.choices:
                streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
                if choice.delta.content:
                    order.append(choice.index)
        assert [streamed[i] for i in range(3)] == texts
        assert order != sorted(order)                                   # interleaved: decoded together
        assert chunks[-1].usage.completion_tokens == 30

        scored = api.completions.create(model=MODEL, prompt="scored choices", max_tokens=4, temperature=0, n=2,
                                        logprobs=3)
        tokens = [c.logprobs.tokens for c in scored.choices]
        assert tokens[0] == tokens[1] and len(tokens[0]) == 4
        assert np.allclose(scored.choices[0].logprobs.token_logprobs, scored.choices[1].logprobs.token_logprobs)
    assert engine.stats()["completed"] == 3 + 1 + 3 + 3 + 3 + 3 + 2


@pytest.mark.parametrize("family", ["lfm2", "qwen35"])
def test_n_choices_of_hybrid_models_share_their_recurrent_state(tmp_path, opencl_device, family):
    """LFM2's conv rings and Qwen3.5's Gated DeltaNet state at the prompt's end copied into the other choices'
    slots; a choice that waits for a slot (n = 3 through 2) runs the prompt itself, as a recurrent state has moved on
    by then (LFM2's ring still holds the prompt's last ids: one is prefilled); one at a time (the default engine),
    a restore point at the prompt's end serves the later choices. Greedy, every choice is the reply alone."""
    settings = dict(RECORDED[family]["make_family_model"])
    made = make_family_model(settings.pop("family"), family_tokenizer(tmp_path, family),
                             np.random.default_rng(settings.pop("seed")), **settings)
    path = write_family_gguf(tmp_path / f"{family}.gguf", made, **RECORDED[family]["write_family_gguf"]).path
    model, source = load_model(str(path), opencl_device, ctx=256, progress=False)
    prompt = source.tokenizer.encode("one two three four", add_bos=source.tokenizer.add_bos_token)
    request = {"model": MODEL, "prompt": "one two three four", "max_tokens": 8, "temperature": 0}
    prefilled = []
    prefill = model.prefill
    model.prefill = lambda tokens, start: prefilled.append(len(tokens)) or prefill(tokens, start)
    with running_server(Engine(model, source.tokenizer, 16, SamplingConfig(seed=0))) as server:
        alone = client(server).completions.create(**request).choices[0].text
    prefilled.clear()
    with running_server(Engine(model, source.tokenizer, 16, SamplingConfig(seed=0))) as server:
        one_at_a_time = client(server).completions.create(n=3, **request)
    del model.prefill
    assert [c.text for c in one_at_a_time.choices] == [alone] * 3
    assert prefilled == [len(prompt) - 1, 1, 1, 1]     # the first choice's prompt split at its restore point
    engine = BatchEngine(model, source.tokenizer, 16, SamplingConfig(seed=0), parallel=2)
    prefilled = spy_prefills(engine)
    with running_server(engine) as server:
        together = client(server).completions.create(n=3, **request)
    assert [c.text for c in together.choices] == [alone] * 3
    assert prefilled[0] == len(prompt) and prefilled[1:] == ([1] if family == "lfm2" else [len(prompt)])


def test_choices_waiting_for_a_failed_prompt_run_it_once_themselves(loaded):
    """The choice running the prompt fails: the choices that waited for it are not left waiting; the first of them
    runs the prompt, the other takes it from there, and both answer as the request alone does."""
    model, tokenizer = loaded
    engine = BatchEngine(model, tokenizer, 16, SamplingConfig(seed=0), parallel=3)
    prefill, calls = engine.batch.prefill, []

    def failing_once(slot, tokens, start, logits=True):
        calls.append(len(tokens))
        if len(calls) == 1:
            raise RuntimeError("a planted failure")
        return prefill(slot, tokens, start, logits)
    engine.batch.prefill = failing_once
    ids = tokenizer.encode("three choices")
    try:
        jobs = [engine.job(ids, 6, {"temperature": 0}, [], choices=3) for _ in range(3)]
        engine.submit(*jobs)
        assert all(job.finished.wait(TIMEOUT) for job in jobs)
        alone = engine.job(ids, 6, {"temperature": 0}, [])
        engine.submit(alone)
        assert alone.finished.wait(TIMEOUT)
    finally:
        engine.close()
    assert calls[:2] == [len(ids), len(ids)] and len(calls) == 3    # the failure, its one rerun, then alone's
    assert jobs[0].result is None and "a planted failure" in str(drain(jobs[0])[-1][1])
    assert [job.result.ids for job in jobs[1:]] == [alone.result.ids] * 2 and len(alone.result.ids) == 6
    assert engine.stats()["failed"] == 1 and engine.stats()["completed"] == 3


def drain(job) -> list[tuple]:
    events = []
    while not job.events.empty():
        events.append(job.events.get())
    return events


def test_a_shared_system_prompt_is_copied_from_the_slot_that_ran_it(loaded):
    """A request whose prompt starts as a running request's does (one system prompt) takes that prefix from the
    other slot's KV cache, copied on the device, and prefills only the rest; usage counts the copied ids as
    cached, and the reply is the request's reply alone."""
    model, tokenizer = loaded
    system = {"role": "system", "content": "you are a tiny model that answers every question with many words " * 3}
    questions = [[system, {"role": "user", "content": text}] for text in ("first question", "second one")]
    ids = [tokenizer.encode(tokenizer.apply_chat_template(q), add_bos=tokenizer.add_bos_token) for q in questions]
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    assert shared > 30
    with running_server(Engine(model, tokenizer, 16, SamplingConfig(seed=0))) as server:
        alone = client(server).chat.completions.create(model=MODEL, messages=questions[1], max_tokens=6,
                                                      temperature=0).choices[0].message.content
    engine = BatchEngine(model, tokenizer, 16, SamplingConfig(seed=0), parallel=2)
    prefilled = spy_prefills(engine)
    with running_server(engine) as server:
        api = client(server)
        running = api.chat.completions.create(model=MODEL, messages=questions[0], max_tokens=600, stream=True)
        chunks = iter(running)
        next(chunks)
        next(chunks)                                            # its prompt has run
        prefilled.clear()
        reply = api.chat.completions.create(model=MODEL, messages=questions[1], max_tokens=6, temperature=0)
        running.close()
    assert prefilled == [len(ids[1]) - shared]
    assert reply.usage.prompt_tokens_details.cached_tokens == shared
    assert reply.choices[0].message.content == alone


def test_a_prefix_is_taken_only_from_positions_a_slot_has_run_for_its_new_prompt(loaded):
    """Two requests admitted together: the first into the slot that holds a longer conversation (so it prefills
    from the end of their shared start), the second into a fresh slot, sharing more with the first's prompt. The
    first's slot holds the old conversation's rows past that start until it runs there, so the second takes only
    the shared start from it and prefills the rest: its reply is its reply alone."""
    model, tokenizer = loaded
    start = tokenizer.encode("a shared start, then")
    old, first, second = (start + tokenizer.encode(text, add_bos=False)
                          for text in (" something else entirely", " one more thing: A", " one more thing: B"))
    engine = BatchEngine(model, tokenizer, 16, SamplingConfig(seed=0), parallel=2)
    prefilled = spy_prefills(engine)
    try:
        before = engine.job(old, 4, {"temperature": 0}, [])
        engine.submit(before)
        assert before.finished.wait(TIMEOUT)
        prefilled.clear()
        jobs = [engine.job(ids, 6, {"temperature": 0}, []) for ids in (first, second)]
        with engine.changed:     # queued at once: admitted in one loop, neither prompt run yet
            engine.waiting.extend(jobs)
            engine.changed.notify_all()
        assert all(job.finished.wait(TIMEOUT) for job in jobs)
    finally:
        engine.close()
    shared = len(start) + next(i for i, (a, b) in enumerate(zip(old[len(start):], first[len(start):])) if a != b)
    assert prefilled == [len(first) - shared, len(second) - shared], prefilled
    assert [job.cached_tokens for job in jobs] == [shared, shared]
    alone = Engine(model, tokenizer, 16, SamplingConfig(seed=0))
    try:
        single = alone.job(second, 6, {"temperature": 0}, [])
        alone.submit(single)
        assert single.finished.wait(TIMEOUT)
    finally:
        alone.close()
    assert jobs[1].result.ids == single.result.ids
