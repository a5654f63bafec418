"""The command line: engine flags under vLLM's names, and `python -m paged_jax.serve` on a tiny model
shutting down on SIGTERM (a request that fits in the grace period finishes, one that does not is cut,
new connections are refused, the process exits 0)."""

import dataclasses
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from paged_jax.core.config import EngineConfig
from paged_jax.serving import cli
from paged_jax.serving.cli import parse_args
from server_client import TIMEOUT

REPO = Path(__file__).resolve().parents[2]


def test_flags_take_vllm_names():
    args = parse_args(["--max-num-seqs", "8", "--no-enable-prefix-caching", "--num-gpu-blocks-override", "100",
                       "--max-model-len", "256", "--dtype", "bfloat16", "--preemption-mode", "swap",
                       "--served-model-name", "m", "--api-key", "k", "--max-num-queued-reqs", "5",
                       "--request-timeout", "30", "--max-tokens-cap", "64"])
    e, s = args.engine_config, args.server_config
    assert (e.max_num_seqs, e.enable_prefix_caching, e.num_blocks, e.max_model_len, e.dtype, e.preemption_mode) == (
        8, False, 100, 256, "bfloat16", "swap")
    assert (s.served_model_name, s.api_key, s.max_num_queued_reqs, s.request_timeout, s.max_tokens_cap) == (
        "m", "k", 5, 30.0, 64)
    assert (args.host, args.port) == ("127.0.0.1", 8000)


def test_every_engine_config_field_is_a_flag_with_its_help(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    squeeze = lambda text: "".join(text.split())  # argparse wraps the help, at spaces and hyphens
    usage = squeeze(capsys.readouterr().out)
    for field in dataclasses.fields(EngineConfig):
        assert field.metadata["help"] and squeeze(field.metadata["help"]) in usage
        assert "--" + {"num_blocks": "num-gpu-blocks-override"}.get(field.name, field.name.replace("_", "-")) in usage


def test_a_new_engine_config_field_needs_no_flag_written_for_it(monkeypatch):
    @dataclasses.dataclass(frozen=True, slots=True)
    class Extended(EngineConfig):
        new_limit: int | None = None
        new_ratio: float = 0.5

    monkeypatch.setattr(cli, "EngineConfig", Extended)
    config = parse_args(["--new-limit", "3", "--new-ratio", "0.25", "--max-num-seqs", "2"]).engine_config
    assert (config.new_limit, config.new_ratio, config.max_num_seqs) == (3, 0.25, 2)


def test_speculative_config_is_json_of_vllm_keys():
    config = parse_args(["--speculative-config", '{"method": "suffix", "num_speculative_tokens": 3}']).engine_config
    assert (config.speculative_config.method, config.speculative_config.num_speculative_tokens) == ("suffix", 3)
    assert parse_args([]).engine_config.speculative_config is None


def test_lora_flags_take_vllm_names_and_forms():
    args = parse_args(["--enable-lora", "--max-loras", "3", "--max-lora-rank", "32", "--max-cpu-loras", "6",
                       "--lora-modules", "sql=/a/sql", '{"name": "chat", "path": "/a/chat", "base_model_name": "m"}'])
    config = args.engine_config
    assert (config.enable_lora, config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (True, 3, 32, 6)
    assert [(m.name, m.path, m.base_model_name) for m in args.server_config.lora_modules] == [
        ("sql", "/a/sql", None), ("chat", "/a/chat", "m")]
    assert not args.server_config.allow_runtime_lora_updating
    assert parse_args(["--allow-runtime-lora-updating"]).server_config.allow_runtime_lora_updating


@pytest.mark.parametrize("argv", [["--lora-modules", "sql=/a/sql"], ["--enable-lora", "--lora-modules", "sql"],
                                  ["--enable-lora", "--lora-modules", '{"name": "x"}']])
def test_bad_lora_modules_exit_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2 and "--lora-modules" in capsys.readouterr().err


def test_chat_template_is_a_file_or_the_template_itself():
    path = REPO / "examples" / "chat_templates" / "gemma3.jinja"
    assert parse_args(["--chat-template", str(path)]).server_config.chat_template == path.read_text()
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert parse_args(["--chat-template", inline]).server_config.chat_template == inline
    assert parse_args([]).server_config.chat_template is None


@pytest.mark.parametrize("argv", [["--block-size", "0"], ["--dtype", "float16"], ["--max-num-queued-reqs", "-1"],
                                  ["--speculative-config", '{"method": "eagle"}'],
                                  ["--speculative-config", '{"num_spec_tokens": 3}'],
                                  ["--chat-template", "no/such/template.jinja"]])
def test_bad_flags_exit_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2 and argv[0].strip("-").split("-")[-1] in capsys.readouterr().err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Every engine step of the server lasts at least STEP_S (a slow step injected, as tests/conftest.py
# injects faults): how long a request takes then has a floor whatever the machine's speed. The long
# request needs LONG_TOKENS * STEP_S = 50 s, far beyond the grace period; the short one about
# SHORT_TOKENS * STEP_S, far within it.
STEP_S = 0.1
SHORT_TOKENS, LONG_TOKENS, GRACE_S = 3, 500, 2
SLOW_SERVE = f"""
import runpy, time
from paged_jax.core.engine import LLMEngine
step = LLMEngine.step
LLMEngine.step = lambda self: (time.sleep({STEP_S}), step(self))[1]
runpy.run_module("paged_jax.serve", run_name="__main__", alter_sys=True)  # python -m paged_jax.serve
"""


def test_sigterm_finishes_or_cuts_requests_and_exits_0(tiny_chat_folder):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-c", SLOW_SERVE, "--model", str(tiny_chat_folder), "--port", str(port),
         "--num-gpu-blocks-override", "64", "--max-num-seqs", "4", "--shutdown-timeout", str(GRACE_S),
         "--disable-uvicorn-access-log", "--log-level", "warning"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"{base}/health", timeout=TIMEOUT).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)

        bodies, first_chunk = {}, {k: threading.Event() for k in ("short", "long")}

        def stream(name: str, max_tokens: int):
            body = dict(prompt=[5, 6, 7], max_tokens=max_tokens, ignore_eos=True, temperature=0, stream=True)
            text = ""
            try:
                with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=TIMEOUT) as r:
                    for piece in r.iter_text():
                        text += piece
                        first_chunk[name].set()
            except httpx.TransportError:
                pass  # cut at the end of the grace period
            bodies[name] = text

        threads = [threading.Thread(target=stream, args=args)
                   for args in (("short", SHORT_TOKENS), ("long", LONG_TOKENS))]
        for t in threads:
            t.start()
        assert all(e.wait(120) for e in first_chunk.values())
        server.send_signal(signal.SIGTERM)
        refused_by = time.monotonic() + 60  # however long a busy machine takes to handle the signal
        while True:  # new connections are refused while the requests drain
            try:
                httpx.get(f"{base}/health", timeout=TIMEOUT)
            except httpx.TransportError:
                break
            assert time.monotonic() < refused_by, "the server still answers after SIGTERM"
            time.sleep(0.1)
        for t in threads:
            t.join(60)
        assert server.wait(60) == 0, server.stdout.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert bodies["short"].endswith("data: [DONE]\n\n") and '"finish_reason":"length"' in bodies["short"]
    assert "[DONE]" not in bodies["long"], bodies["long"].count("data:")
    assert 0 < bodies["long"].count('"text"') < LONG_TOKENS
