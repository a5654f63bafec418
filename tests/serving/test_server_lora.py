"""LoRA adapters through the server and the official `openai` client, on a tiny random SmolLM2-shaped
Llama with random PEFT adapters: each adapter is named by `model` (completions and chat, streamed or
not) and answers the greedy tokens the offline LLM gives with the same adapter (test_lora_engine.py
checks those against PEFT); /v1/models lists the adapters under the base; adapters are loaded and
unloaded at run time without a compile; an unknown name is vLLM's 404; an adapter a request uses is not
unloaded; vllm:lora_requests_info and the dashboard name the adapters of running requests."""

import json
import time

import httpx
import openai
import pytest
import transformers
from prometheus_client.parser import text_string_to_metric_families

from conftest import make_peft_adapter, running_server
from paged_jax import LLM, EngineConfig, LLMEngine, LoRARequest, SamplingParams
from paged_jax.serving.lora_modules import RUNTIME_UPDATING_ENV, LoRAModulePath
from paged_jax.serving.server import ServerConfig, build_app
from server_client import TIMEOUT, metrics, wait_for_idle, wait_until_ready

BASE = "tiny-base"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
ADAPTERS = {  # name -> PEFT LoraConfig: different ranks and targets
    "sql": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
    "poem": dict(r=16, lora_alpha=8, use_rslora=True,
                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "late": dict(r=4, lora_alpha=8, target_modules=["o_proj", "gate_proj"]),  # loaded at run time
}
ENGINE = dict(block_size=8, num_blocks=256, max_num_seqs=4, max_model_len=256, enable_lora=True, max_loras=2,
              max_lora_rank=16, max_cpu_loras=3)


@pytest.fixture(scope="module")
def setup(tiny_chat_folder, tiny_chat_model, tmp_path_factory):
    """(the loaded tiny model, {name: adapter folder})."""
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_chat_folder).eval()
    paths = {}
    for seed, (name, spec) in enumerate(ADAPTERS.items(), start=5):
        paths[name] = tmp_path_factory.mktemp(name)
        make_peft_adapter(hf_model, paths[name], seed, **spec)
    return tiny_chat_model, {name: str(path) for name, path in paths.items()}


def make_engine(loaded) -> LLMEngine:
    return LLMEngine(loaded.model, loaded.config, loaded.tokenizer, EngineConfig(**ENGINE))


@pytest.fixture(scope="module")
def server(setup):
    """(base URL, the engine behind it)."""
    loaded, paths = setup
    engine = make_engine(loaded)
    config = ServerConfig(served_model_name=BASE, model="/models/tiny", allow_runtime_lora_updating=True,
                          lora_modules=(LoRAModulePath("sql", paths["sql"]), LoRAModulePath.parse(
                              f'{{"name": "poem", "path": "{paths["poem"]}", "base_model_name": "{BASE}"}}')))
    with running_server(build_app(engine, config)) as url:
        wait_until_ready(url)
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def offline(setup):
    """name (None: the base) -> the greedy text of PROMPT and of MESSAGES from the offline LLM."""
    loaded, paths = setup
    llm = LLM.from_engine(make_engine(loaded))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    requests = [None, *(LoRARequest(name, i, path) for i, (name, path) in enumerate(paths.items(), start=1))]
    chat_ids = llm.chat_prompt(MESSAGES)
    texts = llm.generate([PROMPT] * len(requests), params, lora_request=requests, use_tqdm=False)
    chats = llm.generate([chat_ids] * len(requests), params, lora_request=requests, use_tqdm=False)
    return {None if r is None else r.lora_name: (t.outputs[0].text, c.outputs[0].text)
            for r, t, c in zip(requests, texts, chats)}


def complete(client, model: str, stream: bool = False) -> str:
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    if stream:
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    return client.completions.create(**kwargs).choices[0].text


def chat(client, model: str, stream: bool = False) -> str:
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs))
    return client.chat.completions.create(**kwargs).choices[0].message.content


def num_compiles(url: str) -> float:
    return metrics(url)["paged_jax:num_compiles_total"]


def dashboard_adapters(url: str) -> list:
    """The adapters of the sequences in the first dashboard state that shows the pool (its snapshot comes
    from the engine loop once a page asks: streams are read until one does, each ending after a few s)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with httpx.stream("GET", f"{url}/dashboard/events", timeout=TIMEOUT) as events:
            for line in events.iter_lines():
                if line.startswith("data: ") and (pool := json.loads(line[6:])["pool"]) is not None:
                    return [s["adapter"] for s in pool["seqs"]]
    raise AssertionError("no dashboard state showed the pool")


def test_models_lists_each_adapter_under_the_base(client, setup):
    _, paths = setup
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [BASE, "sql", "poem"]
    assert cards[BASE].parent is None and cards[BASE].root == "/models/tiny"
    assert [(cards[n].parent, cards[n].root) for n in ("sql", "poem")] == [(BASE, paths["sql"]), (BASE, paths["poem"])]


def test_model_picks_the_adapter_streamed_or_not_as_offline(server, client, offline):
    compiled = num_compiles(server[0])
    for name in (BASE, "sql", "poem"):
        text, chat_text = offline[None if name == BASE else name]
        for stream in (False, True):
            assert complete(client, name, stream) == text, (name, stream)
            assert chat(client, name, stream) == chat_text, (name, stream)
    response = client.completions.create(model="sql", prompt=PROMPT, max_tokens=2, temperature=0)
    assert response.model == "sql"
    # The adapters change the answer: a server that ran the base model for every name would fail above.
    assert len({offline[n][0] for n in (None, "sql", "poem")}) == 3
    assert num_compiles(server[0]) == compiled


def test_unknown_model_is_vllms_404(server, client):
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    r = httpx.post(f"{server[0]}/v1/chat/completions", json={"model": "nope", "messages": MESSAGES}, timeout=TIMEOUT)
    assert r.status_code == 404
    assert r.json()["error"] | {"message": None} == {"message": None, "type": "NotFoundError", "param": "model",
                                                       "code": 404}


def test_load_and_unload_at_run_time_without_a_compile(server, client, offline, setup):
    url, _ = server
    _, paths = setup
    compiled = num_compiles(url)
    load = lambda body: httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=TIMEOUT)
    unload = lambda body: httpx.post(f"{url}/v1/unload_lora_adapter", json=body, timeout=TIMEOUT)

    r = load({"lora_name": "late", "lora_path": paths["late"]})
    assert r.status_code == 200 and "late" in r.text
    assert [m.id for m in client.models.list().data] == [BASE, "sql", "poem", "late"]
    assert complete(client, "late") == offline["late"][0]
    # Three adapters over two slots: each in turn takes a slot again.
    for name in ("sql", "poem", "late"):
        assert complete(client, name, stream=True) == offline[name][0]

    again = load({"lora_name": "late", "lora_path": paths["late"]})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = load({"lora_name": "bad", "lora_path": "/no/such/adapter"})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    assert [m.id for m in client.models.list().data] == [BASE, "sql", "poem", "late"]

    r = unload({"lora_name": "late"})
    assert r.status_code == 200 and "late" in r.text
    with pytest.raises(openai.NotFoundError):
        complete(client, "late")
    assert unload({"lora_name": "late"}).status_code == 404
    # Loaded again: a new adapter id, the same answers.
    assert load({"lora_name": "late", "lora_path": paths["late"]}).status_code == 200
    assert complete(client, "late") == offline["late"][0]
    assert complete(client, "poem") == offline["poem"][0]
    assert num_compiles(url) == compiled
    assert wait_for_idle(url)['paged_jax:num_kv_cache_blocks{state="used"}'] == 0


def test_an_adapter_in_use_is_not_unloaded_and_lora_requests_info_names_it(server, client):
    url, engine = server
    original = engine.runner.dispatch

    def slow(*args):  # a known pace: the request runs until the test closes its stream
        time.sleep(0.2)
        return original(*args)

    engine.runner.dispatch = slow
    try:
        stream = client.completions.create(model="sql", prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))  # it runs
        r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sql"}, timeout=TIMEOUT)
        assert r.status_code == 400 and "in use" in r.json()["error"]["message"]
        samples = [s for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=TIMEOUT).text)
                   for s in family.samples if s.name == "vllm:lora_requests_info"]
        latest = max(samples, key=lambda s: s.value)
        assert latest.labels == {"max_lora": "2", "running_lora_adapters": "sql", "waiting_lora_adapters": ""}
        assert dashboard_adapters(url) == ["sql"]
        stream.close()
    finally:
        engine.runner.dispatch = original
    wait_for_idle(url)
    assert [m.id for m in client.models.list().data][:3] == [BASE, "sql", "poem"]
    assert complete(client, "sql") != ""


def test_runtime_routes_exist_only_when_allowed(setup, monkeypatch):
    """As in vLLM: without VLLM_ALLOW_RUNTIME_LORA_UPDATING (or the flag) the routes are absent, a 404."""
    loaded, _ = setup
    routes = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}

    def paths(**config) -> set[str]:
        app = build_app(make_engine(loaded), ServerConfig(served_model_name=BASE, **config))
        return set(app.openapi()["paths"])

    monkeypatch.delenv(RUNTIME_UPDATING_ENV, raising=False)
    assert not routes & paths()
    assert routes <= paths(allow_runtime_lora_updating=True)
    monkeypatch.setenv(RUNTIME_UPDATING_ENV, "True")
    assert routes <= paths()
