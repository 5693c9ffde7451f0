"""What the maintained benchmarks share: where things are (``paths``), the machine (``machine``), the in-process
vLLM engines and their configuration names (``engines``), timers around an engine's methods (``timing``), the
held-out prompt sets (``prompts``) and the result files (``report``).

The tools in ``benchmarks/`` import it as ``harness`` (a script's own folder is first on ``sys.path``); the
studies in ``benchmarks/studies/`` put ``benchmarks/`` on the path first.
"""
