"""`pdserve build-kernels`: compile the CPU kernels ahead of time (README's install command runs it),
so that the first `pdserve serve`, `generate` or `LLM(...)` imports them instead of compiling."""
import argparse
import logging
import sys

from pdserve.backends.cpu import kernels


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--isa", default="auto", choices=["auto", "all", *kernels.ISAS],
                        help="which build: auto = the one serve would use (default; PDSERVE_CPU_ISA), all = every one "
                             "this CPU runs (the tests run each)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.isa == "all":
        isas = kernels.supported_isas()
    elif args.isa == "auto":
        isas = [isa for isa in [kernels.selected_isa()] if isa]
    else:
        isas = [args.isa] if args.isa in kernels.supported_isas() else []
    if not isas:
        print(f"pdserve build-kernels: this CPU runs no {'' if args.isa in ('all', 'auto') else args.isa + ' '}"
              "kernel build: the engine will use torch's ops", file=sys.stderr)
        return 1
    for isa in isas:
        try:
            ops = kernels.load_cpu_ops(isa)
        except Exception as e:   # no compiler, a failing one: say so in one line
            lines = str(e).strip().splitlines()
            print(f"pdserve build-kernels: could not build the {isa} kernels ({lines[-1] if lines else type(e).__name__});"
                  " the engine will use torch's ops", file=sys.stderr)
            return 1
        print(f"{isa}: {ops.__file__}")
    return 0
