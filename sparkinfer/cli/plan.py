"""``sparkinfer plan``: KV capacity of a serving profile (bytes per token per rank, tokens that fit).

``--profile NAME`` takes TP, DCP, MTP, record format, indexer layout, block size and KV budget
from a serve profile (``profiles/serve/NAME.toml``, the one ``sparkinfer serve --profile`` runs);
a flag given beside it wins. ``--hw NODE`` names the hardware cost profile
(``sparkinfer/hw_profiles/NODE.json``) that the per-path table models.

The output is a list of sections (title, column names, rows) printed as rich
tables. Further tables (e.g. predicted
bytes and time per transport path) plug in with ``add_section(build, add_args)``:
``build(args, plan) -> Section | None`` runs after the capacity table and
``add_args(parser)`` declares the options it reads. Never imports torch.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from typing import Callable, Optional

from sparkinfer.core import costmodel as cm
from sparkinfer.core.capacity import GIB, INDEXER_MODES, CapacityPlan, CapacityProfile, capacity_plan, freed_tokens, replica_capacity
from sparkinfer.core.layouts import MAIN_LAYOUTS, layout
from sparkinfer.core.policy import StepPolicy
from sparkinfer.core.policy_table import decode_rows, policy_rows

HELP = "KV capacity plan: bytes per token per rank, KV tokens that fit, max context"


@dataclass(frozen=True)
class Section:
    title: str
    columns: tuple[str, ...]
    rows: list[tuple[str, ...]]


SectionBuilder = Callable[[argparse.Namespace, CapacityPlan], Optional[Section]]
_SECTIONS: list[tuple[SectionBuilder, Optional[Callable[[argparse.ArgumentParser], None]]]] = []


def add_section(build: SectionBuilder,
                add_args: Optional[Callable[[argparse.ArgumentParser], None]] = None) -> None:
    """Register a table printed after the capacity table (and the options it needs)."""
    _SECTIONS.append((build, add_args))


# What plan sizes when neither a flag nor --profile says otherwise: GLM-5.2's main profile.
DEFAULTS = dict(tp=4, dcp=4, interleave=1, mtp=3, format="nvfp4_368", indexer="replicated", kv_gb=10.0,
                block_size=64, max_num_seqs=16)


def add_arguments(p: argparse.ArgumentParser) -> None:
    formats = [lay.short for lay in MAIN_LAYOUTS]
    d = DEFAULTS
    p.add_argument("--profile", default=None,
                   help="serve profile (name in profiles/serve/ or .toml path) whose topology, format and kv_gb "
                        "to size; flags given beside it win")
    p.add_argument("--tp", type=int, default=None, help=f"tensor-parallel size = GPUs (default {d['tp']})")
    p.add_argument("--dcp", type=int, default=None,
                   help=f"decode-context-parallel size, divides tp (default {d['dcp']})")
    p.add_argument("--interleave", type=int, default=None,
                   help="DCP interleave (cp_kv_cache_interleave_size, default 1)")
    p.add_argument("--mtp", type=int, default=None,
                   help=f"speculative tokens; > 0 adds the MTP layer's caches (default {d['mtp']})")
    p.add_argument("--format", default=None,
                   help=f"main record format: {', '.join(formats)} (or full name / width; default {d['format']})")
    p.add_argument("--indexer", choices=INDEXER_MODES, default=None, help=f"default {d['indexer']}")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--kv-gb", type=float, default=None,
                        help=f"KV cache budget per GPU in GiB (2**30 bytes, default {d['kv_gb']:g})")
    budget.add_argument("--kv-bytes", type=int, default=None, help="KV cache budget per GPU in bytes")
    p.add_argument("--block-size", type=int, default=None, help=f"tokens per cache page (default {d['block_size']})")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"requests per step (vLLM's max_num_seqs), which sizes sparkinfer's buffers (default "
                        f"{d['max_num_seqs']})")
    p.add_argument("--concurrency", type=int, default=1,
                   help="requests sharing the cache, for the per-request max context")
    p.add_argument("--json", action="store_true",
                   help="print JSON: the capacity plan, `reservations` {buffer: bytes per rank} that patched vLLM "
                        "takes out of the KV budget, `reserved_bytes`, their sum, and `reservation_tokens` {buffer: "
                        "tokens of context it costs}")
    for _, add_args in _SECTIONS:
        if add_args is not None:
            add_args(p)


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill what no flag gave from ``--profile`` (a serve profile), else ``DEFAULTS``; in place."""
    given = {}
    if getattr(args, "profile", None) is not None:
        from sparkinfer.cli import serve

        data = serve.load_profile(args.profile)
        given = serve.capacity_fields(data)
        given["format"] = given.pop("record_format")
        if data.get("kv_gb") is not None:
            given["kv_gb"] = data["kv_gb"]
        if data["vllm"].get("max_num_seqs") is not None:
            given["max_num_seqs"] = data["vllm"]["max_num_seqs"]
        args.profile_data = data
    for key, default in DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, given.get(key, default))
    if not hasattr(args, "kv_bytes"):
        args.kv_bytes = None
    return args


def profile_from_args(args: argparse.Namespace) -> CapacityProfile:
    resolve_args(args)
    kv = args.kv_bytes if args.kv_bytes is not None else int(args.kv_gb * GIB)
    return CapacityProfile(tp=args.tp, dcp=args.dcp, mtp=args.mtp, record_format=args.format,
                           indexer=args.indexer, kv_bytes=kv, interleave=args.interleave,
                           block_size=args.block_size)


def reservations(args: argparse.Namespace) -> dict[str, int]:
    """{buffer: bytes per rank} that patched vLLM reserves out of the KV budget for this plan (the
    engine's own rules, ``sparkinfer.vllm.reservations``; the profile's sparkinfer settings, the
    defaults without one): the attention arena always (a record format), the selected path's buffers
    where it can run (not at DCP1, in stock mode or with a sharded indexer)."""
    from sparkinfer.cli import serve

    prof = profile_from_args(args)
    data = getattr(args, "profile_data", None) or {"vllm": {}, "sparkinfer": {}}
    if prof.indexer != "replicated":  # vLLM's own sharded indexer: stock DCP, no selected path
        data = {**data, "sparkinfer": {**data["sparkinfer"], "mode": "stock"}}
    vllm = {**data["vllm"], "tensor_parallel_size": prof.tp, "decode_context_parallel_size": prof.dcp,
            "kv_cache_dtype": layout(prof.record_format).name, "max_num_seqs": args.max_num_seqs}
    vllm.pop("speculative_config", None)
    if prof.mtp:
        vllm["speculative_config"] = {"method": "mtp", "num_speculative_tokens": prof.mtp}
    geo = prof.geometry
    hf = {"num_hidden_layers": geo.num_layers, "num_attention_heads": geo.num_heads, "index_topk": geo.topk,
          "index_n_heads": geo.index_heads, "index_head_dim": geo.index_dim}
    return serve.reservations({**data, "vllm": vllm}, hf, prof.kv_bytes)[0]


def capacity_of(args: argparse.Namespace, held: dict[str, int] | None = None) -> CapacityPlan:
    """The capacity plan of the KV budget less sparkinfer's buffers (``held``: ``reservations``;
    the replica store is not subtracted: the replica table sizes it)."""
    prof = profile_from_args(args)
    held = reservations(args) if held is None else held
    buffers = sum(v for k, v in held.items() if k != "replica_store")
    return capacity_plan(replace(prof, kv_bytes=prof.kv_bytes - buffers))


def _num(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:,.1f}"


def capacity_section(args: argparse.Namespace, plan: CapacityPlan) -> Section:
    prof = plan.profile
    other = capacity_plan(replace(prof, indexer=INDEXER_MODES[prof.indexer == INDEXER_MODES[0]]))
    granule = prof.block_size * prof.dcp
    per_request = plan.kv_tokens // args.concurrency // granule * granule
    delta = (plan.kv_tokens / other.kv_tokens - 1) * 100 if other.kv_tokens else float("nan")
    idx_where = "on every rank" if prof.indexer == "replicated" else f"/ {prof.dcp} ranks"
    rows = [
        ("profile", f"TP{prof.tp} DCP{prof.dcp} (interleave {prof.interleave}) MTP{prof.mtp}",
         f"{prof.geometry.name}, one GPU per TP rank"
         + (f", serve profile {args.profile}" if getattr(args, "profile", None) else "")),
        ("main record", f"{layout(plan.record_format).short} ({plan.record_bytes} B)",
         plan.record_format),
        ("main bytes / token / rank", _num(plan.main_bytes_per_token),
         f"{plan.main_layers} layers x {plan.record_bytes} B / {prof.dcp}"),
        (f"indexer bytes / token / rank ({prof.indexer})", _num(plan.indexer_bytes_per_token_avg),
         f"{plan.indexer_layers} layers x 132 B {idx_where}"),
        ("total bytes / token / rank", _num(plan.bytes_per_token), "average over the sequence"),
        ("KV budget / GPU", f"{prof.kv_bytes / GIB:,.2f} GiB", f"{prof.kv_bytes:,} B"),
        ("KV tokens that fit", f"{plan.kv_tokens:,}",
         f"whole blocks of {prof.block_size} x {prof.dcp} tokens"),
        ("tokens on the fullest rank", f"{plan.local_tokens:,}",
         f"{plan.bytes_used:,} B used"),
        (f"max context / request (concurrency {args.concurrency})", f"{per_request:,}", ""),
        (f"KV tokens with a {other.profile.indexer} indexer", f"{other.kv_tokens:,}",
         f"this profile: {delta:+.1f}%"),
    ]
    return Section("KV capacity", ("quantity", "value", "how"), rows)


def reservation_tokens(plan: CapacityPlan, held: dict[str, int]) -> dict[str, int]:
    """{buffer: tokens of context it costs} against ``plan`` (the budget less the buffers)."""
    return {name: freed_tokens(plan, b) for name, b in held.items()}


def reservation_section(args: argparse.Namespace, held: dict[str, int]) -> Section:
    plan = capacity_of(args, held)
    tokens = reservation_tokens(plan, held)
    rows = [(name, f"{b / 2**20:,.1f}", f"{b:,}", f"{tokens[name]:,}") for name, b in held.items()]
    total = sum(held.values())
    rows.append(("reserved_bytes", f"{total / 2**20:,.1f}", f"{total:,}", f"{freed_tokens(plan, total):,}"))
    rows.append(("KV tokens that fit beside the buffers", "", "", f"{plan.kv_tokens:,}"))
    return Section("sparkinfer buffers reserved out of the KV budget per GPU (patch 0008; the replica store's "
                   "window comes from what is left); tokens: the context each costs",
                   ("buffer", "MiB", "bytes", "tokens of context"), rows)


def sections(args: argparse.Namespace) -> list[Section]:
    plan = capacity_plan(profile_from_args(args))
    out = [capacity_section(args, plan)]
    held = reservations(args)
    if held:
        out.append(reservation_section(args, held))
    for build, _ in _SECTIONS:
        s = build(args, plan)
        if s is not None:
            out.append(s)
    return out


def print_sections(out: list[Section], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    for s in out:
        table = Table(title=s.title)
        for c in s.columns:
            table.add_column(c)
        for row in s.rows:
            table.add_row(*row)
        console.print(table)


def run(args: argparse.Namespace) -> int:
    if args.concurrency < 1:
        raise SystemExit("sparkinfer plan: --concurrency must be >= 1")
    try:
        if getattr(args, "json", False):
            print(json.dumps(as_json(args), indent=2))
            return 0
        out = sections(args)
    except ValueError as e:
        raise SystemExit(f"sparkinfer plan: {e}") from None
    print_sections(out)
    return 0


def as_json(args: argparse.Namespace) -> dict:
    """What ``--json`` prints: the capacity plan (of the budget less the buffers), the reservations
    and their sum, and the exchange buffers' share (issue #16 bounds it by 512 MiB per rank)."""
    from dataclasses import asdict

    from sparkinfer.core.reservations import exchange_bytes

    held = reservations(args)
    plan = capacity_of(args, held)
    capacity = {k: v for k, v in asdict(plan).items() if k != "profile"}
    prof = plan.profile
    return {"profile": getattr(args, "profile", None), "kv_budget_bytes": profile_from_args(args).kv_bytes,
            "topology": {"tp": prof.tp, "dcp": prof.dcp, "mtp": prof.mtp, "max_num_seqs": args.max_num_seqs},
            "capacity": capacity, "reservations": held, "reserved_bytes": sum(held.values()),
            "reservation_tokens": reservation_tokens(plan, held),
            "exchange_bytes": exchange_bytes(held)}


def add_policy_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hw", default=None,
                   help="hardware cost profile (name in sparkinfer/hw_profiles or JSON path): adds the per-path table")
    p.add_argument("--batch", type=int, default=1, help="requests per step for the per-path table")
    p.add_argument("--reuse-new", type=float, default=0.3,
                   help="share of the remote union not yet held, for selected+reuse (default 0.3)")
    p.add_argument("--kernels", choices=("floor", "measured"), default="floor",
                   help="kernel terms of the --hw tables: floor (the profile's: kernels at about the hardware's "
                        "speed) or measured (sparkinfer's kernels as timed on a GPU, scaled to the profile's GPU, "
                        "sparkinfer/core/kernel_fit.py); measured adds the floor rows to the decode tokens/s table")
    p.add_argument("--kernel-results", default=None,
                   help="GPU run JSON (file or folder) that --kernels measured fits (default benchmarks/results/gpu)")


def measured_kernels(args: argparse.Namespace):
    """The kernel fit of ``--kernels measured`` for ``--hw`` (``core.kernel_fit.MeasuredKernels``)."""
    from sparkinfer.core.kernel_fit import measured_profile

    return measured_profile(cm.load_profile(args.hw), getattr(args, "kernel_results", None))


def hw_profiles(args: argparse.Namespace) -> dict[str, cm.NodeProfile]:
    """{kernels label: node profile} of ``--hw``: floor, and measured under ``--kernels measured``
    (the profile the other --hw tables use is the last)."""
    prof = cm.load_profile(args.hw)
    if getattr(args, "kernels", "floor") != "measured":
        return {"floor": prof}
    return {"floor": prof, "measured": measured_kernels(args).profile}


def hw_profile(args: argparse.Namespace) -> cm.NodeProfile:
    return list(hw_profiles(args).values())[-1]


def policy_section(args: argparse.Namespace, plan) -> Optional[Section]:
    """Per-context predicted bytes/time per path and the policy's choice (rows from
    ``sparkinfer.core.policy_table``); None without ``--hw``."""
    if getattr(args, "hw", None) is None:
        return None
    resolve_args(args)
    prof = hw_profile(args)
    rows = policy_rows(prof, batch=args.batch, mtp=args.mtp, record_format=args.format, tp=args.tp,
                       dcp=args.dcp, new_fraction=args.reuse_new)
    table = [(f"{r['context']:,}", r["path"], str(r["depth"]), f"{r['rx_MB']:.1f}",
              f"{r['comm_us']:.0f}", f"{r['path_us']:.0f}", r["decision"] if r["path"] == "stock" else "")
             for r in rows]
    return Section(f"Predicted per decode step on {prof.name} (batch {args.batch}, MTP{args.mtp}, "
                   f"reuse new share {args.reuse_new}); mode {StepPolicy(prof, dcp=args.dcp).mode}",
                   ("context", "path", "depth", "MB in/rank", "comm us", "path us", "policy"), table)


add_section(policy_section, add_policy_arguments)


def decode_section(args: argparse.Namespace, plan: CapacityPlan) -> Optional[Section]:
    """Predicted decode tokens/s at contexts 0, 64K, 256K and batches 1 and 8, at this DCP size
    (the policy's path) and at DCP1 with the same TP, per kernel terms (``--kernels``); a column
    says whether the batch's contexts fit the KV budget at that DCP size. None without ``--hw``."""
    if getattr(args, "hw", None) is None:
        return None
    prof = plan.profile
    rows = decode_rows(hw_profiles(args), mtp=prof.mtp, record_format=prof.record_format, tp=prof.tp,
                       dcp=prof.dcp)
    fits = {d: capacity_plan(replace(prof, dcp=d)).kv_tokens for d in {r["dcp"] for r in rows}}
    table = [(r["kernels"], str(r["batch"]), f"{r['context']:,}", f"TP{r['tp']}/DCP{r['dcp']}", r["path"],
              f"{r['step_us'] / 1e3:.2f}", f"{r['tok_s_request']:.1f}", f"{r['tok_s_total']:.1f}",
              "yes" if r["batch"] * (r["context"] + 1 + prof.mtp) <= fits[r["dcp"]] else "no")
             for r in rows]
    accept = f"{cm.MTP_ACCEPT:g} per draft, chain: {cm.tokens_per_step(1 + prof.mtp):.3f} tokens per step" \
        if prof.mtp else "no MTP: 1 token per step"
    return Section(f"Predicted decode on {args.hw}, MTP{prof.mtp} ({accept}; the MTP layer priced once per step), "
                   f"{prof.record_format}; DCP{prof.dcp}: the policy's path without reuse",
                   ("kernels", "batch", "context", "parallel", "path", "step ms", "tok/s / request", "tok/s total",
                    "fits KV"), table)


def kernel_fit_section(args: argparse.Namespace, plan: CapacityPlan) -> Optional[Section]:
    """Under ``--kernels measured``: each fitted kernel term on the GPU that measured it and scaled to
    ``--hw``'s, with its points' largest miss."""
    if getattr(args, "hw", None) is None or getattr(args, "kernels", "floor") != "measured":
        return None
    from sparkinfer.core.kernel_fit import GPUS, SLOPE_SCALING

    m = measured_kernels(args)
    units = {"attention": "us / (row x 1024 tokens)", "scoring": "ns / (row x token)", "topk": "ns / (row x token)"}
    per = {"attention": 1.0, "scoring": 1e3, "topk": 1e3}
    rows = [(t, f"{f.timing}, {len(f.points)}", f"{f.fixed_us:.1f}", f"{f.per_unit_us * per[t]:.4g}",
             f"{max(abs(r) for r in f.residuals_pct()):.1f}", f"{m.scaled[t][0]:.1f}",
             f"{m.scaled[t][1] * per[t]:.4g}", f"{units[t]}; slope by {SLOPE_SCALING[t]}")
            for t, f in m.fits.items()]
    src, dst = GPUS[m.source_gpu], GPUS[m.target_gpu]
    return Section(f"Kernel terms fitted to {src.name} timings, scaled to {dst.name} (HBM "
                   f"x{src.hbm_GBps / dst.hbm_GBps:.3f}, SMs x clock x{src.issue / dst.issue:.3f}; "
                   "sparkinfer/core/kernel_fit.py)",
                   ("term", "timing, points", f"fixed us ({src.name})", f"slope ({src.name})", "max miss %",
                    f"fixed us ({dst.name})", f"slope ({dst.name})", "unit"), rows)


add_section(decode_section)
add_section(kernel_fit_section)


def scoring_section(args: argparse.Namespace, plan: CapacityPlan) -> Optional[Section]:
    """Per batch (1, 8, --concurrency): the context from which ``indexer_scoring = auto`` scores a
    step sharded (each GPU its own positions plus one candidate all-gather per indexer layer,
    ``costmodel.sharded_scoring_from``); None without ``--hw`` or at DCP1."""
    if getattr(args, "hw", None) is None or plan.profile.dcp == 1 or plan.profile.indexer != "replicated":
        return None  # the choice needs every key on every GPU
    prof = hw_profile(args)
    rows = [(str(b), f"{cm.sharded_scoring_from(prof, b, 1 + args.mtp, plan.profile.dcp):,}")
            for b in sorted({1, 8, args.concurrency})]
    return Section(f"indexer_scoring = auto on {prof.name}, MTP{args.mtp}",
                   ("batch", f"a 1/{plan.profile.dcp} share per GPU from context"), rows)


add_section(scoring_section)


def add_replica_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica-share", type=float, default=0.2,
                   help="share of the KV budget per GPU given to the replica store in the replica table "
                        "(default 0.2, what replica_window auto reserves at most; 0 hides the table)")


def replica_section(args: argparse.Namespace, plan: CapacityPlan) -> Optional[Section]:
    """Per batch (1, 8, --concurrency): the context up to which every record is local with a replica
    store of ``--replica-share`` of the KV budget (counted inside it), beside DCP1's and this DCP's
    max context (``sparkinfer.core.capacity.replica_capacity``); None at DCP1 or a share of 0."""
    prof, share = plan.profile, getattr(args, "replica_share", 0.0)
    if prof.dcp == 1 or not share:
        return None
    if not 0.0 < share < 1.0:
        raise ValueError(f"--replica-share must be in [0, 1), got {share}")
    rows = []
    for batch in sorted({1, 8, args.concurrency}):
        r = replica_capacity(prof, batch, int(share * prof.kv_bytes))
        rows.append((str(batch), f"{r.window:,}", f"{r.local_context:,}", f"{r.dcp1_max_context:,}",
                     f"{r.dcp_max_context:,}", f"{r.replica_max_context:,}", f"{r.store_bytes / GIB:.2f}"))
    return Section(f"Replica records: store = {share:.0%} of the KV budget per GPU, one ring per request "
                   f"(the engine keeps max_num_seqs rings)",
                   ("batch", "window / request", "every record local up to", "DCP1 max context",
                    f"DCP{prof.dcp} max context", f"DCP{prof.dcp} + replicas max context", "store GiB / rank"), rows)


add_section(replica_section, add_replica_arguments)
