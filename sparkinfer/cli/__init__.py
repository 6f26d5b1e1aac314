"""The ``sparkinfer`` command line.

One module per subcommand under ``sparkinfer/cli/``; each defines
``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
Subcommand modules are imported only when chosen, so ``sparkinfer plan`` never
imports torch and nothing here touches a GPU.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "selfcheck": "sparkinfer.cli.selfcheck",
    "plan": "sparkinfer.cli.plan",
    "demo": "sparkinfer.cli.demo",
    "calibrate": "sparkinfer.cli.calibrate",
}


def _available() -> dict:
    mods = {}
    for name, path in COMMANDS.items():
        try:
            mods[name] = importlib.import_module(path)
        except ModuleNotFoundError as e:
            if e.name != path:  # a real missing dependency inside the command: surface it
                raise
    return mods


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sparkinfer", description="sparse CKV transport for GLM-5.2")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, mod in _available().items():
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    args = ap.parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
