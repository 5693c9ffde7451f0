"""Short soaks of `falcon-vllm serve`, in tree mode and in the shipped drafter's recommended form (prompt lookup
first, the chain otherwise, sampled drafts; benchmarks/soak_server.py is the long one): each 32
concurrent clients for 30 s (longer on a slow machine, until 48 requests have completed) on a tiny random
target, streaming and not, aborts and malformed requests; greedy answers equal a vanilla server's, memory
flat, spec counters consistent."""

import json

import pytest

from tests.vllm_util import save_target

from falcon_vllm.soak import markdown, soak
from falcon_vllm.testing import random_drafter, tiny_llama


def _shipped_form(schedule: bool = False) -> dict:
    """The shipped drafter's recommended form (prompt lookup first, the chain otherwise, sampled requests drafted
    by sampling), read from its serving.json; without ``schedule`` drafting at every batch size (its schedule left
    out), with it as shipped (the schedule for this CPU: no drafts from batch 3, or 4 on AVX-512)."""
    from falcon_vllm.vllm.options import DRAFTERS_DIR, SERVING_FILE

    with open(DRAFTERS_DIR / "smollm2-135m-instruct" / SERVING_FILE) as f:
        form = json.load(f)
    by_cpu = form.pop("num_speculative_tokens_per_batch_size_by_cpu", None) or {}
    if not schedule:
        form.pop("num_speculative_tokens_per_batch_size")
    else:  # the schedule serving.json gives this kind of CPU (as the plugin resolves it)
        from falcon_vllm.vllm.options import cpu_capability

        form["num_speculative_tokens_per_batch_size"] = by_cpu.get(cpu_capability(),
                                                                   form["num_speculative_tokens_per_batch_size"])
    if isinstance(form.get("datastore"), str):  # named relative to the drafter's directory
        form["datastore"] = str(DRAFTERS_DIR / "smollm2-135m-instruct" / form["datastore"])
    return form


@pytest.mark.slow
@pytest.mark.parametrize("mode,clients", [("tree", 32), ("lookup_chain_sampled", 32), ("shipped", 4)])
def test_short_soak(tmp_path, mode, clients):
    """``shipped``: serving.json as shipped, schedule included, under 4 clients, so the batch keeps crossing the
    schedule's boundary (drafting at batch 1-2, not from 3 or 4)."""
    t = tiny_llama(vocab=49152, hidden=64, heads=2, kv_heads=1, seed=3)
    target = save_target(t, str(tmp_path / "target"))
    random_drafter(t, k=2).save_pretrained(str(tmp_path / "drafter"))
    spec = {"method": "falcon", "model": str(tmp_path / "drafter")}
    spec |= {"tree": "tree-3x2x1"} if mode == "tree" else _shipped_form(schedule=mode == "shipped")
    need = 48 if clients > 8 else 24
    res = soak(target, ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8", "--enforce-eager"],
               ["--speculative-config", json.dumps(spec)], str(tmp_path), clients=clients, duration=30.0,
               max_words=100, max_rss_growth=0.15, min_completed=need, max_duration=150.0)
    assert not res["failures"], markdown(res)
    assert res["completed"] >= need and res["aborted"] > 0 and res["malformed"] > 0
    assert res["greedy_prompts_checked"] > 5 and res["seeded"] > 0 and res["long"] > 0


def test_spec_counter_checks():
    from falcon_vllm.soak import parse_metrics, spec_consistency

    def page(drafts, tokens, acc, per_pos, gen):
        lines = ["# HELP x", f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {drafts}',
                 f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {tokens}',
                 f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {acc}',
                 f'vllm:generation_tokens_total{{model_name="m"}} {gen}']
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{i}"}} {v}'
                  for i, v in enumerate(per_pos)]
        return parse_metrics("\n".join(lines))

    before = page(0, 0, 0, [0, 0, 0], 0)
    d, bad = spec_consistency(before, page(10, 30, 12, [7, 4, 1], 40))
    assert bad == [] and d["accepted_per_pos"] == [7, 4, 1] and d["drafts"] == 10
    assert spec_consistency(before, page(10, 30, 12, [4, 7, 1], 40))[1]     # increasing per position
    assert spec_consistency(before, page(10, 30, 13, [7, 4, 1], 40))[1]     # sum != accepted
    assert spec_consistency(before, page(10, 10, 12, [7, 4, 1], 40))[1]     # accepted > drafted
    assert spec_consistency(before, page(0, 0, 0, [0, 0, 0], 0))[1]         # no drafts


def test_soak_clients_survive_keep_alive_closes():
    """The soak's clients open a connection per request: a server closing an idle keep-alive connection
    while the client's loop was stalled (the 2-core soak's load) fails a pooled client, never the soak's."""
    import asyncio
    import threading
    import time

    import aiohttp
    import uvicorn

    from falcon_vllm.soak import _free_port, _session

    async def app(scope, receive, send):
        if scope["type"] == "http":
            while (await receive()).get("more_body"):
                pass
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="error", timeout_keep_alive=1))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}/v1/completions"

    async def stalled_pair(make_session) -> str:
        async with make_session() as session:
            for _ in range(2):
                async with session.post(url, json={"prompt": "hi"}) as r:
                    body = await r.read()
                time.sleep(1.5)  # the loop stalls past the server's keep-alive timeout
            return body.decode()

    try:
        assert asyncio.run(stalled_pair(_session)) == "ok"
        with pytest.raises(aiohttp.ClientError):  # a pooled session fails: the check above can fail
            asyncio.run(stalled_pair(aiohttp.ClientSession))
    finally:
        server.should_exit = True
