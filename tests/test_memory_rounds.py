"""benchmarks/memory_rounds.py: the growth it reports from a series of per-round memory readings."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import memory_rounds  # noqa: E402


def _series(trimmed):
    return [{"round": i, "rss_mib": t + 40.0, "rss_trimmed_mib": t, "seconds": 10.0 * i} for i, t in enumerate(trimmed)]


def test_growth_overall_and_over_the_last_rounds():
    s = memory_rounds.summarise(_series([100, 110, 130, 131, 131, 132]), tail=3)
    assert s["rounds"] == 6 and s["growth_trimmed_mib"] == 32 and s["growth_last_rounds_mib"] == 2
    assert s["last_rss_mib"] == 172
    assert memory_rounds.summarise(_series([100, 120]), tail=3)["growth_last_rounds_mib"] is None  # too few rounds


def test_markdown_has_a_row_and_a_series_per_config():
    series = {"vanilla": _series([100, 101, 101]), "falcon": _series([200, 230, 231])}
    res = {"name": "t", "command": "python benchmarks/memory_rounds.py", "machine": "x",
           "args": {"requests": 12, "temperature": 0.8, "max_new_tokens": 40, "max_words": 300, "same_prompts": False,
                    "max_num_seqs": 2, "tail": 1},
           "series": series, "summary": {k: memory_rounds.summarise(v, 1) for k, v in series.items()}}
    md = memory_rounds.markdown(res)
    assert "| falcon | 3 | 200 | 231 | +31 | +1 | 271 |" in md
    assert "- vanilla: 100, 101, 101" in md


def test_rss_is_read_for_this_process():
    assert 1 < memory_rounds.rss_mb(os.getpid()) < 1 << 20


def test_results_name_no_machine_paths():
    from harness.paths import DEFAULT_DRAFTER

    port = memory_rounds.portable  # the harness's, applied to every setting written
    assert port(DEFAULT_DRAFTER) == os.path.join("falcon_vllm", "drafters", "smollm2-135m-instruct")
    assert port(None) is None and port(12) == 12 and port("/elsewhere/model") == "model"
