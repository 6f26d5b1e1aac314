"""sparkinfer's serving configuration, its sources and its start-up validation.

Fields (CLI flag / environment variable; CLI wins over the environment, both over the default):

  mode            --sparkinfer-mode            VLLM_SPARKINFER_MODE            auto | stock | selected
  prefetch_depth  --sparkinfer-prefetch-depth  VLLM_SPARKINFER_PREFETCH_DEPTH  int in [0, 8]
  pool_mb         --sparkinfer-pool-mb         VLLM_SPARKINFER_POOL_MB         int in [1, 65536]
  fabric          --sparkinfer-fabric          VLLM_SPARKINFER_FABRIC          auto | host | cuda
  replica_window  --sparkinfer-replica-window  VLLM_SPARKINFER_REPLICA_WINDOW  auto | int in [0, 2^24]
  indexer_scoring --sparkinfer-indexer-scoring VLLM_SPARKINFER_INDEXER_SCORING auto | replicated | sharded

mode: ``stock`` always runs vLLM's DCP decode (partial outputs + LSE merge); ``selected`` moves
the selected records (sparkinfer.comm) when a step is eligible; ``auto`` decides per step.
prefetch_depth: exchanges in flight ahead of the attention that consumes them (0 = none).
pool_mb: per-rank workspace for fetched records; a step that does not fit falls back to stock.
fabric: the transport; ``auto`` = ``cuda`` on a GPU, ``host`` on CPU.
replica_window: positions of each request every rank keeps although it does not own them (the
replica store, ``sparkinfer.core.replicas``); 0 = off; ``auto`` = the whole ``max_model_len`` when
that store fits a fifth of the KV memory, else what a fifth holds; the store is taken out of the
KV memory (``sparkinfer.vllm.replica_budget``, docs/design/replicas.md).
indexer_scoring: how the replicated indexer scores a step under DCP > 1: ``replicated`` = every
rank scores the whole context alone; ``sharded`` = every rank scores the positions it owns and
the ranks all-gather their top-k candidates (the same merged top-k on every rank); ``auto`` =
per step, the cheaper by the node profile's cost model (``costmodel.choose_indexer``), replicated
where no profile is known (CPU). ``sparkinfer.vllm.indexer_scoring``.

Patched vLLM validates the configuration once at engine start (``EngineArgs.create_engine_config``)
and stores ``as_dict()`` in ``VllmConfig.additional_config["sparkinfer"]``; errors are ValueErrors
that name the field and where its value came from. Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

MODES = ("auto", "stock", "selected")
FABRICS = ("auto", "host", "cuda")
SCORINGS = ("auto", "replicated", "sharded")
MAX_PREFETCH_DEPTH = 8  # deeper rings only cost memory (measured gains stop at depth 1-3)
MAX_POOL_MB = 65536
MAX_REPLICA_WINDOW = 2**24
ADDITIONAL_CONFIG_KEY = "sparkinfer"
ENV_PREFIX = "VLLM_SPARKINFER_"


class SparkinferConfigError(ValueError):
    """A start-up configuration error; patched ``vllm serve`` prints its message alone and exits 2."""


@dataclass(frozen=True)
class SparkinferConfig:
    mode: str = "auto"
    prefetch_depth: int = 3
    pool_mb: int = 512
    fabric: str = "auto"
    replica_window: object = "auto"  # "auto" or an int
    indexer_scoring: str = "auto"

    def as_dict(self) -> dict:
        return asdict(self)


FIELD_NAMES = tuple(f.name for f in fields(SparkinferConfig))
CHOICES = {"mode": MODES, "fabric": FABRICS, "indexer_scoring": SCORINGS}


def env_var(field: str) -> str:
    return ENV_PREFIX + field.upper()


def cli_flag(field: str) -> str:
    return "--sparkinfer-" + field.replace("_", "-")


def _parse(field: str, raw: object, source: str):
    """One field's value from a string (env, CLI) or a Python value; ValueError names field and source."""
    where = f"{field} (from {source})"
    if field in CHOICES:
        choices = CHOICES[field]
        value = str(raw).strip().lower()
        if value not in choices:
            raise ValueError(f"sparkinfer {where}: expected one of {', '.join(choices)}, got {raw!r}")
        return value
    if field == "replica_window" and isinstance(raw, str) and raw.strip().lower() == "auto":
        return "auto"
    lo, hi = {"prefetch_depth": (0, MAX_PREFETCH_DEPTH), "pool_mb": (1, MAX_POOL_MB),
              "replica_window": (0, MAX_REPLICA_WINDOW)}[field]
    expect = ("auto or " if field == "replica_window" else "") + f"an integer in [{lo}, {hi}]"
    if isinstance(raw, bool):
        raise ValueError(f"sparkinfer {where}: expected {expect}, got {raw!r}")
    try:
        value = int(str(raw).strip(), 10) if isinstance(raw, str) else int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"sparkinfer {where}: expected {expect}, got {raw!r}") from None
    if isinstance(raw, float) and raw != value:
        raise ValueError(f"sparkinfer {where}: expected {expect}, got {raw!r}")
    if not lo <= value <= hi:
        raise ValueError(f"sparkinfer {where}: expected {expect}, got {value}")
    return value


def resolve(cli: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None) -> SparkinferConfig:
    """The validated configuration from CLI values (``None`` = not given) over environment variables.

    ``environ`` defaults to ``os.environ``. An unknown ``VLLM_SPARKINFER_*`` variable is an error
    too (a typo would otherwise silently leave the default in place).
    """
    environ = os.environ if environ is None else environ
    cli = dict(cli or {})
    unknown = sorted(set(cli) - set(FIELD_NAMES))
    if unknown:
        raise ValueError(f"sparkinfer: unknown configuration field(s) {unknown}; known: {list(FIELD_NAMES)}")
    known_env = {env_var(f) for f in FIELD_NAMES}
    stray = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in known_env)
    if stray:
        raise ValueError(f"sparkinfer: unknown environment variable(s) {stray}; known: {sorted(known_env)}")
    values = {}
    for f in FIELD_NAMES:
        if cli.get(f) is not None:
            values[f] = _parse(f, cli[f], f"{cli_flag(f)}")
        elif environ.get(env_var(f), "").strip():
            values[f] = _parse(f, environ[env_var(f)], env_var(f))
    return SparkinferConfig(**values)


def from_additional_config(additional_config: Mapping | None) -> SparkinferConfig:
    """The configuration patched vLLM stored at start-up (defaults when it stored none)."""
    stored = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    if stored is None:
        return SparkinferConfig()
    return SparkinferConfig(**{f: _parse(f, stored[f], "additional_config") for f in FIELD_NAMES if f in stored})


def add_cli_args(parser) -> None:
    """Add the ``--sparkinfer-*`` flags (to vLLM's argument parser); values are validated by ``resolve``."""
    group = parser.add_argument_group("sparkinfer", "sparse CKV transport (see sparkinfer/config.py)")
    helps = {
        "mode": f"decode transport policy: {' | '.join(MODES)}",
        "prefetch_depth": f"record exchanges in flight ahead of attention, 0..{MAX_PREFETCH_DEPTH}",
        "pool_mb": "per-rank workspace for fetched records, MiB",
        "fabric": f"record transport: {' | '.join(FABRICS)}",
        "replica_window": "positions per request every rank keeps locally (auto | 0 = off | tokens)",
        "indexer_scoring": f"who scores the indexer's context under DCP: {' | '.join(SCORINGS)}",
    }
    for f in FIELD_NAMES:
        group.add_argument(cli_flag(f), dest=f"sparkinfer_{f}", default=None,
                           help=f"{helps[f]} (env {env_var(f)}; default {getattr(SparkinferConfig(), f)})")


def env_getters() -> dict:
    """vLLM ``envs.environment_variables`` entries, so vLLM knows the names (raw strings, or None)."""
    return {env_var(f): (lambda name=env_var(f): os.environ.get(name)) for f in FIELD_NAMES}
