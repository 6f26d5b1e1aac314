"""``sparkinfer selfcheck``: every record format encoded and decoded by the torch
reference, the host build of csrc/ and (on a GPU) the CUDA build; the bytes must
agree. Prints record sizes, round-trip error and per-token KV bytes per rank for
GLM-5.2 at TP4/DCP4 with MTP."""

from __future__ import annotations

HELP = "encode/decode every record format on all backends and print sizes (exit 1 on any mismatch)"


def add_arguments(p) -> None:
    p.add_argument("--tokens", type=int, default=4096, help="random tokens per format (default 4096)")
    p.add_argument("--dcp", type=int, default=4, help="DCP size for the per-rank byte column (default 4)")
    p.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from sparkinfer.core.geometry import GLM52
    from sparkinfer.formats import ALL_FORMATS, get_format

    g = torch.Generator().manual_seed(args.seed)
    latent = torch.randn(args.tokens, 512, generator=g) * 2.0 ** (torch.rand(args.tokens, 1, generator=g) * 16 - 8)
    rope = torch.randn(args.tokens, 64, generator=g)
    backends = ["torch", "host"] + (["cuda"] if torch.cuda.is_available() else [])

    main_layers, index_layers = GLM52.cached_layers(mtp=True), GLM52.indexer_layers(mtp=True)
    table = Table(title=f"sparkinfer record formats ({args.tokens} random tokens; backends: {', '.join(backends)})")
    for col in ("format", "bytes", "backends agree", "latent rel. err", "rope rel. err",
                f"KV B/token/rank (GLM-5.2, DCP{args.dcp})"):
        table.add_column(col, justify="left" if col == "format" else "right")
    ok = True
    for name in ALL_FORMATS:
        fmt = get_format(name)
        is_key = fmt.rope_dim == 0
        inputs = (latent[:, :128],) if is_key else (latent, rope)
        recs = {b: fmt.encode(*[t.cuda() if b == "cuda" else t for t in inputs], backend=b).cpu() for b in backends}
        agree = all(torch.equal(recs["torch"], r) for r in recs.values())
        decoded = fmt.decode(recs["torch"])
        dl, dr = (decoded, None) if is_key else decoded
        lat_err = float((dl - inputs[0]).norm() / inputs[0].norm())
        rope_err = "-" if is_key else f"{float((dr - rope).norm() / rope.norm()):.2e}"
        if is_key:  # replicated indexer: every rank holds every token's key
            per_rank = f"{index_layers} x {fmt.record_bytes} = {index_layers * fmt.record_bytes:,} (replicated)"
        else:
            per_rank = f"{main_layers} x {fmt.record_bytes} / {args.dcp} = {main_layers * fmt.record_bytes / args.dcp:,.0f}"
        table.add_row(name, str(fmt.record_bytes), "yes" if agree else "[red]NO[/red]", f"{lat_err:.2e}",
                      rope_err, per_rank)
        ok &= agree
    console = Console(width=130)
    console.print(table)
    console.print(f"main records: {main_layers} layers ({GLM52.num_layers} target + MTP), sharded over DCP; "
                  f"indexer keys: {index_layers} layers (Full + MTP), replicated")
    console.print("selfcheck " + ("passed" if ok else "[red]FAILED: backends disagree[/red]"))
    return 0 if ok else 1
