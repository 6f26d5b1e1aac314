"""Node checks before serving GLM-5.2 at TP4/DCP4: each failure comes with the fix.

Two halves:

* ``evaluate(snapshot, options)``: pure rules over a snapshot dict, torch-free, one
  function per check, each returning a ``Check`` (ok / warn / fail / skipped, what was
  seen, how to fix it). Tested with fabricated snapshots.
* ``collect(tp, root="/")``: reads the real machine into that dict (torch for the
  devices, cuda.bindings for copy engines, sysfs/procfs for the node settings, the
  built CUDA library's fatbins for its architectures). ``root`` lets tests point the
  file readers at a fabricated tree.

Snapshot (every key present; ``None`` = could not be read)::

    cuda_available  bool            torch sees a CUDA device
    cuda_error      str | None      why not, when torch says so
    gpus            [ {index, name, capability [major, minor], total_bytes,
                       free_bytes, async_engines (int | None), pci_bus_id (str | None)} ]
    peer            [[bool | None]] peer[i][j]: GPU i can access GPU j (diagonal None)
    torch_archs     [str] | None    torch.cuda.get_arch_list() ("sm_120", "compute_120", ...)
    iommu_devices   [str] | None    entries of /sys/class/iommu (None: no such directory)
    gpu_iommu_types {bus_id: str}   iommu_group/type of each GPU ("identity" = passthrough)
    cmdline         str | None      /proc/cmdline
    uvm_disable_hmm str | None      /sys/module/nvidia_uvm/parameters/uvm_disable_hmm
    acs             [ {bridge, control, gpus} ] | None   ACS Control of each PCIe bridge
                                    above a GPU that has the capability (None: unreadable)
    cuda_lib        {path, exists, fatbins: [{sass: [int], ptx: [int]}]}
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import asdict, dataclass, field

from sparkinfer.core.capacity import GIB, CapacityProfile, capacity_plan

OK, WARN, FAIL, SKIPPED = "ok", "warn", "fail", "skipped"
STATUSES = (OK, WARN, FAIL, SKIPPED)

SERVE_ARCH = (12, 0)  # RTX PRO 6000 Blackwell
TEST_ARCHS = ((9, 0),)  # H100/H200 test machines: the kernels are built for them too
NVIDIA_VENDOR = "0x10de"

# PCIe ACS Control bits (PCIe base spec, ACS extended capability ID 0x000D, control at +6).
ACS_CAP_ID = 0x000D
ACS_REQUEST_REDIRECT = 1 << 2
ACS_COMPLETION_REDIRECT = 1 << 3
ACS_REDIRECT = ACS_REQUEST_REDIRECT | ACS_COMPLETION_REDIRECT

FATBIN_MAGIC = 0xBA55ED50
FATBIN_PTX, FATBIN_ELF = 1, 2


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"check {self.name}: status must be one of {STATUSES}, got {self.status!r}")


@dataclass(frozen=True)
class Options:
    """What the node is checked against."""

    tp: int = 4  # GPUs the serving profile uses
    allow_cpu: bool = False  # a machine without CUDA is a warning, not a failure
    profile: CapacityProfile = field(default_factory=lambda: CapacityProfile(
        tp=4, dcp=4, mtp=3, record_format="nvfp4_368", indexer="replicated", kv_bytes=10 * GIB))

    def __post_init__(self):
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be an int >= 1, got {self.tp!r}")


NO_CUDA = "no CUDA device: only the host fabric is available"
NO_GPU_SKIP = "no CUDA device"


def _cc(gpu: dict) -> str:
    major, minor = gpu["capability"]
    return f"sm_{major}{minor}"


def _serving(snapshot: dict, opts: Options) -> list[dict]:
    """The GPUs the profile would use: the first ``tp`` visible ones."""
    return snapshot["gpus"][:opts.tp]


# --- rules --------------------------------------------------------------------------------------

def check_gpus(snap: dict, opts: Options) -> Check:
    name = "GPUs"
    if not snap["cuda_available"] or not snap["gpus"]:
        why = f" ({snap['cuda_error']})" if snap.get("cuda_error") else ""
        if opts.allow_cpu:
            return Check(name, WARN, NO_CUDA + why, "none needed for CPU tests (--allow-cpu)")
        return Check(name, FAIL, NO_CUDA + why,
                     "install the NVIDIA driver and a CUDA build of torch; check nvidia-smi and "
                     "CUDA_VISIBLE_DEVICES (or pass --allow-cpu on a CPU-only machine)")
    gpus = snap["gpus"]
    if len(gpus) < opts.tp:
        return Check(name, FAIL, f"{len(gpus)} visible, the profile needs {opts.tp} (TP{opts.tp})",
                     "make all GPUs visible (CUDA_VISIBLE_DEVICES, nvidia-smi) or lower --tp")
    used = gpus[:opts.tp]
    bad = [g for g in used if tuple(g["capability"]) != SERVE_ARCH and tuple(g["capability"]) not in TEST_ARCHS]
    listing = ", ".join(f"{g['index']}: {g['name']} {_cc(g)}" for g in used)
    extra = f"; {len(gpus) - opts.tp} more visible, unused" if len(gpus) > opts.tp else ""
    if bad:
        return Check(name, FAIL, f"unsupported compute capability: {listing}",
                     "sparkinfer's kernels target sm_120 (RTX PRO 6000 Blackwell) and sm_90 (H100/H200)")
    if len({tuple(g["capability"]) for g in used}) > 1:
        return Check(name, FAIL, f"mixed architectures: {listing}", "serve on GPUs of one model")
    if tuple(used[0]["capability"]) != SERVE_ARCH:
        return Check(name, WARN, f"{listing} (accepted as a test machine; the target is sm_120){extra}")
    return Check(name, OK, listing + extra)


def check_peer_access(snap: dict, opts: Options) -> Check:
    name = "P2P access"
    used = _serving(snap, opts)
    if not snap["cuda_available"] or not used:
        return Check(name, SKIPPED, NO_GPU_SKIP)
    if len(used) < 2:
        return Check(name, SKIPPED, "one GPU: no peer copies")
    peer = snap["peer"]
    missing, unknown = [], []
    for i in range(len(used)):
        for j in range(len(used)):
            if i != j:
                v = peer[i][j] if peer is not None else None
                (unknown if v is None else missing if not v else []).append(f"{i}->{j}")
    if missing:
        return Check(name, FAIL, f"no peer access for {', '.join(missing)}",
                     "sparkinfer moves records GPU to GPU over PCIe: turn the IOMMU off or to passthrough, "
                     "clear ACS redirect on the bridges above the GPUs and set nvidia_uvm uvm_disable_hmm=1 "
                     "(see the checks below); GPUs behind different CPU sockets may never get P2P")
    if unknown:
        return Check(name, WARN, f"peer access not determined for {', '.join(unknown)}",
                     "run preflight with torch importable on the serving node")
    return Check(name, OK, f"every pair of GPUs 0..{len(used) - 1} has peer access")


def check_copy_engines(snap: dict, opts: Options) -> Check:
    name = "copy engines"
    used = _serving(snap, opts)
    if not snap["cuda_available"] or not used:
        return Check(name, SKIPPED, NO_GPU_SKIP)
    counts = [g["async_engines"] for g in used]
    if any(c is None for c in counts):
        return Check(name, WARN, "unknown (cuda.bindings not importable or the query failed)",
                     "pip install cuda-python, then rerun to read cudaDevAttrAsyncEngineCount")
    listing = ", ".join(f"GPU {g['index']}: {c}" for g, c in zip(used, counts))
    if min(counts) == 0:
        return Check(name, FAIL, listing + " (copies cannot overlap kernels)",
                     "this GPU/driver mode exposes no async copy engine; check nvidia-smi -q for the mode")
    if min(counts) == 1:
        return Check(name, WARN, listing + " (sends and receives share one engine)")
    return Check(name, OK, listing)


_PASSTHROUGH = re.compile(r"^(iommu=(pt|off)|iommu\.passthrough=(1|on|y)|(intel|amd)_iommu=(off|pt))$")


def passthrough_args(cmdline: str | None) -> list[str]:
    """Kernel arguments that put the IOMMU in passthrough or off."""
    return [a for a in (cmdline or "").split() if _PASSTHROUGH.match(a.lower())]


def check_iommu(snap: dict, opts: Options) -> Check:
    name = "IOMMU"
    types = snap.get("gpu_iommu_types") or {}
    devices = snap["iommu_devices"]
    pt = passthrough_args(snap["cmdline"])
    if types:  # the GPUs' own DMA domains say it best ("identity" = passthrough)
        translated = [f"{b} {t}" for b, t in types.items() if t != "identity"]
        ok = not translated
        detail = ("passthrough (identity domain) for every GPU" if ok
                  else "GPU DMA is translated: " + ", ".join(translated))
    elif not devices:
        ok, detail = True, "no IOMMU active (/sys/class/iommu is empty)"
    elif pt:
        ok, detail = True, f"IOMMU present ({', '.join(devices)}), kernel has {' '.join(pt)}"
    else:
        ok, detail = False, f"IOMMU active ({', '.join(devices)}) and no passthrough on the kernel command line"
    if ok:
        return Check(name, OK, detail)
    if not (snap["cuda_available"] and snap["gpus"]):
        return Check(name, SKIPPED, f"{NO_GPU_SKIP} ({detail})")
    return Check(name, FAIL, detail,
                 "add iommu=pt (or intel_iommu=off / amd_iommu=off) to the kernel command line "
                 "(GRUB_CMDLINE_LINUX, update-grub, reboot) or disable the IOMMU/VT-d in the BIOS")


def check_uvm_hmm(snap: dict, opts: Options) -> Check:
    name = "nvidia_uvm HMM"
    value = snap["uvm_disable_hmm"]
    fix = ("echo 'options nvidia_uvm uvm_disable_hmm=1' > /etc/modprobe.d/nvidia-uvm-hmm.conf, "
           "then reload nvidia_uvm (stop GPU processes; modprobe -r nvidia_uvm && modprobe nvidia_uvm) or reboot")
    has_gpu = snap["cuda_available"] and bool(snap["gpus"])
    if value is None:
        if not has_gpu:
            return Check(name, SKIPPED, f"{NO_GPU_SKIP} (nvidia_uvm not loaded)")
        return Check(name, WARN, "uvm_disable_hmm not readable (nvidia_uvm not loaded, or a driver without it)",
                     "load nvidia_uvm (any CUDA program does) and rerun; " + fix)
    on = value.strip().upper() in ("Y", "1")
    if on:
        return Check(name, OK, f"uvm_disable_hmm={value.strip()}")
    if not has_gpu:
        return Check(name, SKIPPED, f"{NO_GPU_SKIP} (uvm_disable_hmm={value.strip()})")
    return Check(name, FAIL, f"uvm_disable_hmm={value.strip()}: HMM is on, peer mappings can fail", fix)


def check_acs(snap: dict, opts: Options) -> Check:
    name = "PCIe ACS redirect"
    acs = snap["acs"]
    has_gpu = snap["cuda_available"] and bool(snap["gpus"])
    if not has_gpu:
        return Check(name, SKIPPED, NO_GPU_SKIP)
    if acs is None:
        return Check(name, WARN, "bridge config space not readable (extended config needs root)",
                     "rerun as root, or inspect by hand: sudo lspci -vvv | grep -i ACSCtl")
    on = [b for b in acs if b["control"] & ACS_REDIRECT]
    if on:
        return Check(name, FAIL,
                     "redirect set on " + ", ".join(f"{b['bridge']} (ACSCtl 0x{b['control']:04x}, above "
                                                    f"{', '.join(b['gpus'])})" for b in on),
                     "peer traffic is sent up to the root complex: disable ACS in the BIOS, or until reboot "
                     + "; ".join(f"setpci -s {b['bridge']} ECAP_ACS+0x6.w=0000" for b in on))
    if not acs:
        return Check(name, OK, "no bridge above the GPUs has an ACS capability")
    return Check(name, OK, f"redirect clear on {len(acs)} bridge(s) above the GPUs")


def _runs_on(fatbin: dict, capability: tuple[int, int]) -> bool:
    """SASS runs on the same major with an equal or newer minor; PTX JIT-compiles forward."""
    major, minor = capability
    cc = major * 10 + minor
    return any(a // 10 == major and a % 10 <= minor for a in fatbin["sass"]) or any(p <= cc for p in fatbin["ptx"])


def check_cuda_lib(snap: dict, opts: Options) -> Check:
    name = "sparkinfer CUDA library"
    lib = snap["cuda_lib"]
    used = _serving(snap, opts)
    build = "SPARKINFER_CUDA_ARCHS=120,90 python -m sparkinfer.native.build --cuda --force (needs nvcc)"
    if not snap["cuda_available"] or not used:
        return Check(name, SKIPPED, NO_GPU_SKIP)
    if not lib["exists"]:
        return Check(name, FAIL, f"{lib['path']} not built", build)
    if not lib["fatbins"]:
        return Check(name, FAIL, f"{lib['path']} holds no CUDA code", build)
    archs = sorted({tuple(g["capability"]) for g in used})
    missing = [f"sm_{a}{b}" for a, b in archs if not all(_runs_on(f, (a, b)) for f in lib["fatbins"])]
    built = sorted({a for f in lib["fatbins"] for a in f["sass"]})
    detail = f"built for {', '.join(f'sm_{a}' for a in built) or 'PTX only'}"
    if missing:
        return Check(name, FAIL, f"{detail}; no code for {', '.join(missing)}",
                     build.replace("120,90", ",".join(str(a * 10 + b) for a, b in archs)))
    return Check(name, OK, detail)


def arch_list_code(archs: list[str]) -> dict:
    """``["sm_90", "sm_120", "compute_120"]`` -> ``{"sass": [90, 120], "ptx": [120]}`` (suffixes
    like ``sm_90a`` count as their base architecture)."""
    out = {"sass": set(), "ptx": set()}
    for a in archs:
        m = re.fullmatch(r"(sm|compute)_(\d+)[a-z]?", a)
        if m:
            out["sass" if m.group(1) == "sm" else "ptx"].add(int(m.group(2)))
    return {k: sorted(v) for k, v in out.items()}


def check_torch_build(snap: dict, opts: Options) -> Check:
    name = "torch CUDA build"
    used = _serving(snap, opts)
    if not snap["cuda_available"] or not used:
        return Check(name, SKIPPED, NO_GPU_SKIP)
    archs = snap["torch_archs"]
    if not archs:
        return Check(name, WARN, "torch did not report the architectures it was built for")
    code = arch_list_code(archs)
    missing = sorted({_cc(g) for g in used if not _runs_on(code, tuple(g["capability"]))})
    if missing:
        return Check(name, FAIL, f"torch is built for {', '.join(archs)}; no code for {', '.join(missing)}",
                     "install a torch CUDA build that includes these GPUs (sm_120 needs CUDA 12.8 or newer "
                     "wheels, e.g. the cu128/cu130 index)")
    return Check(name, OK, f"torch kernels for {', '.join(archs)}")


def check_kv_memory(snap: dict, opts: Options) -> Check:
    name = "KV budget vs free memory"
    prof = opts.profile
    plan = capacity_plan(prof)
    budget = (f"KV budget {prof.kv_bytes / GIB:.2f} GiB/GPU holds {plan.kv_tokens:,} tokens "
              f"(TP{prof.tp} DCP{prof.dcp} MTP{prof.mtp}, {plan.record_bytes} B records, {prof.indexer} indexer)")
    used = _serving(snap, opts)
    if not snap["cuda_available"] or not used:
        return Check(name, SKIPPED, f"{NO_GPU_SKIP}; {budget}")
    short = [g for g in used if g["free_bytes"] < prof.kv_bytes]
    if short:
        return Check(name, FAIL, "; ".join(f"GPU {g['index']} has {g['free_bytes'] / GIB:.2f} GiB free"
                                           for g in short) + f", below the {budget}",
                     "stop other processes on the GPUs (nvidia-smi) or lower --kv-gb")
    busy = [g for g in used if g["total_bytes"] - g["free_bytes"] > GIB]
    if busy:
        return Check(name, WARN, "; ".join(f"GPU {g['index']}: {(g['total_bytes'] - g['free_bytes']) / GIB:.1f} "
                                           f"GiB already in use" for g in busy) + f"; {budget}",
                     "other processes hold memory the weights and KV cache will need (nvidia-smi)")
    return Check(name, OK, f"{min(g['free_bytes'] for g in used) / GIB:.1f} GiB free per GPU at least; {budget}")


RULES = (check_gpus, check_torch_build, check_peer_access, check_copy_engines, check_iommu, check_uvm_hmm, check_acs,
         check_cuda_lib, check_kv_memory)


def evaluate(snapshot: dict, opts: Options) -> list[Check]:
    return [rule(snapshot, opts) for rule in RULES]


def passed(checks: list[Check]) -> bool:
    return all(c.status != FAIL for c in checks)


def report(snapshot: dict, checks: list[Check]) -> dict:
    """The machine-readable result (``--json``)."""
    return {"ok": passed(checks), "checks": [asdict(c) for c in checks], "snapshot": snapshot}


# --- parsers of raw machine data (pure) ----------------------------------------------------------

def acs_control(config: bytes) -> int | None:
    """ACS Control register from a PCIe function's config space, or None without the capability.

    Extended capabilities start at 0x100: a 32-bit header (ID bits 0-15, version 16-19,
    next offset 20-31) per capability; ACS Control is the 16-bit word at +6. A config
    space of 256 bytes or less (what non-root users read) has no extended capabilities.
    """
    off, seen = 0x100, set()
    while 0x100 <= off <= len(config) - 8 and off not in seen:
        seen.add(off)
        (header,) = struct.unpack_from("<I", config, off)
        if header in (0, 0xFFFFFFFF):
            return None
        if header & 0xFFFF == ACS_CAP_ID:
            return struct.unpack_from("<H", config, off + 6)[0]
        off = (header >> 20) & 0xFFC
    return None


def fatbin_archs(blob: bytes) -> list[dict]:
    """The SASS and PTX architectures of every CUDA fatbin embedded in ``blob`` (a .so / .o).

    nvcc embeds one fatbin per translation unit: header ``<u32 magic 0xBA55ED50, u16
    version, u16 header size, u64 payload size>``, then entries ``<u16 kind (1 PTX,
    2 ELF), u16, u32 entry header size, u64 payload size, ...>`` with the SM number as
    u32 at +28. Only headers are read, so compressed payloads do not matter.
    """
    out, magic = [], struct.pack("<I", FATBIN_MAGIC)
    i = blob.find(magic)
    while i >= 0 and i + 16 <= len(blob):
        _, version, header_size, size = struct.unpack_from("<IHHQ", blob, i)
        if version == 1 and header_size >= 16 and i + header_size + size <= len(blob):
            sass, ptx = set(), set()
            off, end = i + header_size, i + header_size + size
            while off + 32 <= end:
                kind, _, entry_header, entry_size = struct.unpack_from("<HHIQ", blob, off)
                if entry_header < 32:
                    break
                arch = struct.unpack_from("<I", blob, off + 28)[0]
                (sass if kind == FATBIN_ELF else ptx if kind == FATBIN_PTX else set()).add(arch)
                off += entry_header + entry_size
            out.append({"sass": sorted(sass), "ptx": sorted(ptx)})
            i = blob.find(magic, end)
        else:
            i = blob.find(magic, i + 4)
    return out


# --- the collector (reads the real machine) ------------------------------------------------------

def _read(root: str, path: str) -> str | None:
    try:
        with open(os.path.join(root, path.lstrip("/"))) as f:
            return f.read()
    except OSError:
        return None


def nvidia_pci_functions(root: str = "/") -> list[str]:
    """Bus ids of NVIDIA display/3D controllers (class 0x03xxxx) in sysfs."""
    base = os.path.join(root, "sys/bus/pci/devices")
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    return [n for n in names if (_read(root, f"sys/bus/pci/devices/{n}/vendor") or "").strip() == NVIDIA_VENDOR
            and (_read(root, f"sys/bus/pci/devices/{n}/class") or "").strip().startswith("0x03")]


def upstream_bridges(root: str, bus_id: str) -> list[str]:
    """Bus ids on the sysfs path above a PCI function (its bridges, root port first)."""
    real = os.path.realpath(os.path.join(root, "sys/bus/pci/devices", bus_id))
    parts = real.split(os.sep)
    ids = [p for p in parts if re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", p)]
    return ids[:-1] if ids and ids[-1] == bus_id else ids


def read_acs(root: str, gpu_bus_ids: list[str]) -> list[dict] | None:
    bridges: dict[str, list[str]] = {}
    for gpu in gpu_bus_ids:
        for b in upstream_bridges(root, gpu):
            bridges.setdefault(b, []).append(gpu)
    out = []
    for b, gpus in bridges.items():
        try:
            with open(os.path.join(root, "sys/bus/pci/devices", b, "config"), "rb") as f:
                config = f.read()
        except OSError:
            return None
        if len(config) <= 0x100:
            return None  # not root: the extended config space is hidden
        ctrl = acs_control(config)
        if ctrl is not None:
            out.append({"bridge": b, "control": ctrl, "gpus": gpus})
    return out


def _torch_devices() -> tuple[bool, str | None, list[dict], list[list], list[str] | None]:
    try:
        import torch
    except ImportError as e:
        return False, f"torch not importable: {e}", [], [], None
    try:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except RuntimeError as e:
        return False, str(e), [], [], None
    if n == 0:
        return False, None, [], [], None
    gpus = []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        bus = None
        if hasattr(p, "pci_bus_id"):
            bus = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
        gpus.append({"index": i, "name": p.name, "capability": [p.major, p.minor], "total_bytes": int(total),
                     "free_bytes": int(free), "async_engines": _async_engines(i), "pci_bus_id": bus})
    peer = [[None if i == j else bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)] for i in range(n)]
    return True, None, gpus, peer, list(torch.cuda.get_arch_list())


def _async_engines(device: int) -> int | None:
    try:
        from cuda.bindings import runtime
    except ImportError:
        return None
    err, value = runtime.cudaDeviceGetAttribute(runtime.cudaDeviceAttr.cudaDevAttrAsyncEngineCount, device)
    return int(value) if err == runtime.cudaError_t.cudaSuccess else None


def read_cuda_lib(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError:
        return {"path": path, "exists": False, "fatbins": []}
    return {"path": path, "exists": True, "fatbins": fatbin_archs(blob)}


def collect(root: str = "/", cuda_lib_path: str | None = None, devices=_torch_devices) -> dict:
    """Snapshot of this machine (see the module docstring). ``devices`` is injectable for tests."""
    if cuda_lib_path is None:
        from sparkinfer.native import build
        cuda_lib_path = os.path.join(build.LIB_DIR, build.CUDA_LIB)
    available, error, gpus, peer, torch_archs = devices()
    gpu_bus = [g["pci_bus_id"] for g in gpus if g["pci_bus_id"]] or nvidia_pci_functions(root)
    try:
        iommu = sorted(os.listdir(os.path.join(root, "sys/class/iommu")))
    except OSError:
        iommu = None
    types = {}
    for b in gpu_bus:
        t = _read(root, f"sys/bus/pci/devices/{b}/iommu_group/type")
        if t is not None:
            types[b] = t.strip()
    cmdline = _read(root, "proc/cmdline")
    return {
        "cuda_available": available, "cuda_error": error, "gpus": gpus, "peer": peer, "torch_archs": torch_archs,
        "iommu_devices": iommu, "gpu_iommu_types": types,
        "cmdline": cmdline.strip() if cmdline is not None else None,
        "uvm_disable_hmm": _read(root, "sys/module/nvidia_uvm/parameters/uvm_disable_hmm"),
        "acs": read_acs(root, gpu_bus) if gpu_bus else None,
        "cuda_lib": read_cuda_lib(cuda_lib_path),
    }
