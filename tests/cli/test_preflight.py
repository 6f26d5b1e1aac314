"""sparkinfer preflight: the rules on fabricated snapshots, the raw-data parsers, the collector
on a fabricated sysfs tree, and the command on this machine."""

import argparse
import copy
import json
import os
import shutil
import struct
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkinfer import preflight as pf
from sparkinfer.core.capacity import GIB, CapacityProfile, capacity_plan

HAS_CUDA = torch.cuda.is_available()
FIELDS = {"cuda_available", "cuda_error", "gpus", "peer", "torch_archs", "iommu_devices", "gpu_iommu_types", "cmdline",
          "uvm_disable_hmm", "acs", "cuda_lib"}


def node(n=4, cc=(12, 0), free=95 * GIB + GIB // 2, total=96 * GIB, engines=2):
    """A healthy 4 x RTX PRO 6000 node."""
    return {
        "cuda_available": n > 0, "cuda_error": None,
        "gpus": [{"index": i, "name": "RTX PRO 6000", "capability": list(cc), "total_bytes": total,
                  "free_bytes": free, "async_engines": engines, "pci_bus_id": f"0000:{i + 1:02x}:00.0"}
                 for i in range(n)],
        "peer": [[None if i == j else True for j in range(n)] for i in range(n)],
        "torch_archs": ["sm_80", "sm_90", "sm_100", "sm_120", "compute_120"],
        "iommu_devices": [], "gpu_iommu_types": {}, "cmdline": "quiet splash",
        "uvm_disable_hmm": "Y\n",
        "acs": [{"bridge": "0000:00:01.0", "control": 0x0000, "gpus": ["0000:01:00.0"]}],
        "cuda_lib": {"path": "/x/libsparkinfer_cuda.so", "exists": True,
                     "fatbins": [{"sass": [90, 120], "ptx": []}] * 3},
    }


def by_name(snap, opts=None):
    return {c.name: c for c in pf.evaluate(snap, opts or pf.Options())}


def status(snap, name, opts=None):
    return by_name(snap, opts)[name].status


def test_healthy_node_passes_every_check():
    checks = pf.evaluate(node(), pf.Options())
    assert [c.status for c in checks] == ["ok"] * len(pf.RULES), checks
    assert pf.passed(checks)


def test_no_gpu_fails_unless_allowed_and_skips_the_gpu_checks():
    snap = node(0)
    strict = by_name(snap)
    assert strict["GPUs"].status == "fail" and strict["GPUs"].detail.startswith(pf.NO_CUDA)
    assert not pf.passed(list(strict.values()))
    loose = by_name(snap, pf.Options(allow_cpu=True))
    assert loose["GPUs"].status == "warn" and pf.passed(list(loose.values()))
    for name in ("P2P access", "copy engines", "sparkinfer CUDA library", "KV budget vs free memory",
                 "PCIe ACS redirect", "torch CUDA build"):
        assert loose[name].status == "skipped"
    # P2P node settings are reported but cannot fail a machine that has no GPU
    snap.update(iommu_devices=["dmar0"], uvm_disable_hmm="N")
    assert status(snap, "IOMMU") == status(snap, "nvidia_uvm HMM") == "skipped"
    snap["cuda_error"] = "CUDA driver initialization failed"
    assert "driver initialization" in by_name(snap)["GPUs"].detail


def test_gpu_count_and_arch():
    assert status(node(2), "GPUs") == "fail"  # TP4 needs 4
    assert status(node(2), "GPUs", pf.Options(tp=2)) == "ok"
    assert "unused" in by_name(node(8))["GPUs"].detail
    h200 = by_name(node(cc=(9, 0)))["GPUs"]
    assert h200.status == "warn" and "test machine" in h200.detail
    for cc in ((8, 0), (10, 0), (8, 9), (12, 1)):
        assert status(node(cc=cc), "GPUs") == "fail", cc
    mixed = node()
    mixed["gpus"][3]["capability"] = [9, 0]
    assert "mixed" in by_name(mixed)["GPUs"].detail


def test_torch_build():
    snap = node()
    snap["torch_archs"] = ["sm_50", "sm_80", "sm_86", "sm_90"]  # a CUDA 12.4-era wheel: no sm_120, no PTX
    c = by_name(snap)["torch CUDA build"]
    assert c.status == "fail" and "sm_120" in c.detail and "cu128" in c.fix
    assert status(node(cc=(9, 0)), "torch CUDA build") == "ok"
    snap["torch_archs"] = ["sm_90a", "sm_120a"]
    assert status(snap, "torch CUDA build") == "ok"
    snap["torch_archs"] = None
    assert status(snap, "torch CUDA build") == "warn"
    assert pf.arch_list_code(["sm_90a", "compute_120", "sm_120", "bogus"]) == {"sass": [90, 120], "ptx": [120]}


def test_peer_access():
    snap = node()
    snap["peer"] = [[None if i == j else False for j in range(4)] for i in range(4)]
    c = by_name(snap)["P2P access"]
    assert c.status == "fail" and c.detail.count("->") == 12 and "IOMMU" in c.fix and "ACS" in c.fix
    one = node()
    one["peer"][2][1] = False
    assert by_name(one)["P2P access"].detail == "no peer access for 2->1"
    unknown = node()
    unknown["peer"] = None
    assert status(unknown, "P2P access") == "warn"
    # only the GPUs the profile uses count: GPU 3 without P2P does not matter at TP2
    one["peer"] = [[None if i == j else (3 not in (i, j)) for j in range(4)] for i in range(4)]
    assert status(one, "P2P access", pf.Options(tp=2)) == "ok"
    assert status(one, "P2P access", pf.Options(tp=4)) == "fail"
    assert status(node(1), "P2P access", pf.Options(tp=1)) == "skipped"


@pytest.mark.parametrize("engines,expect", [(None, "warn"), (0, "fail"), (1, "warn"), (2, "ok"), (5, "ok")])
def test_copy_engines(engines, expect):
    c = by_name(node(engines=engines))["copy engines"]
    assert c.status == expect
    if engines is None:
        assert "cuda-python" in c.fix


def test_iommu():
    on = node()
    on["iommu_devices"] = ["dmar0", "dmar1"]
    c = by_name(on)["IOMMU"]
    assert c.status == "fail" and "iommu=pt" in c.fix
    for arg in ("iommu=pt", "intel_iommu=off", "amd_iommu=off", "iommu.passthrough=1"):
        on["cmdline"] = f"ro quiet {arg}"
        assert status(on, "IOMMU") == "ok", arg
    on["cmdline"] = "ro iommu=ptx intel_iommu=on"  # look-alikes do not count
    assert status(on, "IOMMU") == "fail"
    # the GPUs' own IOMMU domain type, when readable, decides
    on["gpu_iommu_types"] = {"0000:01:00.0": "identity", "0000:02:00.0": "identity"}
    assert status(on, "IOMMU") == "ok"
    on["cmdline"] = "iommu=pt"
    on["gpu_iommu_types"]["0000:02:00.0"] = "DMA-FQ"
    c = by_name(on)["IOMMU"]
    assert c.status == "fail" and "0000:02:00.0 DMA-FQ" in c.detail
    on["iommu_devices"] = None
    on["gpu_iommu_types"] = {}
    assert status(on, "IOMMU") == "ok"


def test_passthrough_args():
    assert pf.passthrough_args(None) == []
    assert pf.passthrough_args("a iommu=pt b AMD_IOMMU=off c intel_iommu=on") == ["iommu=pt", "AMD_IOMMU=off"]


@pytest.mark.parametrize("value,expect", [("Y\n", "ok"), ("1", "ok"), ("N\n", "fail"), ("0", "fail"),
                                          (None, "warn")])
def test_uvm_hmm(value, expect):
    snap = node()
    snap["uvm_disable_hmm"] = value
    c = by_name(snap)["nvidia_uvm HMM"]
    assert c.status == expect
    if expect != "ok":
        assert "uvm_disable_hmm=1" in c.fix


def test_acs():
    snap = node()
    snap["acs"] = [{"bridge": "0000:00:01.0", "control": 0x001d, "gpus": ["0000:01:00.0"]},  # SV|RR|CR|UF
                   {"bridge": "0000:00:03.0", "control": 0x0011, "gpus": ["0000:02:00.0"]},  # no redirect
                   {"bridge": "0000:80:01.0", "control": 0x0004, "gpus": ["0000:81:00.0"]}]  # RR only
    c = by_name(snap)["PCIe ACS redirect"]
    assert c.status == "fail"
    assert "0000:00:01.0" in c.detail and "0000:80:01.0" in c.detail and "0000:00:03.0" not in c.detail
    assert "setpci -s 0000:00:01.0 ECAP_ACS+0x6.w=0000" in c.fix and "0000:00:03.0" not in c.fix
    snap["acs"] = snap["acs"][1:2]
    assert status(snap, "PCIe ACS redirect") == "ok"
    snap["acs"] = []
    assert status(snap, "PCIe ACS redirect") == "ok"
    snap["acs"] = None
    assert status(snap, "PCIe ACS redirect") == "warn"


def test_cuda_lib():
    snap = node()
    snap["cuda_lib"]["exists"] = False
    c = by_name(snap)["sparkinfer CUDA library"]
    assert c.status == "fail" and "sparkinfer.native.build --cuda" in c.fix

    def lib(*fatbins):
        s = node()
        s["cuda_lib"]["fatbins"] = list(fatbins)
        return s

    assert status(lib(), "sparkinfer CUDA library") == "fail"  # no CUDA code at all
    only90 = by_name(lib({"sass": [90], "ptx": []}))["sparkinfer CUDA library"]
    assert only90.status == "fail" and "sm_120" in only90.detail and "SPARKINFER_CUDA_ARCHS=120 " in only90.fix
    # every translation unit must carry code for the GPU
    assert status(lib({"sass": [120], "ptx": []}, {"sass": [90], "ptx": []}), "sparkinfer CUDA library") == "fail"
    assert status(lib({"sass": [90], "ptx": [120]}), "sparkinfer CUDA library") == "ok"  # PTX JIT
    assert status(lib({"sass": [90], "ptx": [90]}), "sparkinfer CUDA library") == "ok"  # PTX forward
    assert status(lib({"sass": [], "ptx": [121]}), "sparkinfer CUDA library") == "fail"  # PTX never backward
    # SASS runs on a newer minor of the same major only
    h100_lib = lib({"sass": [120], "ptx": []})
    for g in h100_lib["gpus"]:
        g["capability"] = [9, 0]
    assert status(h100_lib, "sparkinfer CUDA library") == "fail"
    assert pf._runs_on({"sass": [120], "ptx": []}, (12, 1))
    assert not pf._runs_on({"sass": [121], "ptx": []}, (12, 0))
    assert not pf._runs_on({"sass": [90], "ptx": []}, (10, 0))


def test_kv_memory():
    prof = CapacityProfile(tp=4, dcp=4, mtp=3, record_format="nvfp4_368", indexer="replicated", kv_bytes=10 * GIB)
    opts = pf.Options(profile=prof)
    ok = by_name(node(), opts)["KV budget vs free memory"]
    assert ok.status == "ok" and f"{capacity_plan(prof).kv_tokens:,} tokens" in ok.detail
    snap = node()
    snap["gpus"][2]["free_bytes"] = 9 * GIB
    c = by_name(snap, opts)["KV budget vs free memory"]
    assert c.status == "fail" and "GPU 2 has 9.00 GiB free" in c.detail and "--kv-gb" in c.fix
    snap["gpus"][2]["free_bytes"] = 94 * GIB  # 2 GiB held by another process
    assert status(snap, "KV budget vs free memory", opts) == "warn"
    snap["gpus"][2]["free_bytes"] = 10 * GIB  # exactly the budget still fits (but is busy)
    assert status(snap, "KV budget vs free memory", opts) == "warn"


def test_options_and_check_validation():
    with pytest.raises(ValueError, match="tp must be"):
        pf.Options(tp=0)
    with pytest.raises(ValueError, match="status must be"):
        pf.Check("x", "good", "")


@st.composite
def snapshots(draw):
    n = draw(st.integers(0, 6))
    snap = node(n)
    for g in snap["gpus"]:
        g["capability"] = list(draw(st.sampled_from([(12, 0), (9, 0), (8, 0), (12, 1)])))
        g["async_engines"] = draw(st.one_of(st.none(), st.integers(0, 4)))
        g["free_bytes"] = draw(st.integers(0, 96)) * GIB
    snap["peer"] = draw(st.one_of(st.none(), st.just([[None if i == j else draw(st.sampled_from([True, False, None]))
                                                         for j in range(n)] for i in range(n)])))
    snap["iommu_devices"] = draw(st.one_of(st.none(), st.lists(st.sampled_from(["dmar0", "ivhd0"]), max_size=2)))
    snap["gpu_iommu_types"] = draw(st.dictionaries(st.sampled_from(["0000:01:00.0", "0000:02:00.0"]),
                                                   st.sampled_from(["identity", "DMA", "DMA-FQ"])))
    snap["cmdline"] = draw(st.one_of(st.none(), st.sampled_from(["", "iommu=pt", "intel_iommu=on"])))
    snap["uvm_disable_hmm"] = draw(st.one_of(st.none(), st.sampled_from(["Y", "N"])))
    snap["torch_archs"] = draw(st.one_of(st.none(), st.lists(st.sampled_from(["sm_90", "sm_120", "compute_90"]))))
    snap["acs"] = draw(st.one_of(st.none(), st.lists(st.fixed_dictionaries(
        {"bridge": st.just("0000:00:01.0"), "control": st.integers(0, 0x7F), "gpus": st.just(["0000:01:00.0"])}),
        max_size=3)))
    snap["cuda_lib"] = {"path": "/x", "exists": draw(st.booleans()), "fatbins": draw(st.lists(st.fixed_dictionaries(
        {"sass": st.lists(st.sampled_from([90, 100, 120]), unique=True), "ptx": st.lists(st.sampled_from([90, 120]),
                                                                                         unique=True)}),
        max_size=3))}
    return snap, draw(st.integers(1, 4)), draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(snapshots())
def test_every_snapshot_gets_one_valid_verdict_per_rule(case):
    snap, tp, allow_cpu = case
    frozen = copy.deepcopy(snap)
    checks = pf.evaluate(snap, pf.Options(tp=tp, allow_cpu=allow_cpu))
    assert snap == frozen  # rules are pure
    assert len(checks) == len(pf.RULES) and len({c.name for c in checks}) == len(checks)
    for c in checks:
        assert c.status in pf.STATUSES and c.detail
        if c.status == "fail":
            assert c.fix, c  # every failure says how to fix it
    assert pf.passed(checks) == all(c.status != "fail" for c in checks)
    if not snap["gpus"]:
        assert pf.passed(checks) == allow_cpu


# --- raw-data parsers -------------------------------------------------------------------------------

def config_space(caps, size=4096):
    """A PCIe config space with extended capabilities [(offset, id, control_word)] chained in order."""
    buf = bytearray(size)
    for k, (off, cap_id, ctrl) in enumerate(caps):
        nxt = caps[k + 1][0] if k + 1 < len(caps) else 0
        struct.pack_into("<IHH", buf, off, cap_id | (1 << 16) | (nxt << 20), 0x005F, ctrl)
    return bytes(buf)


def test_acs_control():
    assert pf.acs_control(config_space([(0x100, 0x0001, 0), (0x148, 0x000D, 0x001D), (0x200, 0x0010, 0)])) == 0x1D
    assert pf.acs_control(config_space([(0x100, 0x000D, 0x0000)])) == 0
    assert pf.acs_control(config_space([(0x100, 0x0001, 0), (0x180, 0x000B, 0)])) is None  # no ACS
    assert pf.acs_control(config_space([(0x100, 0x000D, 0x1D)])[:256]) is None  # non-root view
    assert pf.acs_control(bytes(4096)) is None  # no extended capabilities
    loop = bytearray(config_space([(0x100, 0x0001, 0)]))
    struct.pack_into("<I", loop, 0x100, 0x0001 | (0x100 << 20))  # points at itself
    assert pf.acs_control(bytes(loop)) is None


def fatbin(entries):
    """A fatbin: header + entries (kind, arch), each with an 8-byte payload."""
    body = b""
    for kind, arch in entries:
        head = struct.pack("<HHIQIIHHI", kind, 0, 64, 8, 0, 0, 8, 1, arch).ljust(64, b"\0")
        body += head + b"payload!"
    return struct.pack("<IHHQ", pf.FATBIN_MAGIC, 1, 16, len(body)) + body


def test_fatbin_archs_on_fabricated_blobs():
    blob = b"\x7fELF junk" + fatbin([(2, 120), (2, 90)]) + b"mid" + fatbin([(1, 120), (2, 90)]) + b"tail"
    assert pf.fatbin_archs(blob) == [{"sass": [90, 120], "ptx": []}, {"sass": [90], "ptx": [120]}]
    assert pf.fatbin_archs(b"no cuda here") == []
    truncated = fatbin([(2, 120)])[:-4]  # payload runs past the end: not a fatbin
    assert pf.fatbin_archs(truncated) == []


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_fatbin_archs_on_nvcc_output(tmp_path):
    src = tmp_path / "k.cu"
    src.write_text("__global__ void k(float *x) { x[threadIdx.x] *= 2.0f; }\n")
    obj = tmp_path / "k.o"
    subprocess.run(["nvcc", "-c", str(src), "-o", str(obj), "-gencode", "arch=compute_90,code=sm_90",
                    "-gencode", "arch=compute_120,code=compute_120"], check=True)
    assert pf.fatbin_archs(obj.read_bytes()) == [{"sass": [90], "ptx": [120]}]


# --- the collector ----------------------------------------------------------------------------------

def fake_root(tmp_path, hmm="N\n"):
    """sysfs/procfs of a node with one GPU behind a root port that has ACS redirect on."""
    dev = tmp_path / "sys/devices/pci0000:00/0000:00:01.0"
    gpu = dev / "0000:01:00.0"
    gpu.mkdir(parents=True)
    (gpu / "vendor").write_text("0x10de\n")
    (gpu / "class").write_text("0x030000\n")
    (gpu / "iommu_group").mkdir()
    (gpu / "iommu_group/type").write_text("DMA\n")
    (dev / "vendor").write_text("0x8086\n")
    (dev / "class").write_text("0x060400\n")
    (dev / "config").write_bytes(config_space([(0x100, 0x0001, 0), (0x140, 0x000D, 0x000C)]))
    bus = tmp_path / "sys/bus/pci/devices"
    bus.mkdir(parents=True)
    for d in (dev, gpu):
        os.symlink(d, bus / d.name)
    (tmp_path / "sys/class/iommu/dmar0").mkdir(parents=True)
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cmdline").write_text("ro quiet\n")
    if hmm is not None:
        (tmp_path / "sys/module/nvidia_uvm/parameters").mkdir(parents=True)
        (tmp_path / "sys/module/nvidia_uvm/parameters/uvm_disable_hmm").write_text(hmm)
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"\x7fELF" + fatbin([(2, 90)]))
    return str(lib)


def test_collector_reads_a_fabricated_node(tmp_path):
    lib = fake_root(tmp_path)
    gpu = node(1)["gpus"]
    gpu[0]["pci_bus_id"] = None  # torch did not say: found through sysfs

    snap = pf.collect(root=str(tmp_path), cuda_lib_path=lib, devices=lambda: (True, None, gpu, [[None]], ["sm_90"]))
    assert set(snap) == FIELDS
    assert snap["iommu_devices"] == ["dmar0"] and snap["cmdline"] == "ro quiet"
    assert snap["gpu_iommu_types"] == {"0000:01:00.0": "DMA"}
    assert snap["uvm_disable_hmm"] == "N\n"
    assert snap["acs"] == [{"bridge": "0000:00:01.0", "control": 0x000C, "gpus": ["0000:01:00.0"]}]
    assert snap["cuda_lib"] == {"path": lib, "exists": True, "fatbins": [{"sass": [90], "ptx": []}]}
    checks = by_name(snap, pf.Options(tp=1))
    for name in ("IOMMU", "nvidia_uvm HMM", "PCIe ACS redirect", "sparkinfer CUDA library", "torch CUDA build"):
        assert checks[name].status == "fail", checks[name]
    json.dumps(pf.report(snap, list(checks.values())))  # --json can print it


def test_collector_without_readable_node_files(tmp_path):
    snap = pf.collect(root=str(tmp_path), cuda_lib_path=str(tmp_path / "none.so"),
                      devices=lambda: (False, None, [], [], None))
    assert snap["iommu_devices"] is None and snap["cmdline"] is None and snap["uvm_disable_hmm"] is None
    assert snap["acs"] is None and snap["cuda_lib"]["exists"] is False


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only behaviour")
def test_command_on_this_cpu_machine(capsys):
    from sparkinfer.cli import preflight as cmd

    def run(*argv):
        p = argparse.ArgumentParser()
        cmd.add_arguments(p)
        return cmd.run(p.parse_args(list(argv)))

    assert run("--json") == 1
    out = json.loads(capsys.readouterr().out)
    assert set(out["snapshot"]) == FIELDS and not out["ok"]
    assert out["checks"][0]["detail"].startswith(pf.NO_CUDA)
    assert run("--allow-cpu", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["checks"][0]["status"] == "warn"
    assert run("--allow-cpu") == 0  # the rich table
    assert "sparkinfer preflight" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="dcp"):
        run("--dcp", "3")


@pytest.mark.gpu
def test_collector_on_this_gpu_machine():
    snap = pf.collect()
    assert snap["cuda_available"] and len(snap["gpus"]) == torch.cuda.device_count()
    for g in snap["gpus"]:
        assert g["free_bytes"] <= g["total_bytes"]
        assert tuple(g["capability"]) == torch.cuda.get_device_capability(g["index"])
