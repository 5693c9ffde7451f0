"""``falcon-vllm demo`` (``make demo``): a target with and without falcon, in vLLM on CPU.

Answers a few MT-Bench questions with vanilla decoding and with Falcon speculative decoding, prints the
answers, tokens/s of both, tau (mean tokens per verification step, from vLLM's counters) and whether the
greedy outputs are identical.  The target is SmolLM2-135M-Instruct unless ``--target`` names another offline
model (``make models-qwen``: qwen2.5-coder-1.5b-instruct) or a directory; the drafter is the shipped one
whose recorded target it is, as ``"model": "falcon"`` resolves it, unless ``--drafter`` gives one.
"""

from __future__ import annotations

import os
import time

def add_arguments(p):
    p.add_argument("--target", default=None,
                   help="an offline model's name (default: smollm2-135m-instruct) or a target directory")
    p.add_argument("--questions", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="chain length (default: the drafter's recommended configuration, its serving.json)")
    p.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one for the target)")
    p.add_argument("--tree", default=None,
                   help="run falcon in tree mode with this tree (e.g. falcon-llama, tree-2x2x1); default: a chain "
                        "of --num-speculative-tokens")


def main(args):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import tempfile

    from transformers import AutoConfig, AutoTokenizer
    from vllm import LLM, SamplingParams

    from falcon_vllm.models import load_chat_prompts, model_path
    from falcon_vllm.vllm.engine import counter_delta, shutdown_llm, spec_counters

    target = str(model_path(args.target) if args.target else model_path())
    drafter = args.drafter
    if drafter is None:  # the shipped drafter for this target, before any engine starts (else: what was tried)
        from falcon_vllm.vllm.options import resolve_drafter

        drafter = resolve_drafter("falcon", AutoConfig.from_pretrained(target))
    if not os.path.exists(os.path.join(drafter, "model.safetensors")):
        import torch

        from falcon_vllm.config import FalconConfig
        from falcon_vllm.drafter import FalconDrafter
        print(f"NOTE: no trained drafter at {drafter}; using a RANDOM drafter (outputs stay identical, "
              "tau will be ~1). Train one with `falcon-vllm train`.")
        torch.manual_seed(0)
        drafter = tempfile.mkdtemp(prefix="falcon-random-")
        FalconDrafter(FalconConfig.from_target(AutoConfig.from_pretrained(target))).save_pretrained(drafter)
    tok = AutoTokenizer.from_pretrained(target)
    qs = load_chat_prompts("mt-bench", args.questions)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True,
                                       tokenize=False) for q in qs]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    common = dict(model=target, dtype="float32", max_model_len=2048, enforce_eager=True, max_num_seqs=1,
                  disable_log_stats=False, seed=0)
    results = {}
    falcon = {"method": "falcon", "model": drafter}
    if args.tree:
        falcon["tree"] = args.tree
    elif args.num_speculative_tokens:
        falcon["num_speculative_tokens"] = args.num_speculative_tokens
    for name, spec in (("vanilla", None), ("falcon", falcon)):
        llm = LLM(speculative_config=spec, **common)
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0))  # warm-up
        before = spec_counters(llm)
        t0 = time.perf_counter()
        outs = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0] for p in prompts]  # batch 1
        dt = time.perf_counter() - t0
        c = counter_delta(spec_counters(llm), before)
        if spec is not None:
            sc = llm.llm_engine.vllm_config.speculative_config
            falcon_info = sc.draft_model_config.hf_config.falcon
            if falcon_info.get("mode") == "tree":
                how = f"tree {falcon_info.get('tree_name')} ({sc.num_speculative_tokens} nodes)"
            elif falcon_info.get("prompt_lookup"):
                lo, hi = falcon_info["prompt_lookup"]
                K, L = sc.num_speculative_tokens, falcon_info.get("lookup_tokens", sc.num_speculative_tokens)
                size = f"{L} to {K} tokens, adaptive" if L < K else f"up to {K} tokens"
                how = (f"prompt lookup ({lo}-{hi}-grams, {size}) first, "
                       + ("then the target's stored answers (datastore), " if falcon_info.get("datastore") else "")
                       + f"the drafter's chain of {falcon_info['falcon_tokens']} otherwise")
            else:
                how = f"chain K={sc.num_speculative_tokens}"
        n = sum(len(o.token_ids) for o in outs)
        drafts, acc = c["num_drafts"], c["num_accepted_tokens"]
        results[name] = {"outs": outs, "tps": n / dt, "tau": 1 + acc / drafts if drafts else None}
        shutdown_llm(llm)
        del llm
    for q, o in zip(qs, results["falcon"]["outs"]):
        print(f"\n### Q{q['id']}: {q['turns'][0][:100]}\n{o.text.strip()[:600]}")
    same = all(list(a.token_ids) == list(b.token_ids)
               for a, b in zip(results["vanilla"]["outs"], results["falcon"]["outs"]))
    v, f = results["vanilla"], results["falcon"]
    print("\n" + "=" * 72)
    print(f"vanilla : {v['tps']:.1f} tokens/s")
    print(f"falcon  : {f['tps']:.1f} tokens/s  (speedup {f['tps'] / v['tps']:.2f}x, tau {f['tau']:.2f} incl. bonus, "
          f"{how}, drafter {os.path.basename(drafter.rstrip('/'))})")
    print(f"greedy outputs identical: {same}")
    return 0 if same else 1
