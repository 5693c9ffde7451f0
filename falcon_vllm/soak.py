"""Soak test of ``falcon-vllm serve`` on loopback (used by benchmarks/soak_server.py and the short test).

``soak()`` starts the server given by ``server_args`` (a subprocess, its own session), runs
``clients`` concurrent clients for ``duration`` seconds, then starts a vanilla server (the same
arguments without speculation) and replays the greedy prompts on it.  Each client loops over:
* greedy requests of a fixed prompt set (mixed lengths, completions or chat, streamed or not);
  every answer must equal the vanilla server's;
* sampled requests (temperature 0.8, top-p 0.95, random lengths, streamed or not);
* seeded sampled requests (a few prompts and seeds, fixed lengths): every answer must equal the vanilla server's;
* with a ``--max-model-len`` among the server flags, greedy requests whose prompt (token ids) ends within 24
  tokens of it: every answer must equal the vanilla server's;
* aborts: a streamed request dropped after 0-4 chunks (the client disconnects);
* malformed requests (bad JSON, bad fields, unknown model, out-of-vocabulary ids): each must get a 4xx.
Checked: the server never dies and answers /health at the end; every malformed request got a 4xx and
every other request a 200; greedy and seeded answers equal vanilla's; resident memory (the server's process tree)
is flat after warm-up; the spec-decode counters from /metrics are consistent (with no ``spec_args``, a vanilla
server under the same load, they are not checked).
No vLLM import: it only talks HTTP to the servers.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly explain how rivers carve "
         "mountains into valleys and why the small robot keeps counting stars before dawn").split()
GREEDY_LENGTHS = (8, 24, 64, 128)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, args: list[str], log_path: str, timeout: float = 900) -> tuple[subprocess.Popen, str]:
    """Start ``falcon-vllm serve model args`` on a free loopback port; wait for /health."""
    import urllib.request

    port = _free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "falcon_vllm.cli", "serve", model, "--host", "127.0.0.1",
                             "--port", str(port), *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"falcon-vllm: server exited ({proc.returncode}):\n" + open(log_path).read()[-3000:])
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return proc, url
        except OSError:
            time.sleep(1)
    stop_server(proc)
    raise RuntimeError(f"falcon-vllm: server did not start in {timeout:.0f} s:\n" + open(log_path).read()[-3000:])


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def rss_mb(pid: int) -> float:
    """Resident memory of a process and all its descendants, MiB."""
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p] + p.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def parse_metrics(text: str) -> dict:
    """The counters the soak checks, from a Prometheus /metrics page (summed over label sets)."""
    out: dict = {"accepted_per_pos": {}}
    names = {"vllm:spec_decode_num_drafts_total": "drafts", "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens_total": "accepted",
             "vllm:generation_tokens_total": "generation_tokens"}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        base = name.split("{", 1)[0]
        if base in names:
            out[names[base]] = out.get(names[base], 0.0) + float(value)
        elif base == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            pos = int(name.split('position="', 1)[1].split('"', 1)[0])
            out["accepted_per_pos"][pos] = out["accepted_per_pos"].get(pos, 0.0) + float(value)
    return out


def spec_consistency(before: dict, after: dict) -> tuple[dict, list[str]]:
    """Counter deltas over the soak and the list of violated invariants."""
    keys = ("drafts", "draft_tokens", "accepted", "generation_tokens")
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in keys}
    n = max(list(after["accepted_per_pos"]) + [-1]) + 1
    per_pos = [after["accepted_per_pos"].get(i, 0.0) - before["accepted_per_pos"].get(i, 0.0) for i in range(n)]
    d["accepted_per_pos"] = per_pos
    bad = []
    if not d["drafts"] > 0:
        bad.append("no drafts")
    if not 0 <= d["accepted"] <= d["draft_tokens"]:
        bad.append("accepted tokens outside [0, draft tokens]")
    if d["draft_tokens"] < d["drafts"]:
        bad.append("fewer draft tokens than drafts")
    if abs(sum(per_pos) - d["accepted"]) > 0.5:
        bad.append("per-position accepted counts do not sum to accepted tokens")
    if any(a < b for a, b in zip(per_pos, per_pos[1:])) or (per_pos and per_pos[0] > d["drafts"]):
        bad.append("per-position accepted counts not non-increasing / above drafts")
    if d["accepted"] > d["generation_tokens"]:
        bad.append("more accepted tokens than generated tokens")
    return d, bad


def make_prompts(n: int, max_words: int, seed: int = 0) -> list[str]:
    """``n`` prompts of mixed lengths (3 to ``max_words`` words)."""
    rng = random.Random(seed)
    lengths = [3, 12, max_words // 4, max_words // 2, max_words]
    return [" ".join(rng.choice(WORDS) for _ in range(lengths[i % len(lengths)])) for i in range(n)]


MALFORMED = [  # (path, raw body or dict with "$model" for the model name)
    ("/v1/completions", b"{not json"),
    ("/v1/completions", {"model": "$model"}),
    ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}),
    ("/v1/completions", {"model": "$model", "prompt": "hi", "max_tokens": -5}),
    ("/v1/completions", {"model": "$model", "prompt": "hi", "temperature": -1}),
    ("/v1/completions", {"model": "$model", "prompt": "hi", "top_p": 2.0}),
    ("/v1/completions", {"model": "$model", "prompt": "hi", "max_tokens": 10**7}),
    ("/v1/completions", {"model": "$model", "prompt": [10**9, 5]}),
    ("/v1/completions", {"model": "$model", "prompt": "hi", "n": 0}),
    ("/v1/completions", {"model": "$model", "prompt": "hi", "logprobs": 1000}),
    ("/v1/chat/completions", {"model": "$model", "messages": "not a list"}),
    ("/v1/chat/completions", {"model": "$model", "messages": [{"role": 5, "content": "hi"}], "max_tokens": 4}),
]


class Soak:
    def __init__(self, url: str, model: str, prompts: list[str], deadline: float, seed: int,
                 p_abort: float, p_malformed: float, p_greedy: float, min_completed: int = 0,
                 hard_deadline: float | None = None, max_model_len: int | None = None):
        self.url, self.model, self.prompts, self.deadline = url, model, prompts, deadline
        self.max_model_len = max_model_len
        self.min_completed, self.hard_deadline = min_completed, deadline if hard_deadline is None else hard_deadline
        self.seed, self.p_abort, self.p_malformed, self.p_greedy = seed, p_abort, p_malformed, p_greedy
        self.greedy: dict[tuple, set[str]] = {}  # a checked request's key -> the answers it got
        self.latency: list[float] = []
        self.count = {"completed": 0, "greedy": 0, "sampled": 0, "seeded": 0, "long": 0, "streamed": 0, "chat": 0,
                      "aborted": 0, "malformed": 0, "malformed_4xx": 0}
        self.errors: list[str] = []

    def checked_body(self, key: tuple) -> tuple[str, dict]:
        """The request of a checked key: ("greedy", i), ("seeded", i, seed) or ("long", n)."""
        kind, i = key[0], key[1]
        if kind == "greedy":
            return self._body(i, i % 3 == 2, max_tokens=GREEDY_LENGTHS[i % len(GREEDY_LENGTHS)], temperature=0.0)
        if kind == "seeded":
            return self._body(i, False, max_tokens=32, temperature=0.8, top_p=0.95, seed=key[2])
        ids = [100 + (37 * j + 11 * i) % 5000 for j in range(self.max_model_len - 24)]  # ends 24 tokens short
        return "/v1/completions", {"model": self.model, "prompt": ids, "max_tokens": 16 + i, "temperature": 0.0}

    def _body(self, i: int, chat: bool, **kw) -> tuple[str, dict]:
        if chat:
            return "/v1/chat/completions", {"model": self.model, "messages": [{"role": "user",
                                                                             "content": self.prompts[i]}], **kw}
        return "/v1/completions", {"model": self.model, "prompt": self.prompts[i], **kw}

    async def _request(self, session, path: str, body: dict, stream: bool) -> str:
        """One request to completion -> the generated text (checks status 200 and a finish reason)."""
        chat = "messages" in body
        async with session.post(self.url + path, json=dict(body, stream=stream)) as r:
            if r.status != 200:
                raise RuntimeError(f"falcon-vllm: status {r.status}: {(await r.text())[:300]}")
            if not stream:
                c = (await r.json())["choices"][0]
                return c["message"]["content"] if chat else c["text"]
            text, finished = [], False
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                c = json.loads(line[6:])["choices"]
                if c:
                    text.append((c[0].get("delta", {}).get("content") if chat else c[0].get("text")) or "")
                    finished = finished or c[0].get("finish_reason") is not None
            if not finished:
                raise RuntimeError("falcon-vllm: stream ended without a finish reason")
            return "".join(text)

    async def _abort(self, session, rng: random.Random) -> None:
        path, body = self._body(rng.randrange(len(self.prompts)), rng.random() < 0.3, max_tokens=200,
                                temperature=rng.choice([0.0, 0.8]), stream=True)
        r = await session.post(self.url + path, json=body)
        try:
            for _ in range(rng.randrange(5)):
                if not await r.content.readline():
                    break
        finally:
            r.close()  # drops the connection: the server sees a client disconnect
        self.count["aborted"] += 1

    async def _malformed(self, session, rng: random.Random) -> None:
        path, body = MALFORMED[rng.randrange(len(MALFORMED))]
        data = body if isinstance(body, bytes) else json.dumps(
            {k: (self.model if v == "$model" else v) for k, v in body.items()}).encode()
        async with session.post(self.url + path, data=data, headers={"Content-Type": "application/json"}) as r:
            await r.read()
            self.count["malformed"] += 1
            if 400 <= r.status < 500:
                self.count["malformed_4xx"] += 1
            else:
                self.errors.append(f"malformed {path} {data[:80]!r}: status {r.status}")

    def _going(self) -> bool:
        """Clients run until the deadline, then on (up to the hard deadline) while fewer than
        ``min_completed`` requests have completed: a slow machine gets a longer soak, not a weaker one."""
        now = time.monotonic()
        return now < self.deadline or (self.count["completed"] < self.min_completed and now < self.hard_deadline)

    async def client(self, k: int) -> None:
        rng = random.Random(self.seed * 1000 + k)
        async with _session() as session:
            while self._going():
                x = rng.random()
                try:
                    if x < self.p_malformed:
                        await self._malformed(session, rng)
                        continue
                    if x < self.p_malformed + self.p_abort:
                        await self._abort(session, rng)
                        continue
                    stream, greedy = rng.random() < 0.5, rng.random() < self.p_greedy
                    key = None
                    if greedy:  # a greedy request; one in 5 seeded sampling, one in 5 near max_model_len
                        y = rng.random()
                        key = (("long", rng.randrange(4)) if y < 0.2 and self.max_model_len else
                               ("seeded", rng.randrange(4), rng.randrange(3)) if y < 0.4 else
                               ("greedy", rng.randrange(len(self.prompts))))
                        path, body = self.checked_body(key)
                    else:
                        path, body = self._body(rng.randrange(len(self.prompts)), rng.random() < 0.3,
                                                max_tokens=rng.randint(4, 128), temperature=0.8, top_p=0.95)
                    t0 = time.monotonic()
                    text = await self._request(session, path, body, stream)
                    self.latency.append(time.monotonic() - t0)
                    self.count["completed"] += 1
                    self.count[key[0] if key else "sampled"] += 1
                    self.count["streamed"] += stream
                    self.count["chat"] += "messages" in body
                    if key:
                        self.greedy.setdefault(key, set()).add(text)
                except Exception as e:  # noqa: BLE001 - every failure is recorded and fails the soak
                    self.errors.append(f"{type(e).__name__}: {e}"[:300])


def _session():
    """A client session that opens a fresh connection per request.  The server (uvicorn) closes a keep-alive
    connection idle for 5 s; a client whose loop stalls that long under the soak's load then reuses the
    pooled connection the server has closed and fails ("Can not write request body"): a race of connection
    reuse, not a failure of the server."""
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                 connector=aiohttp.TCPConnector(force_close=True))


async def _run_clients(soak: Soak, clients: int) -> None:
    await asyncio.gather(*(soak.client(k) for k in range(clients)))


async def _replay_greedy(url: str, model: str, prompts: list[str], keys: list[tuple],
                         max_model_len: int | None = None) -> dict[tuple, str]:
    s = Soak(url, model, prompts, 0, 0, 0, 0, 1, max_model_len=max_model_len)
    sem = asyncio.Semaphore(8)
    out = {}

    async def one(session, key):
        async with sem:
            path, body = s.checked_body(key)
            out[key] = await s._request(session, path, body, False)

    async with _session() as session:
        await asyncio.gather(*(one(session, k) for k in keys))
    return out


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def soak(model: str, server_args: list[str], spec_args: list[str], workdir: str, clients: int = 32,
         duration: float = 60.0, num_prompts: int = 24, max_words: int = 120, p_abort: float = 0.1,
         p_malformed: float = 0.1, p_greedy: float = 0.4, warmup_frac: float = 0.3, seed: int = 0,
         max_rss_growth: float = 0.10, min_completed: int = 0, max_duration: float | None = None) -> dict:
    """Run the soak (see the module docstring) -> a results dict; ``results["failures"]`` lists every
    violated check (empty when the soak passed).  The clients stop after ``duration`` seconds, or later,
    up to ``max_duration`` (default 4x ``duration``), while fewer than ``min_completed`` requests have
    completed; completing fewer is a failure."""
    import urllib.request

    os.makedirs(workdir, exist_ok=True)
    prompts = make_prompts(num_prompts, max_words, seed)
    flags = list(server_args)
    max_model_len = int(flags[flags.index("--max-model-len") + 1]) if "--max-model-len" in flags else None
    get = lambda url, p: urllib.request.urlopen(url + p, timeout=60).read().decode()  # noqa: E731
    proc, url = start_server(model, server_args + spec_args, os.path.join(workdir, "falcon_server.log"))
    rss: list[tuple[float, float]] = []
    try:
        metrics0 = parse_metrics(get(url, "/metrics"))
        t0 = time.monotonic()
        s = Soak(url, model, prompts, t0 + duration, seed, p_abort, p_malformed, p_greedy, min_completed,
                 t0 + (4 * duration if max_duration is None else max_duration), max_model_len)

        async def main():
            task = asyncio.ensure_future(_run_clients(s, clients))
            while not task.done():
                rss.append((time.monotonic() - t0, rss_mb(proc.pid)))
                await asyncio.wait([task], timeout=1.0)
            await task

        asyncio.run(main())
        elapsed = time.monotonic() - t0
        alive = proc.poll() is None
        health = alive and get(url, "/health") is not None
        time.sleep(2)  # let the last aborts reach the engine before the counters are read
        spec, bad_spec = spec_consistency(metrics0, parse_metrics(get(url, "/metrics")))
    finally:
        stop_server(proc)
    vproc, vurl = start_server(model, server_args, os.path.join(workdir, "vanilla_server.log"))
    try:
        vanilla = asyncio.run(_replay_greedy(vurl, model, prompts, sorted(s.greedy), max_model_len))
    finally:
        stop_server(vproc)
    mismatch = sorted(i for i, texts in s.greedy.items() if texts != {vanilla[i]})
    warm = [m for t, m in rss if t >= warmup_frac * elapsed]
    tail = [m for t, m in rss if t >= 0.9 * elapsed] or warm[-1:]
    growth = (max(tail) - warm[0]) / warm[0] if warm else None
    failures = list(s.errors[:20])
    if len(s.errors) > 20:
        failures.append(f"... {len(s.errors) - 20} more errors")
    if not health:
        failures.append("server died or /health failed")
    if spec_args:  # none: a vanilla baseline, whose counters stay at zero
        failures += [f"spec counters: {b}" for b in bad_spec]
    if mismatch:
        failures.append(f"greedy or seeded outputs differ from vanilla for {mismatch}")
    if s.count["malformed_4xx"] != s.count["malformed"]:
        failures.append("a malformed request did not get a 4xx")
    if s.count["completed"] < min_completed:
        failures.append(f"only {s.count['completed']} requests completed in {elapsed:.0f} s (at least "
                        f"{min_completed} wanted)")
    if growth is None or growth > max_rss_growth:
        failures.append(f"resident memory grew by {growth} after warm-up (limit {max_rss_growth})")
    lat = s.latency
    return {
        "model": model, "server_args": server_args, "spec_args": spec_args, "clients": clients,
        "duration_s": round(elapsed, 1), "requests": sum(s.count[k] for k in ("completed", "aborted", "malformed"))
        + len(s.errors), **{k: v for k, v in s.count.items()}, "errors": len(s.errors),
        "latency_s": {"p50": _percentile(lat, 0.5), "p99": _percentile(lat, 0.99), "max": max(lat, default=None)},
        "rss_mb": {"start": rss[0][1] if rss else None, "after_warmup": warm[0] if warm else None,
                   "end": rss[-1][1] if rss else None, "max": max((m for _, m in rss), default=None),
                   "growth_after_warmup": growth, "samples": [(round(t, 1), round(m, 1)) for t, m in rss[::5]]},
        "greedy_prompts_checked": len(s.greedy),
        "greedy_answers_checked": s.count["greedy"] + s.count["seeded"] + s.count["long"],
        "greedy_mismatches": [list(k) for k in mismatch], "spec": spec, "failures": failures,
    }


def markdown(res: dict) -> str:
    lat, rss, sp = res["latency_s"], res["rss_mb"], res["spec"]
    f = lambda x, n=2: "-" if x is None else f"{x:.{n}f}"  # noqa: E731
    lines = [
        f"# Soak: `falcon-vllm serve` {' '.join(res['spec_args']) or '(no speculation: the baseline)'}", "",
        f"model `{res['model']}`, server flags `{' '.join(res['server_args'])}`", "",
        "| clients | duration s | requests | completed | greedy | seeded | near max_model_len | sampled | streamed "
        "| chat | aborted | malformed (4xx) | errors | p50 s | p99 s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {res['clients']} | {res['duration_s']} | {res['requests']} | {res['completed']} | {res['greedy']} "
        f"| {res.get('seeded', 0)} | {res.get('long', 0)} | {res['sampled']} | {res['streamed']} | {res['chat']} "
        f"| {res['aborted']} "
        f"| {res['malformed']} ({res['malformed_4xx']}) | {res['errors']} | {f(lat['p50'])} | {f(lat['p99'])} |", "",
        f"Resident memory of the server's process tree (MiB): start {f(rss['start'], 0)}, after warm-up "
        f"{f(rss['after_warmup'], 0)}, end {f(rss['end'], 0)}, max {f(rss['max'], 0)} "
        f"(growth after warm-up {f(100 * rss['growth_after_warmup'] if rss['growth_after_warmup'] is not None else None, 1)} %).",
        "",
        f"Greedy and seeded: {res['greedy_answers_checked']} answers to {res['greedy_prompts_checked']} requests "
        f"compared with a vanilla server: {len(res['greedy_mismatches'])} differ.", "",
        f"Spec counters over the soak: {int(sp['drafts'])} drafts, {int(sp['draft_tokens'])} draft tokens, "
        f"{int(sp['accepted'])} accepted, {int(sp['generation_tokens'])} generated tokens; accepted per position "
        f"{[int(x) for x in sp['accepted_per_pos']]}.", "",
        "Result: " + ("PASS" if not res["failures"] else "FAIL\n\n" + "\n".join(f"- {x}" for x in res["failures"])),
    ]
    return "\n".join(lines) + "\n"
