"""The `pdserve` command. Each subcommand lives in the module that owns its idea;
this file only wires them up (imports are lazy so `pdserve --help` stays fast)."""
import argparse
import sys

from pdserve.errors import CheckpointError, RequestError

# subcommand -> (module, help). Each module defines add_arguments(parser) and run(args).
COMMANDS = {
    "serve": ("pdserve.server.launch", "serve a model over HTTP (OpenAI-compatible API)"),
    "generate": ("pdserve.generate", "generate offline for prompts given on the command line"),
    "bench": ("pdserve.bench.serve_bench", "benchmark any OpenAI-compatible server (vLLM's definitions)"),
    "report": ("pdserve.bench.report", "plot benchmark results and engine step logs"),
    "roofline": ("pdserve.bench.roofline", "measure this machine's limits and the model's phases against them"),
}


def main(argv: list[str] | None = None) -> int:
    import importlib

    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="pdserve", description="pdserve: an LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Only import the module of the command being run; the others just get a help line.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
            p.set_defaults(_module=module)
    args = parser.parse_args(argv)
    try:
        return importlib.import_module(args._module).run(args) or 0
    except (CheckpointError, RequestError) as e:
        print(f"pdserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
