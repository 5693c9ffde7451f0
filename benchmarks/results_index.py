"""Write ``benchmarks/results/INDEX.md``: the page that answers each standing question, then one row per current
result (those outside ``archive/``).

    python benchmarks/results_index.py            # rewrite the index
    python benchmarks/results_index.py --check    # exit 1 if the index is stale (tests/test_docs.py runs this)
    python benchmarks/results_index.py --archive  # move every result no current page names into archive/ (git mv,
                                                  # links fixed), then rewrite the index

A result is current while the README, docs/ (the archive of findings aside), a model card or a benchmark script
names it, or a current result page links to it; ``--archive`` moves the others, and any a newer run generation
supersedes, into ``archive/``, which the index counts but does not list (docs/findings-archive.md names them).

A result is a ``<name>.json`` (with its ``<name>.md`` page when there is one) or a ``<name>.md`` page without
JSON. Each row gives:

- date: the JSON's own ``date`` field when it has one, else the day of the last commit of the file
  (``git log``; a file not committed yet gets today's date; an archived one the day of its last commit before
  the move);
- tool: the script in the JSON's ``command`` (``benchmarks/<tool>.py``, ``falcon-vllm <command>``), else
  the name's prefix;
- machine: the JSON's ``machine`` (or ``device``) field, shortened; for a JSON without one, the machine its name
  ends in (``_avx2``, ``_xeon``, ``_h100``, ...), marked "(name)";
- metric: the headline figure where the JSON's layout is one this script knows (A/B speedups, held-out
  top-1, soak verdicts, ...), else blank;
- cited by: the README, docs/ pages and model cards that name the page (brace and ``*`` patterns such as
  ``ab_v6_b1_{mt-bench,gsm8k}.md`` count);
- superseded: a newer run generation of the same measurement exists (names that differ only in a ``_v<N>``
  part, none counting as 1, e.g. ``ab_v3_b1_gsm8k`` -> ``ab_v6_b1_gsm8k``).

``--archive`` moves a result's JSON, page and plots; nothing is deleted.

Fast: one ``git log`` for every date, one read of each JSON and of each citing page.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import glob
import json
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
INDEX = os.path.join(RESULTS, "INDEX.md")
ARCHIVE = "archive"  # superseded results, under RESULTS
GENERATION = re.compile(r"_v(\d+)(?=_|$)")  # a run generation in a result's name: ab_v6_b1_gsm8k
MACHINE_SUFFIXES = {  # the machine a result's name ends in, for JSONs without a machine field
    "avx2": "AVX2 CPU", "avx512": "AVX-512 CPU", "amx": "AMX CPU", "epyc": "AMD EPYC", "xeon": "Intel Xeon",
    "spr": "Intel Sapphire Rapids", "h100": "NVIDIA H100",
}
CITING = ["README.md", "docs/*.md", "falcon_vllm/drafters/*/README.md"]
HISTORY = "docs/findings-archive.md"  # names archived runs too: a page it alone names is not current
SCRIPTS = ["benchmarks/*.py", "benchmarks/*.sh", "benchmarks/studies/*.py"]
# the standing questions and the pages that answer them (paths under benchmarks/results, or repository-relative)
QUESTIONS = [
    ("What does the shipped default gain on SmolLM2-135M-Instruct, against EAGLE-1 and vLLM's n-gram (the README's "
     "headline)?", "headline"),
    ("What does Falcon gain on Qwen2.5-Coder-1.5B-Instruct (the README's table)?", ["qwen15_v2.md"]),
    ("How does it compare with its peers on Qwen2.5-Coder-1.5B (EAGLE-1, n-gram, prompt lookup)?",
     ["qwen15_v1_baselines.md", "qwen15_v2.md"]),
    ("What ran on a GPU?", ["gpu/gpu_h100.md"]),
    ("Which vLLM versions does the plugin fit?", ["vllm_surface_0.34.0.md", "vllm_surface_0.33.0.md"]),
    ("What do all the measurements conclude?", ["../../docs/findings.md"]),
]
PREFIX_TOOLS = [  # name prefix -> tool, for results whose JSON names no command (first match wins)
    ("ab_arrivals", "ab_arrivals"), ("ab_", "ab_step"), ("heldout_eval", "heldout_eval"),
    ("training_ablation", "train_ablation"), ("training_", "falcon-vllm train"), ("learning_curves", "learning_curves"),
    ("e2e_", "bench_e2e"), ("profile_", "profile_step"), ("cpu_gemm_rows", "cpu_gemm_rows"),
    ("cpu_tree_attention", "cpu_tree_attention"), ("kernels_", "bench_kernels"), ("gpu_check", "gpu_check"),
    ("gpu_", "gpu_suite"), ("train_speed", "train_speed"), ("soak_", "soak_server"), ("serving_sim", "serving_sim"),
    ("lookup_oracle", "lookup_oracle"), ("draft_sampling", "draft_sampling"), ("draft_vocab", "draft_vocab"),
    ("draft_gemm_dtypes", "draft_gemm_dtypes"), ("gen_data_speed", "gen_data_speed"),
    ("gen_data", "falcon-vllm gen-data"),
    ("verify_cost", "verify_cost"), ("tree_", "falcon-vllm tune-tree"), ("ref_tau", "ref_tau"),
    ("memory_rounds", "memory_rounds"),
]


# ---------------------------------------------------------------------- the pieces of a row
def git_dates() -> tuple[dict[str, str], bool]:
    """{path relative to the repository: day of its last commit}, and whether git history was readable whole."""
    try:
        shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True,
                                 text=True, check=True).stdout.strip() == "true"
        log = subprocess.run(["git", "log", "--format=%x00%cs", "--name-only", "--no-renames", "--diff-filter=d",
                              "--", "benchmarks/results"],
                             cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}, False
    dates, day = {}, None
    for line in log.splitlines():
        if line.startswith("\0"):
            day = line[1:]
        elif line and day:
            dates.setdefault(line, day)  # newest commit first
    return dates, not shallow


def tool_of(name: str, data) -> str:
    command = data.get("command") if isinstance(data, dict) else None
    if command is None and isinstance(data, dict) and isinstance(data.get("commands"), (list, dict)):
        cmds = data["commands"]
        command = next(iter(cmds.values() if isinstance(cmds, dict) else cmds), None)
    if isinstance(command, list):
        command = " ".join(map(str, command))
    if isinstance(command, str):
        m = re.search(r"benchmarks/(?:studies/)?(\w+)\.(?:py|sh)", command)
        if m:
            return m.group(1)
        m = re.search(r"falcon-vllm (\w[\w-]*)", command)
        if m:
            return f"falcon-vllm {m.group(1)}"
    for prefix, tool in PREFIX_TOOLS:
        if name.startswith(prefix):
            return tool
    return ""


def machine_of(name: str, data) -> str:
    m = (data.get("machine") or data.get("device_name") or data.get("device")) if isinstance(data, dict) else None
    if not isinstance(m, str) or not m:
        tail = next((t for t in reversed(name.lower().split("_")) if t in MACHINE_SUFFIXES), None)
        return f"{MACHINE_SUFFIXES[tail]} (name)" if tail else ""
    m = re.split(r"; |, torch | \(torch", m)[0].strip()
    return m if len(m) <= 60 else m[:57] + "..."


def _x(v) -> str:
    return f"{v:.2f}x"


def metric_of(data) -> str:
    """The result's headline figure, for the layouts this script knows; '' for the others."""
    if not isinstance(data, dict):
        return ""
    rows = data.get("rows")
    if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
        r0 = rows[0]
        if "speedup_vs_base" in r0 and "config" in r0:  # ab_step, ab_arrivals
            base = data.get("baseline", r0.get("config"))
            others = [r for r in rows if r.get("config") != base]
            pick = next((r for r in others if r.get("config") == "falcon"), others[0] if others else None)
            if pick is None:
                return ""
            where = f"B={pick['batch_size']}" if "batch_size" in pick else (
                f"{pick['rate']}/s" if "rate" in pick else "")
            total = f" / {_x(pick['speedup_total'])}" if isinstance(pick.get("speedup_total"), (int, float)) else ""
            return f"{pick['config']} {_x(pick['speedup_vs_base'])}{total} {where}".strip()
        if "speedup_vs_vanilla" in r0 and "method" in r0:  # bench_e2e
            spec = [r for r in rows if r.get("method") != "vanilla" and r.get("speedup_vs_vanilla") is not None]
            if spec:
                r = max(spec, key=lambda r: r["speedup_vs_vanilla"])
                tau = f", tau {r['tau']:.2f}" if isinstance(r.get("tau"), (int, float)) else ""
                return f"best {r['method']} {_x(r['speedup_vs_vanilla'])}{tau} ({r.get('dataset', '')})"
        if "top1_by_block_position" in r0:  # heldout_eval
            top1 = ", ".join(f"{v:.3f}" for v in r0["top1_by_block_position"])
            tau = f", sim tau {r0['sim_tau']:.2f}" if isinstance(r0.get("sim_tau"), (int, float)) else ""
            return f"{r0.get('drafter', '')} {r0.get('dataset', '')}: top-1 {top1}{tau}".strip()
        if "tokens_per_step" in r0 and "est_speedup" in r0:  # serving_sim
            return f"{r0.get('policy', '')} {r0.get('dataset', '')}: {r0['tokens_per_step']:.2f} tokens/step"
        if "vs_first" in r0:  # cpu_gemm_rows, verify_cost
            last = rows[-1]
            n = last.get("rows", last.get("width", "?"))
            return f"{n} rows {last['vs_first']:.2f}x one"
        if "ms_per_step" in r0 and isinstance(r0["ms_per_step"], dict):  # profile_step
            return ", ".join(f"{r['config']} {r['ms_per_step'].get('step', 0):.1f} ms/step" for r in rows[:2])
    if "checks" in data and "failed" in data:  # gpu_check
        return f"{data['checks']} checks, {data['failed']} failed"
    if "greedy_mismatches" in data and "errors" in data:  # soak_server
        ok = not data.get("failures")
        return f"{'PASS' if ok else 'FAIL'}: {data.get('completed', '?')} completed, {data['errors']} errors"
    if "s_per_step" in data:  # train_speed
        return f"{data['s_per_step']:.3f} s/step ({data.get('device', '')})"
    return ""


def _expand(pattern: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [x for alt in m.group(1).split(",") for x in _expand(pattern[:m.start()] + alt + pattern[m.end():])]


def citations(stems: set[str], history: bool = True) -> dict[str, list[str]]:
    """{result stem: the pages (relative paths) that name it}; ``history=False`` leaves out the findings' archive."""
    cited: dict[str, list[str]] = {}
    token = re.compile(r"[\w.{},*/-]*?([\w{},*.-]+)\.(?:md|json|\{json,md\}|\{md,json\})")
    for spec in CITING:
        for page in sorted(glob.glob(os.path.join(REPO, spec))):
            rel = os.path.relpath(page, REPO)
            if rel == HISTORY and not history:
                continue
            text = open(page, encoding="utf-8").read()
            hits = set()
            for m in token.finditer(text):
                for name in _expand(m.group(1)):
                    name = name.replace("...", "*")
                    if "*" in name:
                        hits.update(fnmatch.filter(stems, name))
                    elif name in stems:
                        hits.add(name)
            for s in hits:
                cited.setdefault(s, []).append(rel)
    return cited


def superseded(stems: list[str]) -> dict[str, str]:
    """{stem: the stem of its family's newest generation} for every result that a newer generation replaces."""
    families: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for stem in stems:
        folder, name = os.path.split(stem.removeprefix(ARCHIVE + "/"))  # an archived result keeps its family
        m = GENERATION.search(name)
        key = GENERATION.sub("", name, count=1) if m else name
        families.setdefault((folder, key), []).append((int(m.group(1)) if m else 1, stem))
    out = {}
    for members in families.values():
        top, newest = max(members)
        out.update({stem: newest for gen, stem in members if gen < top})
    return out


LINK = re.compile(r"(\]\()([^)\s]+)(\))")


def current(stems: list[str]) -> set[str]:
    """The top-level results that stay out of ``archive/``: named by the README, docs/ (not the findings' archive),
    a model card or a benchmark script, or linked from such a result's page."""
    top = {s for s in stems if "/" not in s}
    keep = {s for s in citations(top, history=False) if s in top}
    scripts = "\n".join(open(p, encoding="utf-8").read() for spec in SCRIPTS
                         for p in glob.glob(os.path.join(REPO, spec)))
    keep |= {s for s in top if re.search(rf"(?<![\w.-]){re.escape(s)}(?![\w-])", scripts)}
    todo = list(keep)
    while todo:  # pages a current page links to
        page = os.path.join(RESULTS, todo.pop() + ".md")
        if not os.path.exists(page):
            continue
        for _, target, _ in LINK.findall(open(page, encoding="utf-8").read()):
            rel = os.path.relpath(os.path.normpath(os.path.join(RESULTS, target.split("#")[0])), RESULTS)
            stem = re.sub(r"(_accept|_speedup)?\.(md|json|png)$", "", rel)
            if stem in top and stem not in keep:
                keep.add(stem)
                todo.append(stem)
    return keep


def _move(src: str, dst: str, tracked: set[str]) -> None:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if os.path.relpath(src, REPO) in tracked:
        subprocess.run(["git", "mv", src, dst], cwd=REPO, check=True)
    else:
        os.replace(src, dst)


def _relink(moves: dict[str, str]) -> None:
    """Fix the relative links of the README, docs/, the model cards and every result page after ``moves``
    ({old path: new path}, absolute): a link to a moved file, and any link of a moved page."""
    back = {new: old for old, new in moves.items()}
    pages = [p for spec in CITING for p in glob.glob(os.path.join(REPO, spec))]
    pages += glob.glob(os.path.join(RESULTS, "**", "*.md"), recursive=True)
    for page in pages:
        was = os.path.dirname(back.get(page, page))
        text = open(page, encoding="utf-8").read()

        def fix(m):
            target, _, anchor = m.group(2).partition("#")
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or not target:
                return m.group(0)
            old = os.path.normpath(os.path.join(was, target))
            new = moves.get(old, old)
            if not os.path.exists(new):
                return m.group(0)
            rel = os.path.relpath(new, os.path.dirname(page)) + (f"#{anchor}" if anchor else "")
            return m.group(1) + rel + m.group(3)

        fixed = LINK.sub(fix, text)
        if fixed != text:
            with open(page, "w", encoding="utf-8") as f:
                f.write(fixed)


def archive(stems: list[str], keep: set[str] | None = None) -> list[str]:
    """Move every superseded result outside ``archive/`` (its .json, .md, .png and _accept/_speedup plots) there,
    and with ``keep`` every other top-level result not in it (git mv for tracked files; links fixed); returns the
    stems moved."""
    tracked = set(subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=REPO, capture_output=True,
                                 text=True).stdout.split()) if keep is not None else set()
    old = set(superseded(stems))
    if keep is not None:
        old |= {s for s in stems if "/" not in s and s not in keep}
    moved, moves = [], {}
    for stem in sorted(old):
        if stem.startswith(ARCHIVE + "/"):
            continue
        src = os.path.join(RESULTS, stem)
        dst = os.path.join(RESULTS, ARCHIVE, stem)
        for suffix in (".json", ".md", ".png", "_accept.png", "_speedup.png"):
            if os.path.exists(src + suffix):
                _move(src + suffix, dst + suffix, tracked)
                moves[src + suffix] = dst + suffix
        moved.append(stem)
    if moves and keep is not None:
        _relink(moves)
    return moved


# ---------------------------------------------------------------------- the index
def results() -> list[str]:
    """Stems (relative to benchmarks/results, without extension) of every result: JSON files and markdown pages."""
    stems = set()
    for ext in ("json", "md"):
        for p in glob.glob(os.path.join(RESULTS, "**", f"*.{ext}"), recursive=True):
            rel = os.path.relpath(p, RESULTS)
            if rel != "INDEX.md" and not rel.startswith("_scratch"):
                stems.add(rel[: -len(ext) - 1])
    return sorted(stems)


def build() -> tuple[list[list[str]], list[bool]]:
    """The index's rows (cells), and for each whether its date is fixed (from the JSON or a commit)."""
    dates, _ = git_dates()
    today = datetime.date.today().isoformat()
    stems = [s for s in results() if not s.startswith(ARCHIVE + "/")]
    cited = citations({os.path.basename(s) for s in stems}, history=False)
    newer = superseded(stems)
    rows, fixed = [], []
    for stem in stems:
        base = os.path.join(RESULTS, stem)
        data = None
        if os.path.exists(base + ".json"):
            try:
                with open(base + ".json") as f:
                    data = json.load(f)
            except ValueError:
                data = None
        page = _page(stem)
        # an archived result keeps the date of its last change before the move
        git_rels = [f"benchmarks/results/{s}" for s in dict.fromkeys([stem.removeprefix(ARCHIVE + "/"), stem])]
        day = data.get("date") if isinstance(data, dict) and isinstance(data.get("date"), str) else None
        known = day is not None
        if day is None:
            day = next((dates[r + e] for r in git_rels for e in (".json", ".md") if r + e in dates), None)
            known = day is not None
        name = os.path.basename(stem)
        by = ", ".join(cited.get(name, [])) or "-"
        cell = lambda s: s.replace("|", "/")
        result = f"[{stem}]({page})" + (f" (superseded by [{newer[stem]}]({_page(newer[stem])}))"
                                         if stem in newer else "")
        rows.append([day or today, result, cell(tool_of(name, data)), cell(machine_of(name, data)),
                     cell(metric_of(data)), by])
        fixed.append(known)
    return rows, fixed


HEADER = ["date", "result", "tool", "machine", "metric", "cited by"]


def _page(stem: str) -> str:
    return stem + (".md" if os.path.exists(os.path.join(RESULTS, stem + ".md")) else ".json")


def _answers(pages) -> str:
    if pages == "headline":  # the README's headline table: the runs benchmarks/headline.py names
        from headline import RUNS
        pages = [name + ".md" for _, name, _ in RUNS]
    return ", ".join(f"[{os.path.splitext(os.path.basename(p))[0]}]({p})" for p in pages)


def render(rows: list[list[str]]) -> str:
    cited = sum(r[5] != "-" for r in rows)
    archived = sum(s.startswith(ARCHIVE + "/") for s in results())
    lines = ["# Results index", "",
             "Generated by `python benchmarks/results_index.py` (do not edit by hand; `--check` tells whether it is "
             "current). What the runs conclude: [docs/findings.md](../../docs/findings.md).", "",
             "| question | the page that answers it |", "|---|---|"]
    lines += [f"| {q} | {_answers(pages)} |" for q, pages in QUESTIONS]
    lines += ["", f"Every current result, newest first: {len(rows)} results, {cited} of them cited by the README, "
              "docs/ or a model card. Date: the JSON's, else the file's last commit; metric: the headline figure "
              "where the layout is known (A/B: the shipped default's speedup, median pair / whole workload). "
              f"`archive/` holds {archived} older results: runs a later one replaced, named in "
              "[docs/findings-archive.md](../../docs/findings-archive.md).", "",
              "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    order = sorted(range(len(rows)), key=lambda i: (rows[i][0], rows[i][1]), reverse=True)
    lines += ["| " + " | ".join(rows[i]) + " |" for i in order]
    return "\n".join(lines) + "\n"


def _masked(text: str, masked_results: set[str]) -> str:
    """The index with the date cell blanked on the rows of ``masked_results`` (their dates are not fixed yet)."""
    out = []
    for line in text.splitlines():
        cells = line.split(" | ")
        if len(cells) > 2 and line.startswith("| ") and cells[1] in masked_results:
            line = "| ? | " + " | ".join(cells[1:])
        out.append(line)
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if INDEX.md is not what this script would write")
    p.add_argument("--archive", action="store_true",
                   help="move every result no current page or script names into archive/ first")
    args = p.parse_args(argv)
    if args.archive and not args.check:
        stems = results()
        for stem in archive(stems, keep=current(stems)):
            print(f"archived {stem}")
    rows, fixed = build()
    text = render(rows)
    if not args.check:
        with open(INDEX, "w") as f:
            f.write(text)
        print(f"wrote {os.path.relpath(INDEX, REPO)} ({len(rows)} results)")
        return 0
    old = open(INDEX).read() if os.path.exists(INDEX) else ""
    _, whole = git_dates()
    masked = {r[1] for r, ok in zip(rows, fixed) if not ok or not whole}  # dates that a commit will still change
    if _masked(old, masked) != _masked(text, masked):
        print(f"{os.path.relpath(INDEX, REPO)} is stale: run `python benchmarks/results_index.py`", file=sys.stderr)
        return 1
    print(f"{os.path.relpath(INDEX, REPO)} is current ({len(rows)} results)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
