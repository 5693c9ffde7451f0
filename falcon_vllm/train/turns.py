"""The token sequences of gen-data's conversations: the target's answers turn after turn (``answer_turns``: the
data's later human questions put into the chat template after each answer), or each prompt followed by the
data's own first reply (``dataset_replies``).  Each comes with its loss mask: 1 on trained answer tokens."""

from __future__ import annotations

from falcon_vllm.models import chat_ids


def next_turn_suffix(tokenizer, question: str, eos_ids) -> list[int]:
    """Template tokens that follow an assistant turn's end-of-turn token: the separator after it, the next
    user turn and the generation prompt.

    Taken from two renderings of the same (placeholder) conversation, so it is exactly what the chat
    template puts between an assistant turn's end-of-turn token and the next answer.
    """
    base = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    a = chat_ids(tokenizer, base)
    b = chat_ids(tokenizer, base + [{"role": "user", "content": question}], add_generation_prompt=True)
    ends = [i for i, t in enumerate(a) if t in eos_ids]
    if b[:len(a)] != a or not ends:
        raise ValueError("falcon-vllm: chat template is not prefix-stable; multi-turn gen-data is not supported for it")
    return a[ends[-1] + 1:] + b[len(a):]


def answer_turns(generate, tokenizer, convs, prompts, max_new_tokens, eos_ids, max_turns: int,
                 max_total_tokens: int, stored=None, stored_turns: int = 0, loss_from_turn: int = 1):
    """Tokens and assistant masks of up to ``max_turns`` regenerated assistant turns per conversation
    (later human questions from the data; each turn's prompts answered in one ``generate`` call).

    ``stored``: per conversation, (tokens, loss mask) of its first turns as generated before (a ``--answers``
    file made with ``stored_turns`` < ``max_turns`` turns): they are continued, not generated again; a
    conversation continues only if it holds ``stored_turns`` turns (one that stopped early has no later turn).
    ``loss_from_turn``: assistant turns before this one (1-based) keep loss mask 0, context only (a data set
    of later turns that does not repeat the first ones)."""
    if stored is None:
        seqs, masks, start = [list(p) for p in prompts], [[0] * len(p) for p in prompts], 0
        live = list(range(len(prompts)))
    else:
        seqs, masks = [list(t) for t, _ in stored], [list(m) for _, m in stored]
        start = stored_turns
        live = [i for i, m in enumerate(masks) if answer_turn_count(m) == start]
        if loss_from_turn > 1:  # the stored turns are all before any later one
            masks = [[0] * len(m) for m in masks]
    for turn in range(start, max_turns):
        if turn > 0:
            nxt = []
            for i in live:
                conv = convs[i]
                if 2 * turn >= len(conv) or conv[2 * turn].get("from") != "human":
                    continue
                if seqs[i][-1] not in eos_ids:  # capped turn: close it as the template would
                    seqs[i].append(next(iter(eos_ids)))
                    masks[i].append(0)
                suf = next_turn_suffix(tokenizer, conv[2 * turn]["value"], eos_ids)
                if len(seqs[i]) + len(suf) + max_new_tokens > max_total_tokens:
                    continue
                seqs[i] += suf
                masks[i] += [0] * len(suf)
                nxt.append(i)
            live = nxt
        if not live:
            break
        trained = int(turn + 1 >= loss_from_turn)
        for i, g in zip(live, generate([seqs[i] for i in live], max_new_tokens)):
            seqs[i] += g
            masks[i] += [trained] * len(g)
    return seqs, masks


def dataset_replies(tokenizer, convs, prompts, max_new_tokens: int, eos_ids):
    """Tokens and masks of each prompt followed by its conversation's own first reply (no generation): the
    reply as the chat template renders it, cut after its end-of-turn token or at ``max_new_tokens``.  The
    fixed-data recipe of EAGLE and Falcon (the target's features and teacher over another model's text)."""
    seqs, masks = [], []
    for conv, prompt in zip(convs, prompts):
        reply = conv[1]["value"] if len(conv) > 1 and conv[1].get("from") == "gpt" else None
        ans = []
        if reply:
            full = chat_ids(tokenizer, [{"role": "user", "content": conv[0]["value"]},
                                        {"role": "assistant", "content": reply}])
            if full[:len(prompt)] != list(prompt):
                raise ValueError("falcon-vllm: gen-data: --replies data needs a chat template whose prompt is a "
                                 "prefix of the rendered conversation; this one is not")
            for t in full[len(prompt):]:
                ans.append(t)
                if t in eos_ids:
                    break
            ans = ans[:max_new_tokens]
        seqs.append(list(prompt) + ans)
        masks.append([0] * len(prompt) + [1] * len(ans))
    return seqs, masks


def answer_turn_count(mask) -> int:
    """Assistant turns in a loss mask whose every turn is trained: its runs of ones."""
    return sum(1 for a, b in zip([0] + list(mask[:-1]), mask) if b and not a)
