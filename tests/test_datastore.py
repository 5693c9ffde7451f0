"""The datastore of the target's answers (retrieval drafts where prompt lookup finds nothing)."""

import numpy as np
import pytest

from falcon_vllm.datastore import Datastore

ANSWERS = [[5, 6, 7, 8, 9, 10], [1, 6, 7, 8, 9, 11], [2, 6, 7, 8, 12], [3, 4, 6, 7, 8, 9, 10, 13]]


def test_draft_votes_the_continuation_of_the_longest_stored_suffix():
    st = Datastore.from_answers(ANSWERS, min_n=2, max_n=3)
    # after (6, 7, 8): 9 three times against 12 once, then 10 twice against 11 once among the places still agreeing
    assert st.draft([0, 6, 7, 8], 4) == [9, 10, 13]          # 13: the only place left continues with it, then ends
    assert st.draft([0, 6, 7, 8], 2) == [9, 10]              # at most the asked length
    assert st.draft([0, 6, 7, 8], 0) == []
    # the longest suffix wins: (4, 6, 7) occurs once, so its place decides, not the majority after (6, 7)
    st3 = Datastore.from_answers(ANSWERS + [[6, 7, 20]] * 5, min_n=2, max_n=3)  # (6, 7): 20 five times, 8 four
    assert st3.draft([4, 6, 7], 1) == [8] and st3.draft([0, 6, 7], 1) == [20]
    # no stored suffix of min_n..max_n tokens, a history shorter than min_n, answers never bridged
    assert st.draft([7, 6], 4) == [] and st.draft([6], 4) == [] and st.draft([10, 1], 4) == []


def test_no_draft_where_the_stored_answers_disagree():
    """Fewer than half of the matching places agreeing on the next token: no draft (the drafter's chain drafts)."""
    st = Datastore.from_answers([[1, 2, 3], [1, 2, 4], [1, 2, 5], [1, 2, 5, 6]], min_n=2, max_n=2)
    assert st.draft([1, 2], 4) == [5, 6]  # 5 at two of four places: half agree
    st = Datastore.from_answers([[1, 2, 3], [1, 2, 4], [1, 2, 5]], min_n=2, max_n=2)
    assert st.draft([1, 2], 4) == []      # one in three


def test_drafts_stop_at_an_answers_end():
    st = Datastore.from_answers([[1, 2, 3], [4, 5, 6, 7]], min_n=2, max_n=2)
    assert st.draft([1, 2], 8) == [3]  # the first answer ends there: nothing from the second one follows
    assert Datastore(np.array([1, 2, 3]), 2, 2).draft([1, 2], 8) == [3]  # a store not ending in -1


def test_save_load_round_trip_and_clear_errors(tmp_path):
    st = Datastore.from_answers(ANSWERS, min_n=2, max_n=3)
    path = str(tmp_path / "datastore.npz")
    st.save(path)
    back = Datastore.load(path)
    assert (back.min_n, back.max_n) == (2, 3) and np.array_equal(back.tokens, st.tokens)
    assert back.draft([0, 6, 7, 8], 4) == st.draft([0, 6, 7, 8], 4) and back.max_token() == 13
    with pytest.raises(ValueError, match="does not exist"):
        Datastore.load(str(tmp_path / "missing.npz"))
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a datastore")
    with pytest.raises(ValueError, match="could not be read.*falcon-vllm datastore"):
        Datastore.load(str(bad))
    with pytest.raises(ValueError, match="min_n <= max_n"):
        Datastore(np.array([1, 2]), 3, 2)


def test_cli_stores_the_training_answers_only(tmp_path, capsys):
    """`falcon-vllm datastore` keeps the loss-masked (answer) tokens of a gen-data answers file, one segment per
    conversation, of the first --num-conversations less the last 1/16 (train's held-out set)."""
    from safetensors.numpy import save_file

    from falcon_vllm.cli import main

    toks, mask, offs = [], [], [0]
    for i in range(18):  # conversation i: a prompt token, then the answer (i, i + 1000)
        toks += [50000 + i, i, i + 1000]
        mask += [0, 1, 1]
        offs.append(len(toks))
    save_file({"tokens": np.array(toks, np.int32), "loss_mask": np.array(mask, np.uint8),
               "offsets": np.array(offs, np.int64)}, str(tmp_path / "a.st"))
    out = str(tmp_path / "ds.npz")
    assert main(["datastore", "--answers", str(tmp_path / "a.st"), "--out", out, "--min-n", "2"]) == 0
    st = Datastore.load(out)
    assert st.tokens.tolist() == [t for i in range(17) for t in (i, i + 1000, -1)] and st.min_n == 2  # 18 // 16 out
    assert main(["datastore", "--answers", str(tmp_path / "a.st"), "--out", out, "--num-conversations", "4"]) == 0
    assert Datastore.load(out).tokens.tolist() == [0, 1000, -1, 1, 1001, -1, 2, 1002, -1]
    capsys.readouterr()
    assert main(["datastore", "--answers", str(tmp_path / "missing.st"), "--out", out]) == 1  # the error, no traceback
    err = capsys.readouterr().err
    assert err.startswith("falcon-vllm: datastore: answers file") and "could not be read" in err
