"""The serving-under-load benchmark (benchmarks/ab_arrivals.py): its arrival traces and its per-request clock,
on a stand-in engine whose timing is known."""

import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
_env = dict(os.environ)
import ab_arrivals  # noqa: E402

for _k in set(os.environ) - set(_env):  # the benchmark's environment defaults stay out of the other tests
    del os.environ[_k]


def test_arrivals_are_poisson_and_deterministic():
    a = ab_arrivals.arrivals(2.0, 4000, seed=3)
    assert a[0] == 0 and all(x < y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert abs(sum(gaps) / len(gaps) - 0.5) < 0.03  # mean gap 1 / rate
    assert abs(sorted(gaps)[len(gaps) // 2] - 0.5 * 0.6931) < 0.03  # exponential: median ln 2 / rate
    assert ab_arrivals.arrivals(2.0, 50, seed=3) == a[:50] and ab_arrivals.arrivals(2.0, 50, seed=4) != a[:50]


class FakeEngine:
    """One token per running request per step, a step taking ``step_s``; a request ends after ``n`` tokens."""

    def __init__(self, n=3, step_s=0.02):
        self.n, self.step_s, self.running, self.added = n, step_s, {}, {}

    def add_request(self, rid, prompt, sp):
        assert rid not in self.running and rid not in self.added
        self.running[rid] = [prompt["prompt_token_ids"][0]]
        self.added[rid] = time.perf_counter()

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        time.sleep(self.step_s)
        outs = []
        for rid, toks in list(self.running.items()):
            toks.append(toks[-1] + 1)
            done = len(toks) > self.n
            outs.append(SimpleNamespace(request_id=rid, finished=done, outputs=[SimpleNamespace(token_ids=toks[1:])]))
            if done:
                del self.running[rid]
        return outs


def test_serve_trace_times_each_request_from_its_arrival():
    eng = FakeEngine(n=3, step_s=0.02)
    prompts = [{"prompt_token_ids": [10 * j]} for j in range(3)]
    times = [0.0, 0.0, 0.3]  # the third arrives after the first two are done (3 steps of 20 ms)
    t0 = time.perf_counter()
    done = ab_arrivals.serve_trace(eng, prompts, times, sp=None, tag="x")
    assert [d["tokens"] for d in done] == [[10 * j + 1, 10 * j + 2, 10 * j + 3] for j in range(3)]
    assert eng.added["xr2"] - t0 >= 0.3  # added no earlier than its arrival (the engine sat idle until then)
    for d in done:
        assert 0 < d["ttft"] <= d["latency"] and abs(d["latency"] - d["ttft"] - d["decode"]) < 1e-9
        assert 0.055 < d["latency"] < 0.2  # 3 steps of 20 ms each, counted from its own arrival
    assert done[0]["ttft"] < 0.04  # its first token came with the first step
