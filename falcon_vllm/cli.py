"""The ``falcon-vllm`` command.

Each subcommand lives in its own module that defines ``add_arguments(parser)`` and ``main(args)``;
this file only dispatches, so heavy imports (vLLM, torch) happen only for the command that runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS = {
    "prepare-models": ("falcon_vllm.models_cli", "convert the offline models (GGUF in PyPI packages) to HF dirs"),
    "demo": ("falcon_vllm.vllm.demo", "answer MT-Bench questions with and without falcon; compare speed and outputs"),
    "serve": ("falcon_vllm.vllm.serve", "start vLLM's OpenAI-compatible server (same flags as `vllm serve`)"),
    "gen-data": ("falcon_vllm.train.gen_command", "regenerate conversations with the target and store its features"),
    "gen-prompts": ("falcon_vllm.train.gen_prompts", "sample user questions from the target itself (more prompts for gen-data)"),
    "train": ("falcon_vllm.train.train_command", "train a Falcon (CSGD) or EAGLE drafter on stored features"),
    "convert": ("falcon_vllm.convert", "convert an official Falcon checkpoint to a falcon-vllm drafter dir"),
    "datastore": ("falcon_vllm.datastore", "store the target's answers for retrieval drafts (serving's datastore)"),
    "tune-tree": ("falcon_vllm.tune_tree", "fit a decoding tree to measured acceptance and verify cost"),
    "bench": ("falcon_vllm.bench_cli", "end-to-end speedup of falcon against vanilla vLLM, measured in one run"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: falcon-vllm <command> [options]\n\ncommands:")
        for name, (_, help_) in COMMANDS.items():
            print(f"  {name:15s} {help_}")
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(f"falcon-vllm: unknown command {name!r}; run `falcon-vllm --help`", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    if hasattr(module, "cli"):  # commands that parse their own argv (serve forwards to vLLM)
        return int(module.cli(argv[1:]) or 0)
    parser = argparse.ArgumentParser(prog=f"falcon-vllm {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    args.given = given_options(module.add_arguments, argv[1:])
    try:
        return int(module.main(args) or 0)
    except (ValueError, FileNotFoundError) as e:  # the project's own errors: the message alone, no traceback
        if not str(e).startswith("falcon-vllm:"):
            raise
        print(e, file=sys.stderr)
        return 1


def given_options(add_arguments, argv: list[str]) -> set[str]:
    """The dests of the options ``argv`` gives, whatever their values (a value equal to the default counts): the
    same arguments parsed without defaults.  A command's ``main`` reads it as ``args.given``."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
