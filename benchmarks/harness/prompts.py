"""The held-out prompt sets the offline tools score drafters on: the target's greedy answers to benchmark prompts
(never trained on), made once by ``falcon-vllm gen-data`` and cached."""

from __future__ import annotations

import json
import os

DATASETS = ("mt-bench", "humaneval", "gsm8k")


def eval_set(dataset: str, n: int, max_new_tokens: int, work: str, target_dir: str, target=None,
             aux_layers: tuple[int, ...] = ()) -> list:
    """The target's greedy answers to the first turn of ``n`` prompts of ``dataset`` (gen-data samples);
    ``mt-bench-turn2``: to MT-Bench's second turn after its own first answer (only the second is scored,
    with at most 256 tokens of context before it, as the trainer keeps 128).  With ``aux_layers``, the
    features also carry the states entering those layers of ``target`` (for drafters that read them)."""
    from falcon_vllm.models import load_chat_prompts
    from falcon_vllm.train import gen_data
    from falcon_vllm.train.data import crop_context

    turns = 2 if dataset == "mt-bench-turn2" else 1
    out = os.path.join(work, f"{dataset}_n{n}_t{max_new_tokens}")
    if not os.path.exists(os.path.join(out, "manifest.json")):
        os.makedirs(out, exist_ok=True)
        src = os.path.join(out, "prompts.json")  # ShareGPT layout: the target writes the answers
        with open(src, "w") as f:
            json.dump([{"id": str(p["id"]),
                        "conversations": [m for q in p["turns"][:turns]
                                          for m in ({"from": "human", "value": q}, {"from": "gpt", "value": "-"})]}
                       for p in load_chat_prompts("mt-bench" if turns == 2 else dataset, n)], f)
        import importlib.util
        backend = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
        gen_data.run(target_dir, out, None, max_new_tokens, data=src, backend=backend, max_turns=turns,
                     loss_from_turn=turns)
    samples = gen_data.load_shards(out, aux=False)
    if aux_layers:
        samples = gen_data.with_aux_states(target, samples, aux_layers)
    return [crop_context(s, 256) for s in samples if s.loss_mask.any()] if turns == 2 else samples
