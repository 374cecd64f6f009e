"""``hivespec doctor``: checks a machine and a config before (or while) a node runs there.

Each check returns one `Check` line: OK, WARN (works, but worth knowing), SKIP (could not be
checked here, and why) or FAIL, with what was found and, when it is not OK, what to do. The
command exits non-zero when any check fails. The checks are the failures volunteers hit most
(RL Swarm's issue tracker: p2pd that does not start, unreachable bootstrap peers, out-of-memory
hours into a run, a full disk): torch and CUDA, RAM and VRAM against the model's training
footprint, each GPU's name, compute capability and bf16 support (`gpu_checks`, a pure function
of `GpuProperties`), vLLM, the embedded model, p2pd, ports, bootstrap peers, the identity key file, disk
space for checkpoints, clock skew against peers (hivemind needs clocks within 3 s), and
reachability: whether peers can dial this machine, only through a relay, or not at all (NAT).

The network checks start a real p2pd and DHT node on 127.0.0.1 (hivemind is imported here, and
only when those checks run); nothing is announced or stored in the swarm.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import platform
import shutil
import socket
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from hivespec.node.config import InputError, NodeConfig, node_home
from hivespec.node.model.footprint import ModelShape, config_peak_bytes, fit_micro_batch, model_shape
from hivespec.node.process_memory import available_bytes
from hivespec.node.swarm.ports import port_in_use
from hivespec.node.training.checkpoint import CorruptCheckpoint, list_checkpoints, verify_checkpoint

if TYPE_CHECKING:
    from hivespec.node.model.precision import PrecisionPlan

Status = Literal["ok", "warn", "skip", "fail"]
MAX_CLOCK_SKEW_S = 3.0  # hivemind's DHT rejects records beyond this discrepancy
_ADAM_BYTES_PER_PARAM = 4 + 4 + 4 + 4  # fp32 master weight, gradient, exp_avg, exp_avg_sq
_HEADROOM_BYTES = 1 << 30  # activations, KV cache, tokenizer, python


@dataclass(frozen=True)
class Check:
    """One doctor line: `name`, its status, what was found and what to do."""

    name: str
    status: Status
    detail: str

    def line(self) -> str:
        return f"{self.status.upper():<4}  {self.name:<12} {self.detail}"


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


# ----- local checks -------------------------------------------------------------------------


def check_python() -> Check:
    return Check("python", "ok", f"{platform.python_version()} ({sys.executable})")


def check_torch(config: NodeConfig) -> Check:
    wants_cuda = config.model.device.startswith("cuda")
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        return Check("torch", "ok", f"torch {torch.__version__}, CUDA {torch.version.cuda}: {names}")
    if wants_cuda:
        return Check("torch", "fail", f"torch {torch.__version__} sees no CUDA device but model.device is {config.model.device!r}: "
                     "install a CUDA build of torch and check `nvidia-smi`, or set model.device=cpu")
    return Check("torch", "ok", f"torch {torch.__version__}, CPU only (no CUDA device; fine for the CPU demo and the tiny model)")


def check_model(config: NodeConfig) -> tuple[Check, ModelShape | None]:
    try:
        shape = model_shape(config.model.name, config.model.revision)
    except (FileNotFoundError, OSError, ValueError, KeyError, RuntimeError) as exc:  # RuntimeError: HubError
        return Check("model", "fail", f"{config.model.name!r}: {exc}"), None
    return Check("model", "ok", f"{config.model.name}: {shape.params / 1e6:.1f}M parameters"), shape


def check_memory(config: NodeConfig, shape: ModelShape | None, *, available: int | None = None,
                 precision: PrecisionPlan | None = None) -> list[Check]:
    """The host memory `available` (now, within this process's control group, where None) against the most one node of
    this config takes (`config_peak_bytes`) at the `precision` it trains in here (as `check_precision` measured it;
    None: as a CPU with native bf16 usually picks): ok where it fits, WARN where it fits only in smaller micro batches
    (as the node will train: `fit_micro_batch`), FAIL where not even in micro batches of one."""
    available = available_bytes() if available is None else available
    if shape is None:
        return [Check("ram", "skip", f"{_gib(available)} available; model size unknown (see the model line)")]
    if precision is not None:
        config = precision.applied_to(config)
    need = config_peak_bytes(config, shape)
    trains = "" if precision is None else f" (in {precision.trainer.label} here)"
    facts = f"{_gib(available)} available, a node needs up to ~{_gib(need)} while it trains{trains}"
    choice = fit_micro_batch(config, shape, available=available, resident=0)
    if not choice.fits:
        return [Check("ram", "fail", f"{facts}: close other programs, run fewer local nodes, or use a smaller model")]
    if choice.size < config.train.micro_batch_size:
        smaller = config_peak_bytes(config, shape, micro_batch_size=choice.size)
        return [Check("ram", "warn", f"{facts}; it will train in micro batches of {choice.size}, not "
                      f"{config.train.micro_batch_size} (~{_gib(smaller)}: the same updates, slower)")]
    return [Check("ram", "ok", f"{facts} ({available // need} such nodes fit)")]


def check_precision(config: NodeConfig, *, cache: Path | None | Literal["default"] = "default"
                    ) -> tuple[list[Check], PrecisionPlan | None]:
    """What model.engine_dtype and model.autocast become on this device (node/model/precision.py), measured as a node
    would, then model.attention and train.share_prompts (node/model/attention.py) on that precision; with the plan
    (None where the model does not load), which the ram line sizes a node by.

    WARN where an explicit setting is one this device runs slower than the alternative.
    """
    from hivespec.node.model.loader import load_model, node_threads
    from hivespec.node.model.precision import resolve_node_precision

    model = config.model
    threads = node_threads(model.threads)  # a node alone on this machine
    torch.set_num_threads(threads)
    try:
        loaded = load_model(model.name)  # the sync estimate samples its real weights, as a node's does
    except (OSError, ValueError) as exc:
        why = f"the model does not load ({exc}); see the model line"
        return [Check("precision", "skip", why), Check("attention", "skip", why)], None
    chosen = resolve_node_precision(config, loaded, threads=threads, cache=cache)
    auto = (model.engine_dtype, model.autocast) == ("auto", "auto")
    best = chosen if auto else resolve_node_precision(config, loaded, threads=threads, cache=cache, engine_dtype="auto",
                                                      autocast="auto")
    advice = []
    if chosen.engine.dtype != best.engine.dtype and best.engine.dtype in (torch.bfloat16, torch.float32):
        advice.append(f"model.engine_dtype {chosen.engine.label} is set, but {best.engine.label} is faster here "
                      f"({best.engine.reason}): set model.engine_dtype: auto")
    if chosen.trainer.dtype != best.trainer.dtype and chosen.trainer.source == "explicit" and model.train_dtype == "float32":
        advice.append(f"model.autocast is {str(chosen.trainer.dtype is not None).lower()}, but {best.trainer.label} is faster "
                      f"here ({best.trainer.reason}): set model.autocast: auto")
    precision = Check("precision", "warn", "; ".join(advice)) if advice else Check("precision", "ok", chosen.describe())
    return [precision, check_attention(config, loaded, chosen, threads=threads, cache=cache)], chosen


def check_attention(config: NodeConfig, model: torch.nn.Module, precision: PrecisionPlan, *, threads: int,
                    cache: Path | None | Literal["default"]) -> Check:
    """What model.attention and train.share_prompts become here, measured as a node would (once per machine, cached);
    WARN where an explicit setting is the slower way here."""
    import copy

    from hivespec.node.model.attention import resolve_attention
    from hivespec.node.model.precision import default_cache_path

    model_config = config.model
    try:
        model = model.to(model_config.device)  # measured where the node runs (a GPU's shared-prompt timing)
    except (RuntimeError, AssertionError) as exc:
        return Check("attention", "skip", f"the model does not move to {model_config.device} ({exc}); see the torch line")
    # vLLM's attention is its own: resolve_attention does not look at the engine's model then.
    native = model_config.engine == "native"
    engine_model = copy.deepcopy(model).to(precision.engine.dtype).eval().requires_grad_(False) if native else model
    settings = {"threads": threads, "cache": default_cache_path() if cache == "default" else cache, "autocast_dtype": precision.trainer.dtype}
    best = resolve_attention(config, model, engine_model, requested=("auto", "auto"), **settings)
    auto = (model_config.attention, config.train.share_prompts) == ("auto", "auto")
    chosen = best if auto else resolve_attention(config, model, engine_model, **settings)
    advice = []
    if model_config.attention != "auto" and (chosen.engine, chosen.trainer) != (best.engine, best.trainer):
        faster = "; ".join(c.describe() for c in (best.engine, best.trainer) if c is not None)
        advice.append(f"model.attention is {model_config.attention}, but here {faster}: set model.attention: auto")
    if config.train.share_prompts != "auto" and chosen.sharing.share != best.sharing.share:
        advice.append(f"train.share_prompts is {str(config.train.share_prompts).lower()}, but here {best.sharing.describe()}: "
                      "set train.share_prompts: auto")
    return Check("attention", "warn", "; ".join(advice)) if advice else Check("attention", "ok", "; ".join(chosen.describe()))
# ----- GPU ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuProperties:
    """What the doctor reads about one CUDA device (`gpu_properties`), kept apart so the lines are a pure function."""

    index: int
    name: str
    capability: tuple[int, int]
    total_bytes: int
    free_bytes: int
    bf16: bool


def gpu_properties() -> list[GpuProperties]:
    """Every visible CUDA device's name, compute capability, VRAM (free and total) and bf16 support."""
    if not torch.cuda.is_available():
        return []
    found = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        with torch.cuda.device(index):
            bf16 = torch.cuda.is_bf16_supported()
        found.append(GpuProperties(index, props.name, (props.major, props.minor), total, free, bf16))
    return found


def gpu_footprint(params: int, engine_dtype: str, *, engine: str, vllm_memory_utilization: float, total_bytes: int) -> int:
    """VRAM a node on one GPU needs: the trainer's fp32 weights, gradients and AdamW state, plus the engine.

    The native engine adds its weight copy; vLLM reserves its share of the GPU for weights and KV cache.
    """
    trainer = params * _ADAM_BYTES_PER_PARAM + _HEADROOM_BYTES
    if engine == "vllm":
        return trainer + int(vllm_memory_utilization * total_bytes)
    return trainer + params * {"bfloat16": 2, "float32": 4, "float64": 8}[engine_dtype]


def gpu_checks(gpus: list[GpuProperties], *, device: str, params: int | None, engine_dtype: str, engine: str = "native",
               vllm_memory_utilization: float = 0.5, torch_version: str = "", cuda_version: str | None = None) -> list[Check]:
    """The doctor's GPU lines for these devices and this config: one "gpu" and one "vram" line per device."""
    wants_cuda = device.startswith("cuda")
    if not gpus:
        why = f"torch {torch_version} is a CPU-only build" if cuda_version is None else f"torch {torch_version} (CUDA {cuda_version}) sees none"
        if wants_cuda:
            return [Check("gpu", "fail", f"no CUDA device ({why}) but model.device is {device!r}: install the CUDA build of torch "
                          "(README, GPU machine) and check `nvidia-smi`, or set model.device=cpu"),
                    Check("vram", "skip", "no CUDA device")]
        return [Check("gpu", "skip", f"no CUDA device ({why}); the node runs on the CPU"), Check("vram", "skip", "no CUDA device")]
    index = device.partition(":")[2]
    wanted = (int(index) if index.isdigit() else -1) if wants_cuda and index else (0 if wants_cuda else None)
    checks = []
    if wanted is not None and wanted not in [gpu.index for gpu in gpus]:  # the node's device check refuses it at start
        checks.append(Check("gpu", "fail", f"model.device {device!r} is none of this machine's {len(gpus)} CUDA device(s) "
                            f"(cuda:0..cuda:{len(gpus) - 1}); pick one of them"))
    for gpu in gpus:
        used = gpu.index == wanted
        tag = f"cuda:{gpu.index} {gpu.name} (compute {gpu.capability[0]}.{gpu.capability[1]})"
        if gpu.bf16:
            checks.append(Check("gpu", "ok", f"{tag}, bf16 supported" + ("" if used else "; not the configured device")))
        elif used and engine_dtype == "bfloat16":
            checks.append(Check("gpu", "warn", f"{tag}, no native bf16: model.engine_dtype bfloat16 is emulated and slow here; "
                                "set model.engine_dtype=float32"))
        else:
            checks.append(Check("gpu", "ok", f"{tag}, no native bf16 (float16/float32 only)"))
        if params is None:
            checks.append(Check("vram", "skip", f"cuda:{gpu.index} {_gib(gpu.free_bytes)} free of {_gib(gpu.total_bytes)}; model size unknown"))
            continue
        need = gpu_footprint(params, engine_dtype, engine=engine, vllm_memory_utilization=vllm_memory_utilization,
                             total_bytes=gpu.total_bytes)
        found = f"cuda:{gpu.index} {_gib(gpu.free_bytes)} free of {_gib(gpu.total_bytes)}, a node needs ~{_gib(need)}"
        if not used or gpu.free_bytes >= need:
            checks.append(Check("vram", "ok", found + ("" if used else " (not the configured device)")))
        elif gpu.total_bytes >= need:
            checks.append(Check("vram", "fail", f"{found}: other processes hold the rest; stop them (nvidia-smi)"
                                + (" or lower model.vllm_gpu_memory_utilization" if engine == "vllm" else "")))
        else:
            checks.append(Check("vram", "fail", f"{found}: the model does not fit this GPU; use a smaller model"
                                + (" or lower model.vllm_gpu_memory_utilization" if engine == "vllm" else "")))
    return checks


def check_gpu(config: NodeConfig, params: int | None) -> list[Check]:
    """`gpu_checks` for this machine's CUDA devices and this config."""
    return gpu_checks(gpu_properties(), device=config.model.device, params=params, engine_dtype=config.model.engine_dtype,
                      engine=config.model.engine, vllm_memory_utilization=config.model.vllm_gpu_memory_utilization,
                      torch_version=torch.__version__, cuda_version=torch.version.cuda)


def check_vllm() -> Check:
    if importlib.util.find_spec("vllm") is None:
        if torch.cuda.is_available():
            return Check("vllm", "warn", "not installed; the native torch engine is used. For faster GPU rollouts: "
                         "pip install 'hivespec[gpu]' and set model.engine: vllm")
        return Check("vllm", "ok", "not installed (not needed on CPU; the native torch engine is used)")
    try:
        import vllm
    except Exception as exc:  # noqa: BLE001 - a broken install must be a doctor line, not a crash
        return Check("vllm", "fail", f"installed but does not import ({type(exc).__name__}: {exc}); reinstall with "
                     "pip install --force-reinstall 'hivespec[gpu]'")
    return Check("vllm", "ok", f"vllm {vllm.__version__} imports (used when model.engine is vllm)")


def check_identity(home: Path) -> Check:
    from hivespec.node.identity_file import load_or_create_identity

    path = home / "identity.key"
    if home.exists() and not home.is_dir():
        return Check("identity", "fail", f"the home {home} is a file, not a folder; point --home (or $HIVESPEC_HOME) at a folder")
    if not path.exists():
        # As join's check_home would find it, without making the folder: a file on the way, or a folder not ours to write.
        parent = _existing_parent(home)
        if not parent.is_dir():
            return Check("identity", "fail", f"the home {home} cannot be made: {parent} is a file; point --home (or "
                         "$HIVESPEC_HOME) at a folder you can write")
        if not os.access(parent, os.W_OK | os.X_OK):
            return Check("identity", "fail", f"the home {home} cannot be made or written: {parent} is not writable; point "
                         "--home (or $HIVESPEC_HOME) at a folder you can write")
        return Check("identity", "ok", f"no key yet at {path}; `hivespec join` creates it (mode 0600)")
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        return Check("identity", "fail", f"{path} is not a regular file; move it away")
    if st.st_mode & 0o077:
        return Check("identity", "fail", f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: run `chmod 600 {path}` "
                     "(and treat the key as leaked if others could read it)")
    if st.st_uid != os.getuid():
        return Check("identity", "warn", f"{path} belongs to uid {st.st_uid}, not you ({os.getuid()})")
    try:
        identity = load_or_create_identity(path)
    except ValueError as exc:
        return Check("identity", "fail", str(exc))
    return Check("identity", "ok", f"{identity.name} ({identity.peer_id}), {path} mode 0600")


def check_private_swarm(config: NodeConfig, home: Path) -> Check:
    """The private swarm's files as `hivespec join` reads them, and whether this home's key is on the allowlist."""
    from hivespec.node.identity_file import load_or_create_identity
    from hivespec.node.inputs import private_swarm
    from hivespec.node.swarm.private_files import check_member

    swarm = config.swarm
    try:
        private = private_swarm(swarm)
    except InputError as exc:
        return Check("private swarm", "fail", str(exc))
    if private is None:
        return Check("private swarm", "skip", f"swarm {swarm.swarm!r} is public (no swarm.private.allowlist_file)")
    members = f"swarm {swarm.swarm!r}: {len(private.allowlist)} public key(s) on the allowlist"
    path = home / "identity.key"
    if not path.is_file():
        return Check("private swarm", "warn", f"{members}; this home has no key yet: run `hivespec identity show --home "
                     f"{home}` and add its public_key to every member's allowlist before the node trains")
    try:
        identity = load_or_create_identity(path)
    except ValueError:
        return Check("private swarm", "skip", f"{members}; this home's key is unreadable (see the identity line)")
    if private.allowlist == {identity.public_key}:  # what `check_member` would log as a warning
        return Check("private swarm", "warn", f"{members}, only this node's: it shares with nobody (enough for a leader "
                     "that followers mirror); list the members' public_keys")
    try:
        check_member(private, identity, swarm, trains=True)
    except InputError as exc:
        return Check("private swarm", "fail", str(exc))
    return Check("private swarm", "ok", f"{members}, this node's among them")


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk(config: NodeConfig, home: Path, params: int | None) -> Check:
    directory = config.checkpoint.folder(home)
    free = shutil.disk_usage(_existing_parent(directory)).free
    if params is None:
        return Check("disk", "skip", f"{_gib(free)} free at {directory}; model size unknown")
    checkpoint = params * 12  # fp32 weights + AdamW exp_avg and exp_avg_sq
    need = checkpoint * (config.checkpoint.keep + 1) + _HEADROOM_BYTES  # keep + the one being written + the journal
    if free < need:
        return Check("disk", "fail", f"{_gib(free)} free at {directory}, checkpoints need ~{_gib(need)} "
                     f"({config.checkpoint.keep + 1} x {_gib(checkpoint)} + journal): free space, lower checkpoint.keep "
                     "or set checkpoint.dir to a larger disk")
    return Check("disk", "ok", f"{_gib(free)} free at {directory}, checkpoints need ~{_gib(need)}")


def check_checkpoints(config: NodeConfig, home: Path) -> Check:
    directory = config.checkpoint.folder(home)
    found = list_checkpoints(directory)  # read-only: a running node's temp directory is left alone
    if not found:
        return Check("checkpoint", "ok", f"none yet in {directory}")
    bad = []
    for path in reversed(found):
        try:
            meta = verify_checkpoint(path)
        except CorruptCheckpoint as exc:
            bad.append(f"{path.name}: {exc}")
            continue
        detail = f"{path.name} verifies (resumes at round {meta.get('next_round')}, policy version {meta.get('policy_version')})"
        if bad:
            return Check("checkpoint", "warn", f"{detail}; newer unusable: {'; '.join(bad)} (a resume skips them)")
        return Check("checkpoint", "ok", detail)
    return Check("checkpoint", "fail", f"no checkpoint in {directory} verifies ({'; '.join(bad)}): a resume starts from "
                 "the initial weights; move the directory away to keep it for inspection")


def check_ports(config: NodeConfig) -> list[Check]:
    checks = []
    wanted = [("swarm port", config.swarm.host, config.swarm.port, "swarm.port")]
    status_cfg = getattr(config, "status", None)
    if status_cfg is not None and getattr(status_cfg, "enabled", False):
        wanted.append(("status port", status_cfg.host, status_cfg.port, "status.port"))
    for name, host, port, key in wanted:
        if port == 0:
            checks.append(Check(name, "ok", f"{host}: any free port (0)"))
            continue
        if (taken := port_in_use(host, port)) and key == "status.port":  # the status server then takes a free port
            checks.append(Check(name, "warn", f"{host}:{port} is taken ({taken}): the node serves its status on a free "
                                f"port instead (`hivespec status` finds it in the home's status.json), or set {key}"))
            continue
        if taken:
            checks.append(Check(name, "fail", f"{host}:{port} cannot be bound ({taken}): another process uses "
                                f"it (`ss -ltnp | grep :{port}`), or set {key}"))
            continue
        checks.append(Check(name, "ok", f"{host}:{port} is free"))
    return checks


# ----- network checks -----------------------------------------------------------------------


def _tcp_target(maddr: str) -> tuple[str, int] | None:
    parts = maddr.strip("/").split("/")
    host = port = None
    for proto, value in zip(parts[::2], parts[1::2]):
        if proto in ("ip4", "ip6", "dns", "dns4", "dns6"):
            host = value
        elif proto == "tcp":
            port = int(value)
    return (host, port) if host and port else None


async def _network_checks(config: NodeConfig, timeout: float) -> list[Check]:
    from hivemind.dht.node import DHTNode
    from hivemind.p2p import PeerID
    from hivemind.proto import dht_pb2
    from hivemind.utils import get_dht_time
    from hivemind.utils.multiaddr import Multiaddr

    from hivespec.node.swarm.p2pd import start_p2pd

    checks = []
    started = time.perf_counter()
    try:  # started as a node starts it (in a session of its own), so this checks that path too
        p2p = await start_p2pd(host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=None, use_relay=True,
                               nat_port_map=False, relays=(), identity_path=None, startup_timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - every failure here is the finding
        return [Check("p2pd", "fail", f"does not start ({type(exc).__name__}: {exc}); reinstall hivemind "
                      "(pip install --force-reinstall hivemind==1.1.12) and check that /tmp is writable")]
    checks.append(Check("p2pd", "ok", f"started in {time.perf_counter() - started:.1f} s"))
    dht = None
    try:
        peers = config.swarm.initial_peers
        if not peers:
            checks.append(Check("peers", "skip", "no initial peers configured (solo, or the first node of a swarm)"))
            checks.append(Check("clock", "skip", "no peers to compare clocks with"))
            return checks
        unreachable = []
        for maddr in peers:
            target = _tcp_target(maddr)
            if target is None:
                unreachable.append(f"{maddr} (no ip/tcp part)")
                continue
            try:
                socket.create_connection(target, timeout=timeout).close()
                # p2pd must know the address before the DHT can ping the peer id; P2P has no public
                # connect(), and node/swarm/gossip.py dials through _client the same way.
                address = Multiaddr(maddr)
                peer_id = PeerID.from_base58(address.value_for_protocol("p2p"))
                transport = address.decapsulate(Multiaddr(f"/p2p/{peer_id.to_base58()}"))
                await asyncio.wait_for(p2p._client.connect(peer_id, [transport]), timeout)
            except Exception as exc:  # noqa: BLE001 - refused, timed out or malformed: that is the finding
                unreachable.append(f"{maddr} ({getattr(exc, 'strerror', None) or exc or type(exc).__name__})")
        try:
            dht = await asyncio.wait_for(DHTNode.create(p2p=p2p, initial_peers=peers, wait_timeout=timeout), 3 * timeout)
            known = list(dht.protocol.routing_table.uid_to_peer_id.values())
        except Exception as exc:  # noqa: BLE001 - the finding is that bootstrap failed
            known = []
            unreachable.append(f"DHT bootstrap failed: {type(exc).__name__}: {exc}")
        if not known:
            checks.append(Check("peers", "fail", f"no initial peer answered ({'; '.join(unreachable) or 'DHT empty'}): check "
                                "the multiaddrs, that those nodes run, and firewalls/NAT on their port"))
            checks.append(Check("clock", "skip", "no reachable peer to compare clocks with"))
            return checks
        status: Status = "warn" if unreachable else "ok"
        detail = f"{len(known)} DHT peer(s) reachable" + (f"; unreachable: {'; '.join(unreachable)}" if unreachable else "")
        checks.append(Check("peers", status, detail))
        skews = []
        for peer_id in known[:8]:
            request = dht_pb2.PingRequest(peer=dht.protocol.node_info, validate=False)
            sent = get_dht_time()
            try:
                response = await dht.protocol.get_stub(peer_id).rpc_ping(request, timeout=timeout)
            except Exception:  # noqa: BLE001, S112 - a peer that does not answer is left out of the estimate
                continue
            received = get_dht_time()
            if response.dht_time:
                skews.append(response.dht_time - (sent + received) / 2)
        if not skews:
            checks.append(Check("clock", "skip", "no peer answered a ping with its time"))
        else:
            worst = max(skews, key=abs)
            if abs(worst) > MAX_CLOCK_SKEW_S:
                checks.append(Check("clock", "fail", f"off by {worst:+.1f} s from a peer (hivemind allows {MAX_CLOCK_SKEW_S:g} s): "
                                    "enable NTP (`timedatectl set-ntp true`) on this machine"))
            else:
                checks.append(Check("clock", "ok", f"within {abs(worst):.2f} s of {len(skews)} peer(s)"))
        return checks
    finally:
        if dht is not None:
            await dht.shutdown()
        await p2p.shutdown()


_REACH_ADVICE = {
    "reachable": ("ok", "peers can open connections to you directly"),
    "relayed": ("warn", ("works: peers reach you through the relay, which carries your uploads. For direct connections "
                        "forward TCP swarm.port on your router to this machine and set swarm.announce_maddrs to "
                        "/ip4/<your public IP>/tcp/<port>")),
    "unreachable": ("warn", ("you can fetch from peers but none can fetch from you (your rollouts will not spread): set "
                            "swarm.use_auto_relay: true (the public preset does) so the bootstrap peers relay for you, "
                            "or forward a port and set swarm.announce_maddrs")),
    "unknown": ("skip", "no initial peer answered the reachability check (it may run an older hivespec)"),
}


async def _reachability_check(config: NodeConfig, timeout: float) -> Check:
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    from hivespec.node.swarm.bootstrap import dial
    from hivespec.node.swarm.nat import REACH_STREAM, ReachService, check_reachability, listen_ports, relay_candidates
    from hivespec.node.swarm.p2pd import start_p2pd

    swarm = config.swarm
    relays = relay_candidates(swarm.initial_peers) if swarm.use_auto_relay else []
    # Listen where the node would (swarm.host) on a free port: the answer is about this network, not port 31337.
    p2p = await start_p2pd(host_maddrs=[f"/ip4/{swarm.host}/tcp/0"], announce_maddrs=swarm.announce_maddrs,
                           use_relay=swarm.use_relay, nat_port_map=swarm.nat_port_map, relays=relays, identity_path=None,
                           startup_timeout=timeout)
    try:
        await p2p.add_binary_stream_handler(REACH_STREAM, ReachService(p2p).handle)
        ports = listen_ports([str(m) for m in await p2p.get_visible_maddrs()])
        circuits = [f"{r}/p2p-circuit" for r in relays]
        verdict = None
        for maddr in swarm.initial_peers:
            peer = PeerID.from_base58(Multiaddr(maddr).value_for_protocol("p2p"))
            try:
                await dial(p2p, peer, [maddr], timeout)
            except Exception:  # noqa: BLE001, S112 - the peers line already says which did not answer
                continue
            for attempt in range(3):  # the relay slot is reserved just after we connect: give it a moment
                verdict = await check_reachability(p2p, peer, ports=ports, circuits=circuits, timeout=timeout / 2)
                if verdict.state != "unreachable" or not circuits:
                    break
                await asyncio.sleep(2.0 * (attempt + 1))
            if verdict.state != "unknown":
                break
    finally:
        await p2p.shutdown()
    if verdict is None:
        return Check("reachability", "skip", "no initial peer could be dialled (see the peers line)")
    status, advice = _REACH_ADVICE[verdict.state]
    relay_note = f"; relays: {', '.join(relays)}" if relays else "; swarm.use_auto_relay is off"
    return Check("reachability", status, f"{verdict.state}: {verdict.detail}{relay_note}. {advice}")  # type: ignore[arg-type]


def reachability_check(config: NodeConfig, *, timeout: float = 10.0) -> Check:
    """How peers can reach this node, measured by the initial peers (node/swarm/nat.py), with what to do about it."""
    if not config.swarm.initial_peers:
        return Check("reachability", "skip", "no initial peers to measure it against (a first or public node: run the "
                     "doctor on another machine with --initial-peer pointing here)")
    try:
        return asyncio.run(_reachability_check(config, timeout))
    except Exception as exc:  # noqa: BLE001 - the finding is that the check could not run
        return Check("reachability", "fail", f"could not measure ({type(exc).__name__}: {exc}); see the p2pd and peers lines")


def network_checks(config: NodeConfig, *, timeout: float = 10.0) -> list[Check]:
    """p2pd start-up, bootstrap reachability and clock skew (a real p2pd on 127.0.0.1)."""
    return asyncio.run(_network_checks(config, timeout))


def run_checks(config: NodeConfig, *, network: bool = True, timeout: float = 10.0,
               on_check: Callable[[Check], None] | None = None) -> list[Check]:
    """Every check in order; `on_check` sees each as soon as it is done (for a live printout)."""
    home = node_home(config)
    checks: list[Check] = []

    def add(*new: Check) -> None:
        for check in new:
            checks.append(check)
            if on_check is not None:
                on_check(check)

    add(check_python(), check_torch(config))
    model, shape = check_model(config)
    add(model)
    available = available_bytes()  # before the precision check loads the model into this process
    precision = None
    if shape is not None:
        precision_checks, precision = check_precision(config)
        add(*precision_checks)
    add(*check_memory(config, shape, available=available, precision=precision))
    params = shape.params if shape is not None else None
    add(*check_gpu(config, params))
    add(check_vllm())
    add(*check_ports(config))
    if network:
        add(*network_checks(config, timeout=timeout))
        add(reachability_check(config, timeout=timeout))
    else:
        add(Check("p2pd", "skip", "--offline"), Check("peers", "skip", "--offline"), Check("clock", "skip", "--offline"),
            Check("reachability", "skip", "--offline"))
    add(check_identity(home), check_private_swarm(config, home), check_disk(config, home, params), check_checkpoints(config, home))
    return checks
