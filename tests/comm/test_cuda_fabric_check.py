"""``CudaFabric._check`` names the device error word the way every other reader does
(``flags.describe_error``): op, check, status and the peer that never signalled. Runs without a GPU:
``_check`` only reads the pinned word, so it is called on a stand-in holding that word."""

from types import SimpleNamespace

import pytest
import torch

from sparkinfer.comm import flags as F
from sparkinfer.comm.cuda_fabric import CudaFabric
from sparkinfer.comm.fabric import FabricError


def _fabric(word: int):
    return SimpleNamespace(_closed=False, _err=torch.tensor([word], dtype=torch.int32), rank=1, timeout_s=2.5)


def test_a_wait_timeout_names_the_peer_and_the_check():
    word = F.error_word(F.ERR_TIMEOUT, F.CHECK_WAIT, F.OP_WAIT, peer=3)
    with pytest.raises(FabricError) as e:
        CudaFabric._check(_fabric(word))
    msg = str(e.value)
    assert msg.startswith("rank 1: flag wait: a flag wait timed out (peer 3 never signalled)"), msg
    assert f"[word {word:#x}]" in msg and "2.5 s" in msg


def test_a_range_error_is_not_reported_as_a_timeout():
    word = F.error_word(F.ERR_RANGE, F.CHECK_SLOT, F.OP_UNPACK)
    with pytest.raises(FabricError, match="unpack: a destination workspace slot out of range") as e:
        CudaFabric._check(_fabric(word))
    assert "never signalled" not in str(e.value)


def test_a_clear_word_passes():
    CudaFabric._check(_fabric(0))
