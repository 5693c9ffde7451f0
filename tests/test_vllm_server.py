"""An OpenAI server started with falcon answers completions and chat, and exports spec counters."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.vllm_util import save_target

from falcon_vllm.testing import random_drafter, tiny_llama


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("srv")
    t = tiny_llama(vocab=49152, hidden=64, heads=2, kv_heads=1)
    target = save_target(t, str(base / "target"))
    random_drafter(t, k=2).save_pretrained(str(base / "drafter"))
    port = _free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    log = open(base / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "falcon_vllm.cli", "serve", target, "--host", "127.0.0.1", "--port", str(port),
         "--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--max-num-seqs", "4",
         "--speculative-model", str(base / "drafter"), "--num-speculative-tokens", "3"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            if proc.poll() is not None:
                raise RuntimeError("server exited:\n" + (base / "server.log").read_text()[-3000:])
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        else:
            raise RuntimeError("server did not start in 240 s:\n" + (base / "server.log").read_text()[-3000:])
        yield url, target
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_completion_chat_and_metrics(server):
    url, model = server
    c = _post(url + "/v1/completions", {"model": model, "prompt": "Hello there", "max_tokens": 12,
                                        "temperature": 0})
    assert c["choices"][0]["text"] and c["usage"]["completion_tokens"] == 12
    ch = _post(url + "/v1/chat/completions", {"model": model, "max_tokens": 8, "temperature": 0,
                                              "messages": [{"role": "user", "content": "Say hi"}]})
    assert ch["choices"][0]["message"]["content"] is not None and ch["usage"]["completion_tokens"] > 0
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    drafts = [l for l in text.splitlines() if l.startswith("vllm:spec_decode_num_drafts_total")]
    assert drafts and float(drafts[0].split()[-1]) > 0
    assert "vllm:spec_decode_num_draft_tokens_total" in text
