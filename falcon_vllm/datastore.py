"""A datastore of the target's own answers: drafts by retrieval where prompt lookup finds nothing.

Prompt lookup drafts from the request's own tokens.  A greedy target also repeats itself *across*
requests: its phrasing ("Here are some ...", "I hope this helps!"), code idioms and list scaffolds
recur from one answer to the next.  The datastore holds the target's answers to the drafter's
training prompts (``gen-data --save-answers``, the tokens it already produced for distillation) and,
for the last ``max_n`` .. ``min_n`` tokens of a request, proposes the continuation those answers
agree on: at each position, the token that most of the matching places continue with, among the
places still consistent with the draft so far (nothing where fewer than half agree on the first).
Drafting is retrieval (a sorted array of n-gram hashes): a step whose requests all have such drafts
runs no drafting pass (the drafter's KV cache for the verified tokens is written by its next pass).

Verification is unchanged, so outputs are exactly vanilla vLLM's whatever is drafted.

File format (NumPy ``.npz``): ``tokens`` int32, the answers concatenated, each followed by -1; ``min_n`` /
``max_n``.
"""

from __future__ import annotations

import os

import numpy as np

_MUL = np.uint64(0x9E3779B97F4A7C15)  # odd: n-gram hashes wrap modulo 2**64
MAX_MATCHES = 256  # places a draft is voted over (the first in the store), so a common n-gram stays cheap
# a draft only where at least this share of the matching places agree on its first token (else the drafter's chain):
# on the default's recorded steps it raised accepted tokens per step (MT-Bench 0.723 -> 0.732, GSM8K 0.967 -> 0.986,
# HumanEval 1.570 -> 1.567) with fewer verified rows (lookup_oracle_datastore.md)
MIN_SHARE = 0.5


def _hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """Hash of every n-gram ``tokens[i:i + n]`` (wrapping uint64 arithmetic), [len - n + 1]."""
    L = len(tokens) - n + 1
    h = np.zeros(max(L, 0), np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * _MUL + tokens[j:j + L].astype(np.uint64)
    return h


class Datastore:
    """``draft(history, length)``: the continuation the stored answers agree on after the history's longest
    stored suffix of ``max_n`` down to ``min_n`` tokens (an empty list when none is stored)."""

    def __init__(self, tokens: np.ndarray, min_n: int = 3, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"falcon-vllm: datastore: need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.tokens = np.asarray(tokens, dtype=np.int64)
        if len(self.tokens) and self.tokens[-1] >= 0:  # every answer ends in -1: a continuation never runs off
            self.tokens = np.append(self.tokens, -1)
        self.min_n, self.max_n = min_n, max_n
        self.index: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # built by the first draft (or build())

    def build(self) -> "Datastore":
        """Index every n-gram of ``min_n`` .. ``max_n`` tokens (about a second per million stored tokens)."""
        T = self.tokens
        for n in range(self.min_n, self.max_n + 1):
            L = len(T) - n  # places with a continuation token after the n-gram
            if L <= 0:
                self.index[n] = (np.zeros(0, np.uint64), np.zeros(0, np.int64))
                continue
            ok = T[n:n + L] >= 0
            for j in range(n):
                ok &= T[j:j + L] >= 0
            pos = np.nonzero(ok)[0]
            keys = _hashes(T, n)[pos]
            order = np.argsort(keys, kind="stable")
            self.index[n] = (keys[order], pos[order] + n)  # hash -> where the continuation starts
        return self

    @classmethod
    def from_answers(cls, segments, min_n: int = 3, max_n: int = 4) -> "Datastore":
        """From token sequences (one per answer)."""
        parts = []
        for s in segments:
            parts += [np.asarray(s, dtype=np.int64), np.array([-1])]
        return cls(np.concatenate(parts) if parts else np.zeros(0, np.int64), min_n, max_n)

    def save(self, path: str) -> None:
        """A NumPy ``.npz`` file (not safetensors: vLLM would load a drafter directory's ``*.safetensors`` as
        weights)."""
        with open(path, "wb") as f:  # a file object: np.savez would append .npz to a name without it
            np.savez(f, tokens=self.tokens.astype(np.int32), min_n=self.min_n, max_n=self.max_n,
                     format=np.array("falcon-vllm datastore"))

    @classmethod
    def load(cls, path: str) -> "Datastore":
        if not os.path.isfile(path):
            raise ValueError(f"falcon-vllm: datastore {path!r} does not exist")
        try:
            with np.load(path, allow_pickle=False) as f:
                tokens, min_n, max_n = f["tokens"], int(f["min_n"]), int(f["max_n"])
        except Exception as e:
            raise ValueError(f"falcon-vllm: datastore {path!r} could not be read ({type(e).__name__}: {e}); build it "
                             "with `falcon-vllm datastore`") from None
        if tokens.ndim != 1 or tokens.dtype.kind != "i":
            raise ValueError(f"falcon-vllm: datastore {path!r}: 'tokens' must be a 1-D integer array")
        return cls(tokens, min_n, max_n)

    def __len__(self) -> int:
        return len(self.tokens)

    def max_token(self) -> int:
        return int(self.tokens.max()) if len(self.tokens) else -1

    def draft(self, history, length: int) -> list[int]:
        if not self.index:
            self.build()
        hist = np.asarray(history, dtype=np.int64)
        for n in range(min(self.max_n, len(hist)), self.min_n - 1, -1):
            keys, starts = self.index[n]
            h = _hashes(hist[-n:], n)[0]
            lo, hi = np.searchsorted(keys, h, "left"), np.searchsorted(keys, h, "right")
            if lo == hi:
                continue
            at = starts[lo:min(hi, lo + MAX_MATCHES)]
            at = at[(self.tokens[at[:, None] - n + np.arange(n)] == hist[-n:]).all(1)]  # drop hash collisions
            out = []
            while len(at) and len(out) < length:
                nxt = self.tokens[at]
                vals, counts = np.unique(nxt[nxt >= 0], return_counts=True)
                if not len(vals):
                    break
                best = int(np.argmax(counts))
                if not out and counts[best] < MIN_SHARE * len(at):
                    return []  # the stored answers disagree on what comes next
                tok = int(vals[best])
                out.append(tok)
                at = at[nxt == tok] + 1
            if out:
                return out
        return []


# ---------------------------------------------------------------------------- falcon-vllm datastore
def add_arguments(p) -> None:
    p.add_argument("--answers", required=True,
                   help="a `falcon-vllm gen-data --save-answers` file: the target's answers to the training prompts")
    p.add_argument("--out", required=True,
                   help="the datastore file to write (e.g. <drafter dir>/datastore.npz)")
    p.add_argument("--num-conversations", type=int, default=0,
                   help="the first N conversations (0 = all), less the last 1/16 of them, which `falcon-vllm train` "
                        "holds out: the store holds what the drafter trained on")
    p.add_argument("--min-n", type=int, default=3, help="shortest suffix looked up (default 3)")
    p.add_argument("--max-n", type=int, default=4, help="longest suffix looked up (default 4)")


def from_answers_file(path: str, num_conversations: int = 0, min_n: int = 3, max_n: int = 4) -> tuple[Datastore, int]:
    """(the datastore, conversations stored) of a ``gen-data --save-answers`` file: the answer (loss-masked) tokens of
    the first ``num_conversations`` (0: all) less the last 1/16, which ``falcon-vllm train`` holds out."""
    from safetensors import safe_open

    try:
        with safe_open(path, "np") as f:
            tokens, mask, offs = f.get_tensor("tokens"), f.get_tensor("loss_mask"), f.get_tensor("offsets")
    except Exception as e:
        raise ValueError(f"falcon-vllm: datastore: answers file {path} could not be read ({type(e).__name__}: {e})"
                         ) from None
    n = len(offs) - 1 if num_conversations <= 0 else min(num_conversations, len(offs) - 1)
    n -= max(1, n // 16) if n > 1 else 0  # train's held-out conversations (split_held_out) stay out
    segs = [tokens[a:b][mask[a:b] == 1] for a, b in zip(offs[:n], offs[1:n + 1])]
    return Datastore.from_answers(segs, min_n, max_n), n


def main(args) -> int:
    store, n = from_answers_file(args.answers, args.num_conversations, args.min_n, args.max_n)
    store.save(args.out)
    print(f"falcon-vllm datastore: {n} conversations, {len(store) - n:,} answer tokens, "
          f"{args.min_n}-{args.max_n}-grams -> {args.out} ({os.path.getsize(args.out) / 2 ** 20:.1f} MiB)")
    return 0
