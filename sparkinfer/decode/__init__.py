"""The decode step a layer's forward runs, free of vLLM: the worker's state (``runtime``), what a
forward needs in one step (``forward_step``), the step's path and plan, paged sparse-MLA
attention over the cache, the attention arena, device checks, the selected-record decode and a Full
layer's group plan. ``sparkinfer.vllm`` (the adapter) builds and calls it; it imports nothing
from there."""
