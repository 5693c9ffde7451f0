"""``falcon-vllm gen-prompts``: the template prefix, the filters, determinism and resume (generator stubbed)."""

import json

import pytest

from falcon_vllm.models import chat_ids, load_chat_prompts, model_path
from falcon_vllm.train import gen_prompts
from falcon_vllm.train.sharegpt import build_prompts, iter_sharegpt


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path())


def test_user_turn_prefix_is_what_the_template_puts_before_a_question(tok):
    prefix = gen_prompts.user_turn_prefix(tok)
    for q in ("Hello there", "7 + 5?", "Write a poem."):
        full = chat_ids(tok, [{"role": "user", "content": q}])
        assert full[:len(prefix)] == prefix
        assert tok.decode(full[len(prefix):]).startswith(q)
    assert tok.decode(prefix).endswith("user\n")


def test_benchmark_texts_hold_every_installed_benchmark_turn():
    banned = gen_prompts.benchmark_texts()
    q = load_chat_prompts("mt-bench", 1)[0]["turns"][0]
    assert gen_prompts.normalize("  " + q.upper() + "\n") in banned


def _fake_sampler(tok, texts):
    """Sample of seed s: texts[s % len(texts)], closed by EOS unless it is None-marked as cut short."""
    def sampler(target_dir, model, tokenizer):
        def generate(prompts, max_new_tokens, temperature, seeds):
            assert temperature == 1.0 and len(prompts) == len(seeds)
            out = []
            for s in seeds:
                text, closed = texts[s % len(texts)]
                ids = tok.encode(text, add_special_tokens=False)
                out.append(ids + [tok.eos_token_id] if closed else ids)
            return out
        return generate
    return sampler


def test_filters_determinism_and_resume(tmp_path, tok, monkeypatch):
    bench = load_chat_prompts("mt-bench", 1)[0]["turns"][0]
    texts = [("How do I sort a list of dictionaries by a key in Python?", True),   # kept
             ("Explain how tides work and why there are two a day", False),        # cut short
             ("Hi?", True),                                                         # too short
             (bench, True),                                                         # a benchmark question
             ("How do I sort a list of dictionaries by a key in Python?", True),   # a repeat
             ("Plan a three day trip to Kyoto for a family of four", True)]         # kept
    # the two kept questions change with each round of six seeds, so new ones keep coming
    texts = [(t + (f" #{i}" if i and j in (0, 5) else ""), c) for i in range(4) for j, (t, c) in enumerate(texts)]
    monkeypatch.setattr(gen_prompts, "hf_sampler", _fake_sampler(tok, texts))
    kw = dict(backend="hf", tokenizer=tok, chunk=5)
    whole = gen_prompts.run("tiny", str(tmp_path / "whole.json"), 6, **kw)
    rows = json.loads(whole.read_text())
    got = [r["conversations"][0]["value"] for r in rows]
    assert len(got) == 6 and len(set(got)) == 6
    assert all("tides" not in q and q != "Hi?" and bench not in q for q in got)
    assert got[:2] == [texts[0][0], texts[5][0]]
    # the same run in two parts: the same file
    part = tmp_path / "part.json"
    gen_prompts.run("tiny", str(part), 3, **kw)
    gen_prompts.run("tiny", str(part), 6, **kw)
    assert json.loads(part.read_text()) == rows
    # gen-data reads it as ShareGPT: every question becomes a prompt
    convs = list(iter_sharegpt(str(whole)))
    assert [c[0]["value"] for c in convs] == got
    assert len(build_prompts(tok, convs, 384)) == 6
    with pytest.raises(ValueError, match="other settings: temperature 1.0 \\(this run: 0.7\\)"):
        gen_prompts.run("tiny", str(part), 8, temperature=0.7, **kw)
    with pytest.raises(ValueError, match="--temperature must be > 0"):
        gen_prompts.run("tiny", str(tmp_path / "g.json"), 2, temperature=0.0, **kw)


def test_hf_sampler_samples_by_seed_and_stops_at_eos():
    """The HF backend on a tiny target: a sample depends on its seed alone (not on its batch) and ends at its
    first EOS; another seed gives another sample."""
    from falcon_vllm.testing import tiny_llama

    class Tok:
        eos_token_id, pad_token_id = 4, 0

    generate = gen_prompts.hf_sampler("tiny", tiny_llama(vocab=64, seed=3), Tok())
    batch = generate([[1, 2, 3]] * 3, 12, temperature=1.0, seeds=[5, 6, 7])
    assert generate([[1, 2, 3]], 12, temperature=1.0, seeds=[6]) == batch[1:2]
    assert len({tuple(s) for s in batch}) == 3
    assert all(4 not in s[:-1] and (s[-1] == 4 or len(s) == 12) for s in batch)


def test_leads_open_the_user_turns_in_turn(tmp_path, tok, monkeypatch):
    """--leads: attempt i's user turn begins with the (i mod n)-th opening, the question holds it, a rerun with
    other leads is refused, and a file without any is an error."""
    prefix = gen_prompts.user_turn_prefix(tok)
    leads = ["Write a Python function", "Solve this math problem:"]
    lead_ids = [tok.encode(ln, add_special_tokens=False) for ln in leads]
    asked = []

    def sampler(target_dir, model, tokenizer):
        def generate(prompts, max_new_tokens, temperature, seeds):
            asked.extend(prompts)
            return [tok.encode(f" number {s} that keeps going", add_special_tokens=False) + [tok.eos_token_id]
                    for s in seeds]
        return generate

    monkeypatch.setattr(gen_prompts, "hf_sampler", sampler)
    out = gen_prompts.run("tiny", str(tmp_path / "q.json"), 5, backend="hf", tokenizer=tok, chunk=2,
                          leads=["", *leads, "  "])
    got = [r["conversations"][0]["value"] for r in json.loads(out.read_text())]
    assert asked == [prefix + lead_ids[i % 2] for i in range(len(asked))] and len(asked) >= 5
    assert got == [f"{leads[i % 2]} number {i} that keeps going" for i in range(5)]
    assert json.loads((tmp_path / "q.json.meta.json").read_text())["leads"] == leads
    with pytest.raises(ValueError, match="other settings: leads"):
        gen_prompts.run("tiny", str(tmp_path / "q.json"), 6, backend="hf", tokenizer=tok, leads=leads[:1])
    with pytest.raises(ValueError, match="other settings: leads .* \\(this run: None\\)"):
        gen_prompts.run("tiny", str(tmp_path / "q.json"), 6, backend="hf", tokenizer=tok)
    with pytest.raises(ValueError, match="--leads holds no opening"):
        gen_prompts.run("tiny", str(tmp_path / "e.json"), 2, backend="hf", tokenizer=tok, leads=[" ", ""])


def test_gen_dtype_reaches_vllm_and_is_kept_with_the_file(tmp_path, tok, monkeypatch):
    """--gen-dtype: vLLM's engine samples in it, the questions file records it (a resume in another dtype is
    refused), and transformers' backend, fp32 only, refuses bf16."""
    import falcon_vllm.vllm.generate as generate_mod

    made = []

    class Engine:
        def __init__(self, target_dir, max_model_len, max_num_seqs=128, dtype="float32"):
            made.append(dtype)

        def __call__(self, prompts, max_new_tokens, temperature=0.0, seeds=None):
            return [tok.encode(f" question {s} about sorting lists", add_special_tokens=False) + [tok.eos_token_id]
                    for s in seeds]

        def close(self):
            pass

    monkeypatch.setattr(generate_mod, "VLLMGenerator", Engine)
    out = gen_prompts.run("tiny", str(tmp_path / "q.json"), 3, backend="vllm", tokenizer=tok, gen_dtype="bfloat16")
    assert made == ["bfloat16"] and len(json.loads(out.read_text())) == 3
    assert json.loads((tmp_path / "q.json.meta.json").read_text())["gen_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="other settings: gen_dtype 'bfloat16' \\(this run: None\\)"):
        gen_prompts.run("tiny", str(tmp_path / "q.json"), 4, backend="vllm", tokenizer=tok)
    with pytest.raises(ValueError, match="--gen-dtype bfloat16 needs --backend vllm"):
        gen_prompts.run("tiny", str(tmp_path / "h.json"), 2, backend="hf", tokenizer=tok, gen_dtype="bfloat16")


def test_questions_that_spell_out_a_turn_are_dropped(tok):
    """A question closed by the end-of-turn token is still dropped when it writes a special token as plain text (a
    target sampling "<|im_start|>" with ordinary tokens) or holds a line that opens a chat turn (the target
    answering inside the user turn); an ordinary question that mentions the assistant is kept."""
    eos = {tok.eos_token_id}

    def ask(text, tail=()):
        ids = tok.encode(text, add_special_tokens=False) + list(tail) + [tok.eos_token_id]
        return gen_prompts.question(tok, ids, eos, 6)

    # "<|im_start|>" spelt with ordinary tokens (encoding the whole string would give the special token's id)
    plain = [t for piece in ("<", "|", "im", "_", "start", "|", ">") for t in tok.encode(piece, add_special_tokens=False)]
    assert tok.decode(plain) == "<|im_start|>" and not set(plain) & set(tok.all_special_ids)
    assert ask("Write a SQL query to average a column.\n", plain * 3) is None
    assert ask("Write a bash script that prints the disk usage.\n\nAssistant\n```bash\ndf -h\n```") is None
    assert ask("What is the time complexity of insertion sort?\n\nAssistant: It is O(n^2).") is None
    assert ask("Write a SQL query that lists every user.\n\nAssistant```sql\nSELECT * FROM users;\n```") is None
    assert ask("Write a SQL query that lists every user.\n\n  user : SELECT * FROM users;") is None
    kept = "Write a Python function that returns what an assistant should say first."
    assert ask(kept) == kept
    kept = "Explain this log line:\nuser_id: 42 logged in; assistant mode enabled."
    assert ask(kept) == kept


def test_added_special_tokens_count_as_special():
    """A tokenizer whose turn-start token is an added special token outside ``all_special_ids`` (as Qwen2.5's
    "<|im_start|>"): a question holding it, as its id or as text, is dropped."""
    from types import SimpleNamespace

    class Tok:
        all_special_ids, all_special_tokens = [9], ["<eos>"]
        added_tokens_decoder = {9: SimpleNamespace(content="<eos>", special=True),
                                8: SimpleNamespace(content="<|im_start|>", special=True),
                                7: SimpleNamespace(content="<tool>", special=False)}

        def decode(self, ids):
            words = {1: "Write", 2: "a", 3: "loop", 4: "<|im_start|>", 7: "<tool>", 8: "<|im_start|>"}
            return " ".join(words[i] for i in ids)

    tok = Tok()
    assert gen_prompts.special_tokens(tok) == {9: "<eos>", 8: "<|im_start|>"}
    assert gen_prompts.question(tok, [1, 2, 3, 9], {9}, 3) == "Write a loop"
    assert gen_prompts.question(tok, [1, 2, 3, 8, 9], {9}, 3) is None   # the id
    assert gen_prompts.question(tok, [1, 2, 3, 4, 9], {9}, 3) is None   # spelt out
    assert gen_prompts.question(tok, [1, 2, 3, 7, 9], {9}, 3) == "Write a loop <tool>"  # added, not special


def test_cli_passes_chunk(monkeypatch, tmp_path):
    """`--chunk` reaches run() (the unit of work a slow target loses to an interruption); below 1 is refused."""
    import argparse

    seen = {}
    monkeypatch.setattr(gen_prompts, "run", lambda *a, **kw: seen.update(kw) or tmp_path / "q.json")
    p = argparse.ArgumentParser()
    gen_prompts.add_arguments(p)
    assert gen_prompts.main(p.parse_args(["--target", "t", "--out", "q.json", "--chunk", "64"])) == 0
    assert seen["chunk"] == 64
    assert p.parse_args(["--out", "q.json"]).chunk == 512
    with pytest.raises(SystemExit, match="--chunk must be >= 1"):
        gen_prompts.main(p.parse_args(["--target", "t", "--out", "q.json", "--chunk", "0"]))
