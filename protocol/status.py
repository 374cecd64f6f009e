"""Status snapshot schema v1: what a node tells its dashboard, `hivespec status` and scrapers.

A node serves one `StatusSnapshot` as JSON at ``/status`` on 127.0.0.1. The dashboard reads
nothing but these bytes, so `decode_status` treats them as untrusted: a size bound, finite
numbers only, bounded nesting, list and string lengths, and a type check of every known field.

Compatibility rules, so mixed versions keep working:
- Unknown keys are ignored: a newer node may add fields (and sections) without a version bump.
- Missing keys take their defaults: an older node simply reports less.
- Optional numbers are ``None`` when a node does not measure them (yet); the dashboard shows '-'.
- ``version`` changes only when a field changes meaning or type; a reader rejects versions it
  does not speak, with a message that says which side to upgrade.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .codec import Reject, check_tree
from .limits import MIB
from .verdict import Reason, Verdict

STATUS_VERSION = 1
MAX_STATUS_BYTES = 4 * MIB
MAX_DEPTH = 6  # snapshot -> section -> list -> row -> counters map -> value
MAX_LIST = 2048  # rounds of history, peers, log lines, per-source rows
MAX_MAP = 256  # counters maps (intake reasons, gossip counters)
MAX_STR = 2048  # log messages; names and ids are far shorter

T = TypeVar("T")
_FLOAT_MAX = sys.float_info.max


@dataclass(frozen=True)
class NodeInfo:
    """Who the node is and where it stands (the dashboard's header)."""

    name: str
    peer_id: str
    swarm: str
    model: str = ""
    device: str = ""
    role: str = "trainer"  # "trainer" trains and publishes deltas; "follower" applies them
    reachability: str | None = None  # "reachable", "relayed" or "unreachable" (node/swarm/nat.py); None: not measured
    policy_version: int = 0
    round: int = -1  # last finished round, -1 before the first
    rounds_target: int = 0  # rounds the node was asked to run, 0 = forever
    phase: str = "starting"  # "starting", "running", "pausing", "paused", "stopping", "done", "failed" (an error ended the rounds)
    paused: bool = False  # training is (or will be, after the current round) held
    started_at: float = 0.0  # unix time the node started
    uptime_s: float = 0.0
    round_started_at: float | None = None  # unix time the current round started, None between rounds
    maddrs: list[str] = field(default_factory=list)  # multiaddrs peers can bootstrap from
    checkpoint: str | None = None  # name of the last checkpoint written, if any
    checkpoint_round: int | None = None  # the round after which it was written
    checkpoint_at: float | None = None
    solo: bool | None = None  # no DHT peers: training alone (and retrying the bootstrap)
    private: bool | None = None  # a private swarm (allowlist, encrypted bodies)
    engine_dtype: str = ""  # the rollout engine's weight dtype, e.g. "bfloat16" ("" = not reported)
    train_precision: str = ""  # "float32" or "bfloat16 autocast" ("" = not reported)
    engine_dtype_reason: str = ""  # why, e.g. model.engine_dtype "auto" and the measured decode step times
    train_precision_reason: str = ""  # why, e.g. model.autocast "auto" and the measured forward+backward times
    attention: list[str] = field(default_factory=list)  # what model.attention and train.share_prompts became, one line each with why


@dataclass(frozen=True)
class PeerRow:
    """One peer as this node sees it; counts are since this node started."""

    peer_id: str
    name: str = ""
    last_seen: float | None = None  # unix time of the last envelope received from it
    latency_ms: float | None = None
    batches: int = 0  # rollout batches (envelopes) received from it
    accepted: int = 0  # rollouts accepted
    rejected: int = 0  # batches rejected (provably wrong: counts against its score)
    ignored: int = 0  # batches ignored (stale, duplicate, other model)
    last_reason: str = ""  # reason of its last batch that was not accepted
    score: float | None = None  # gossip score: deliveries up, provably bad data down
    graylisted: bool | None = None  # score under the threshold: its data is no longer fetched
    reachability: str | None = None


@dataclass(frozen=True)
class RoundPoint:
    """One finished round, for the plots and sparklines."""

    round: int
    finished_at: float
    policy_version: int = 0
    seconds: float = 0.0  # wall time of the round
    rollout_seconds: float = 0.0
    made: int = 0  # own rollouts generated
    accepted: int = 0  # foreign rollouts accepted
    rejected: int = 0  # foreign batches rejected
    foreign_used: int = 0  # foreign samples the step took, flat ones only with train.flat_sample_stats (some fetched in earlier rounds: they wait in the pool)
    reward_mean: float | None = None  # own rollouts
    foreign_reward_mean: float | None = None
    loss: float | None = None
    tokens_generated: int = 0
    tokens_per_second: float | None = None  # generated tokens / rollout seconds
    rollouts_per_minute: float | None = None  # own rollouts / round wall time
    tokens_per_target_forward: float | None = None  # speculation: > 1 means it pays
    draft_acceptance: float | None = None  # speculation: share of drafted tokens accepted
    gossip_bytes_in: int = 0  # fetched from peers during the round
    gossip_bytes_out: int = 0  # served to peers during the round
    delta_bytes: int = 0
    delta_density: float | None = None


@dataclass(frozen=True)
class HeldoutPoint:
    """The node's greedy accuracy on held-out questions after a round (eval.every_rounds)."""

    round: int
    accuracy: float


@dataclass(frozen=True)
class SourceStats:
    """Importance-weight statistics of one sample source ("own", "foreign" or a peer id) in the last step."""

    source: str
    samples: int | None = None
    kept_fraction: float | None = None
    truncated_fraction: float | None = None
    masked_fraction: float | None = None
    vetoed_fraction: float | None = None  # part of masked whose behaviour probability was under the veto
    ess_fraction: float | None = None
    mean_weight: float | None = None
    max_weight: float | None = None


@dataclass(frozen=True)
class TrainerStatus:
    """The last training step."""

    step_round: int | None = None
    trained_samples: int = 0
    foreign_used: int = 0
    foreign_share: float | None = None  # foreign samples / trained samples
    loss: float | None = None
    grad_norm: float | None = None
    kl: float | None = None  # mean KL to the behaviour policy per kept token
    ppo_clip_fraction: float | None = None
    sources: list[SourceStats] = field(default_factory=list)  # "own", "foreign" (all peers), then each peer


@dataclass(frozen=True)
class SyncStatus:
    """Weight sync: trainer -> engine deltas (and, for followers, how far behind they are)."""

    delta_bytes: int | None = None
    dense_bytes: int | None = None
    density: float | None = None
    engine_mismatch: int | None = None  # elements where the engine differs from the trainer's cast (0 = bit-exact)
    versions_behind: int | None = None  # followers: swarm policy version minus ours
    codec: str | None = None


@dataclass(frozen=True)
class GossipStatus:
    """Counters of the node's gossip layer (cumulative)."""

    bytes_in: int = 0
    bytes_out: int = 0
    bodies_fetched: int = 0
    bodies_served: int = 0
    published: int = 0
    known_peers: int = 0  # peers in the DHT routing table
    bad_records: int = 0
    fetch_failures: int = 0
    counters: dict[str, int] = field(default_factory=dict)  # every counter, including ones not named above


@dataclass(frozen=True)
class IntakeStatus:
    """Admission outcomes of foreign batches (cumulative)."""

    accepted_rollouts: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)  # accept / ignore / reject
    reasons: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class StoreStatus:
    """Rollouts in the node's journal."""

    own: int = 0
    foreign: int = 0
    total: int = 0


@dataclass(frozen=True)
class SupervisionStatus:
    """Self-healing counters since the node started, and its memory (None: not reported)."""

    oom_retries: int | None = None  # out-of-memory batch splits and retries
    gossip_restarts: int | None = None  # gossip rebuilt after p2pd died or hung
    watchdog_stalls: int | None = None  # round loop stalls reported
    resident_mb: float | None = None  # the node process's resident memory when the snapshot was taken
    peak_resident_mb: float | None = None  # the most it has held: its largest training step included
    micro_batch_size: int | None = None  # samples a forward and backward of its last step took at most
    micro_batch_wanted: int | None = None  # the config's: a smaller micro_batch_size is what fit the memory available


@dataclass(frozen=True)
class LogLine:
    """A WARNING or worse log record of the node."""

    time: float
    level: str
    logger: str
    message: str


@dataclass(frozen=True)
class StatusSnapshot:
    """Everything a dashboard draws, taken at ``time`` (the node's clock, unix seconds)."""

    version: int
    time: float
    node: NodeInfo
    peers: list[PeerRow] = field(default_factory=list)
    rounds: list[RoundPoint] = field(default_factory=list)
    heldout: list[HeldoutPoint] = field(default_factory=list)  # the held-out curve, oldest first (empty: eval.every_rounds off)
    trainer: TrainerStatus = field(default_factory=TrainerStatus)
    sync: SyncStatus = field(default_factory=SyncStatus)
    gossip: GossipStatus = field(default_factory=GossipStatus)
    intake: IntakeStatus = field(default_factory=IntakeStatus)
    store: StoreStatus = field(default_factory=StoreStatus)
    supervision: SupervisionStatus = field(default_factory=SupervisionStatus)
    logs: list[LogLine] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def encode_status(snapshot: StatusSnapshot) -> bytes:
    """UTF-8 JSON of a snapshot; non-finite floats become null (JSON has no NaN)."""
    return json.dumps(_finite(snapshot.to_dict()), separators=(",", ":"), allow_nan=False).encode()


def decode_status(data: bytes) -> tuple[Verdict, StatusSnapshot | None]:
    """Validate and decode ``/status`` bytes; never raises on bad input (see the module docstring)."""
    if not isinstance(data, (bytes, bytearray)):
        return Verdict.reject(Reason.BAD_TYPE, f"expected bytes, got {type(data).__name__}"), None
    if len(data) > MAX_STATUS_BYTES:
        return Verdict.reject(Reason.TOO_LARGE, f"{len(data)} bytes > limit {MAX_STATUS_BYTES}"), None
    try:
        obj = json.loads(bytes(data).decode("utf-8"), parse_constant=_refuse_constant)
    except RecursionError:
        return Verdict.reject(Reason.TOO_DEEP, "JSON nesting exceeds the interpreter's recursion limit"), None
    except _NonFinite as exc:
        return Verdict.reject(Reason.NOT_FINITE, str(exc)), None
    except (UnicodeDecodeError, ValueError) as exc:
        return Verdict.reject(Reason.MALFORMED, f"not a JSON document: {exc}"), None
    verdict = check_tree(obj, max_depth=MAX_DEPTH)
    if not verdict.ok:
        return verdict, None
    try:
        if not isinstance(obj, dict):
            raise Reject(Reason.BAD_TYPE, f"snapshot must be an object, got {type(obj).__name__}")
        version = obj.get("version")
        if type(version) is not int:
            raise Reject(Reason.BAD_KEYS, f"snapshot.version must be an integer, got {version!r}")
        if version != STATUS_VERSION:
            side = "this reader (upgrade hivespec here)" if version > STATUS_VERSION else "the node (upgrade it)"
            raise Reject(Reason.BAD_VERSION, f"status version {version}, this reader speaks {STATUS_VERSION}; upgrade {side}")
        return Verdict.accept(), _decode_dataclass(StatusSnapshot, obj, "snapshot")
    except Reject as reject:
        return reject.verdict, None


class _NonFinite(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NonFinite(f"JSON constant {name} is not allowed (numbers must be finite)")


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _decode_dataclass(cls: type[T], obj: object, path: str) -> T:
    if not isinstance(obj, dict):
        raise Reject(Reason.BAD_TYPE, f"{path} must be an object, got {type(obj).__name__}")
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in obj:
            kwargs[f.name] = _decode_value(hints[f.name], obj[f.name], f"{path}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise Reject(Reason.BAD_KEYS, f"{path}.{f.name} is missing")
    return cls(**kwargs)


def _decode_value(hint: Any, value: object, path: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _decode_value(inner, value, path)
    if dataclasses.is_dataclass(hint):
        return _decode_dataclass(hint, value, path)
    if origin is list:
        if not isinstance(value, list):
            raise Reject(Reason.BAD_TYPE, f"{path} must be a list, got {type(value).__name__}")
        if len(value) > MAX_LIST:
            raise Reject(Reason.TOO_LARGE, f"{path} has {len(value)} items > limit {MAX_LIST}")
        return [_decode_value(args[0], item, f"{path}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise Reject(Reason.BAD_TYPE, f"{path} must be an object, got {type(value).__name__}")
        if len(value) > MAX_MAP:
            raise Reject(Reason.TOO_LARGE, f"{path} has {len(value)} keys > limit {MAX_MAP}")
        return {_decode_value(str, k, f"{path} key"): _decode_value(args[1], v, f"{path}.{k}") for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            raise Reject(Reason.BAD_TYPE, f"{path} must be true or false, got {value!r}")
        return value
    if hint is int:
        if type(value) is not int:
            raise Reject(Reason.BAD_TYPE, f"{path} must be an integer, got {value!r}")
        return value
    if hint is float:
        if type(value) not in (int, float):
            raise Reject(Reason.BAD_TYPE, f"{path} must be a number, got {value!r}")
        if type(value) is int and not -_FLOAT_MAX <= value <= _FLOAT_MAX:  # float() would raise OverflowError
            raise Reject(Reason.NOT_FINITE, f"{path}: the integer {str(value)[:20]}... is beyond any float")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise Reject(Reason.BAD_TYPE, f"{path} must be a string, got {type(value).__name__}")
        if len(value) > MAX_STR:
            raise Reject(Reason.TOO_LARGE, f"{path} is {len(value)} characters > limit {MAX_STR}")
        return value
    raise Reject(Reason.BAD_TYPE, f"{path}: no decoder for {hint!r}")  # a schema bug, caught by the tests
