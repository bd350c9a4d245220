"""The `pdserve` command. Each subcommand lives in the module that owns its idea;
this file only wires them up (imports are lazy so `pdserve --help` stays fast)."""
import argparse
import itertools
import sys

from pdserve import __version__
from pdserve.errors import CheckpointError, ConfigError, RequestError

# subcommand -> (module, help). Each module defines add_arguments(parser) and run(args).
COMMANDS = {
    "serve": ("pdserve.entrypoints.serve", "serve a model over HTTP (OpenAI-compatible API)"),
    "proxy": ("pdserve.entrypoints.proxy", "serve the OpenAI API over prefill and decode workers (disaggregated)"),
    "generate": ("pdserve.generate", "generate offline for prompts given on the command line"),
    "bench": ("pdserve.bench.serve_bench", "benchmark any OpenAI-compatible server (vLLM's definitions)"),
    "perplexity": ("pdserve.bench.perplexity", "perplexity of a served model over a text file (sliding windows)"),
    "report": ("pdserve.bench.report", "plot benchmark results and engine step logs"),
    "roofline": ("pdserve.bench.roofline", "measure this machine's limits and the model's phases against them"),
    "simulate": ("pdserve.sim.cli", "predict latency and goodput of replicas or prefill/decode pools (simulator)"),
    "build-kernels": ("pdserve.backends.cpu.kernels.build", "compile the CPU kernels now instead of on first use"),
}
# Errors a user can act on: printed as one line, exit status 2. OSError: a file that is not there.
USER_ERRORS = (CheckpointError, ConfigError, RequestError, OSError)
# What a command needs beyond `pip install pdserve`: the extra (pyproject.toml) that brings the module.
EXTRAS = {"httpx": "bench", "matplotlib": "bench", "transformers": "baselines", "ray": "ray"}


def missing_extra(e: ModuleNotFoundError, command: str) -> str | None:
    """One line naming the extra to install, for a module that an extra brings (None otherwise)."""
    extra = EXTRAS.get((e.name or "").split(".")[0])
    if extra is None:
        return None
    return (f"pdserve {command}: error: this needs {e.name}, which `pip install 'pdserve[{extra}]'` "
            f"(or `pip install -e '.[{extra}]'` in a checkout) installs")


class Parser(argparse.ArgumentParser):
    """argparse, but a bad argument gets one line and a pointer to --help, not the whole usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n(see `{self.prog} --help`)\n")


def main(argv: list[str] | None = None) -> int:
    import importlib

    argv = sys.argv[1:] if argv is None else argv
    parser = Parser(prog="pdserve", description="pdserve: an LLM serving engine")
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # argparse would only say that COMMAND is missing; name the option instead
    leading = [a for a in itertools.takewhile(lambda a: a.startswith("-"), argv) if a not in ("-h", "--help", "--version")]
    if leading:
        parser.error(f"unrecognized option {leading[0]} (a command's options go after it: `pdserve COMMAND --help`)")
    # Only import the module of the command being run; the others just get a help line.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            try:
                importlib.import_module(module).add_arguments(p)
            except ModuleNotFoundError as e:
                if (line := missing_extra(e, name)) is None:
                    raise
                print(line, file=sys.stderr)
                return 2
            p.set_defaults(_module=module)
    args = parser.parse_args(argv)
    try:
        return importlib.import_module(args._module).run(args) or 0
    except ModuleNotFoundError as e:
        if (line := missing_extra(e, args.command)) is None:
            raise
        print(line, file=sys.stderr)
        return 2
    except USER_ERRORS as e:
        message = f"{e.strerror}: {e.filename}" if isinstance(e, OSError) and e.filename and e.strerror else e
        print(f"pdserve {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
