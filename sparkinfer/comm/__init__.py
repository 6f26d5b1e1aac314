"""Sparse CKV transport: the selected-record exchange (issue 4).

* ``exchange.SelectedExchange``: the protocol (pack -> copy -> arrive -> unpack -> release), one
  code path for every fabric; ``ExchangeOverflow`` when the planes dropped records.
* ``host_fabric.HostFabric`` (processes + shared memory + copy thread) and
  ``cuda_fabric.CudaFabric`` (CUDA IPC + copy-engine streams + device flags; imports
  ``cuda.bindings`` only when built).
* ``ring.PrefetchRing``, ``ring.decode_groups``, ``ring.prefill_planes``, ``ring.prefix_union``:
  layered exchange of a Full layer with its Shared layers into a depth-N ring; the prefill
  full-CKV gather.
* ``pack``: record gather/scatter executors (host twin, CUDA kernels, torch reference).
* ``launch.run_ranks``: N local ranks in one gloo group (tests, benchmark, demo).

See docs/design/transport.md.
"""
