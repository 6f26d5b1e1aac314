"""The ``sparkinfer`` command line.

One module per subcommand under ``sparkinfer/cli/``; each defines
``HELP`` (its description), ``add_arguments(parser)`` and ``run(args) -> int``.
Only the chosen subcommand's module is imported, so ``sparkinfer plan`` never
imports torch and nothing here touches a GPU.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help shown by `sparkinfer --help`)
COMMANDS = {
    "selfcheck": ("sparkinfer.cli.selfcheck", "encode/decode every record format on every backend"),
    "plan": ("sparkinfer.cli.plan", "capacity and per-step bytes/time for a serving profile"),
    "demo": ("sparkinfer.cli.demo", "one TP4/DCP4/MTP3 decode step on four host-fabric ranks, checked"),
    "calibrate": ("sparkinfer.cli.calibrate", "measure cost-model parameters on this machine"),
    "preflight": ("sparkinfer.cli.preflight",
                  "check a node before serving: GPUs, torch build, P2P, IOMMU/ACS/HMM, CUDA library, memory"),
    "serve": ("sparkinfer.cli.serve", "run `vllm serve` from a serve profile, checked against the model"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="sparkinfer", description="sparse CKV transport for GLM-5.2")
    sub = ap.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    extra = None
    for name, (path, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            mod = importlib.import_module(path)
            p.description = mod.HELP
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
            # A subcommand that wraps another program takes everything after "--" verbatim
            # (argparse would otherwise try to match it against the subcommand's positionals).
            if getattr(mod, "PASSTHROUGH", False) and "--" in argv:
                cut = argv.index("--")
                argv, extra = argv[:cut], argv[cut + 1:]
    args = ap.parse_args(argv)
    if extra is not None:
        args.extra = extra
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
