"""sparkinfer: sparse CKV transport for serving GLM-5.2 with vLLM on 4 x RTX PRO 6000.

Layout of the package (see docs/design/overview.md):

* ``sparkinfer.core``      torch-free planning core: record layouts, topology (DCP
                           placement, the IndexShare pattern), capacity and byte
                           accounting, cost model.
* ``sparkinfer.formats``   record codecs (torch reference, host and CUDA builds).
* ``sparkinfer.plan``      per-request MTP union and transport planes.
* ``sparkinfer.indexer``   the replicated DSA indexer and its top-k.
* ``sparkinfer.attention`` sparse MLA decode over records, LSE merge.
* ``sparkinfer.comm``      the selected-record exchange and its prefetch ring.
* ``sparkinfer.native``    loaders for the libraries built from ``csrc/``.

Importing the package never touches a GPU or imports torch.
"""

__version__ = "0.1.0"
