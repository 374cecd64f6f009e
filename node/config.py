"""Typed node configuration: dataclasses with help text, YAML presets, env and CLI overrides.

Precedence, lowest first: dataclass defaults, the YAML file, ``HIVESPEC_<SECTION>__<FIELD>``
environment variables, then ``--set section.field=value`` on the command line. Unknown keys are
errors at every layer, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import ipaddress
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import platformdirs
import yaml

from hivespec.protocol.errors import UserError

ENV_PREFIX = "HIVESPEC_"
MAX_STALENESS_S = 270.0  # protocol's clock window (300 s) less a margin for fetching and intake
HOME_ENV = "HIVESPEC_HOME"
MAX_FLOAT = 1e9  # the largest float key: seconds (31 years) that every wait, tripled or summed, still holds
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(UserError):
    """A configuration value or key is wrong; the message names the key and the fix."""


class InputError(UserError):
    """Something else the user typed (a flag, a file it names) is wrong; the message names it and the fix, on one line."""


@dataclass(frozen=True)
class Bounds:
    """A numeric field's range, declared next to the field: ``ge``/``gt`` below, ``le``/``lt`` above.

    ``note`` says what the edge values mean or why the bound is there; it is shown with the error
    and in ``hivespec config --keys``. ``None`` (a nullable field left unset) is always in range.
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    note: str = ""

    def holds(self, value: float) -> bool:
        return not (
            (self.ge is not None and value < self.ge) or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le) or (self.lt is not None and value >= self.lt)
        )

    def __str__(self) -> str:
        def num(x: float) -> str:
            return str(x) if isinstance(x, int) else f"{x:g}"

        low, high = (self.ge if self.ge is not None else self.gt), (self.le if self.le is not None else self.lt)
        if low is None or high is None:
            bound = f">= {num(self.ge)}" if self.ge is not None else f"> {num(self.gt)}" if self.gt is not None else (
                f"<= {num(self.le)}" if self.le is not None else f"< {num(self.lt)}")  # type: ignore[arg-type]
        elif isinstance(self.ge, int) and isinstance(self.le, int):
            bound = f"in {self.ge}..{self.le}"
        else:
            bound = f"in {'[' if self.ge is not None else '('}{num(low)}, {num(high)}{']' if self.le is not None else ')'}"
        return f"{bound} ({self.note})" if self.note else bound


def _help(
    text: str,
    default: Any = dataclasses.MISSING,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    note: str = "",
    **kwargs: Any,
) -> Any:
    """A dataclass field carrying its help text (shown by ``hivespec config``) and, for numbers, its range."""
    metadata: dict[str, Any] = {"help": text}
    if (ge, gt, le, lt) != (None, None, None, None):
        metadata["range"] = Bounds(ge, gt, le, lt, note)
    if default is dataclasses.MISSING:
        return field(metadata=metadata, **kwargs)
    return field(default=default, metadata=metadata)


class _Section:
    """A config section: `__post_init__` checks every declared range, then the section's own cross-field rules.

    ``SECTION`` is the dotted prefix its keys are named with in messages (``"train."``).
    """

    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            bounds = f.metadata.get("range")
            value = getattr(self, f.name)
            if bounds is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isinf(value):  # within most ranges, but a wait of inf overflows (Event.wait, Future.result)
                raise ConfigError(f"{self.SECTION}{f.name} must be a finite number {bounds}, got {value!r}")
            if isinstance(value, float) and abs(value) > MAX_FLOAT:  # so does one past the platform's ~9.2e9 s
                raise ConfigError(f"{self.SECTION}{f.name} must be {bounds} and at most {MAX_FLOAT:g} (a longer wait "
                                  f"overflows the platform's timers), got {value:g}")
            if math.isnan(value) or not bounds.holds(value):  # NaN is in no range
                raise ConfigError(f"{self.SECTION}{f.name} must be {bounds}, got {value!r}")
        self.check()

    def check(self) -> None:
        """Rules that tie several fields together (each field's own range is declared next to it)."""


@dataclass
class ModelConfig(_Section):
    SECTION: ClassVar[str] = "model."

    name: str = _help(
        "'smollm2-135m-instruct' (embedded GGUF), 'tiny' (random init, tests), a local HF folder, or a Hugging Face model id "
        "(e.g. Qwen/Qwen2.5-0.5B-Instruct: the HF cache first, else a download)", "smollm2-135m-instruct")
    revision: str | None = _help(
        "hub model ids: branch, tag or commit to load (null: the default branch, or what the cache holds); pin a commit "
        "for a swarm: the resolved commit is part of the model fingerprint", None)
    trust_remote_code: bool = _help(
        "run Python code shipped in the model's repo (needed by some architectures); off: only transformers' own code runs", False)
    engine_dtype: Literal["auto", "bfloat16", "float32", "float64"] = _help(
        "dtype of the rollout engine's weight copy; 'auto': bfloat16 where this device runs it faster (measured once "
        "per machine on CPU, bf16 support on CUDA), else float32", "auto")
    train_dtype: Literal["float32", "float64"] = _help("dtype of the trainer's master weights", "float32")
    autocast: bool | Literal["auto"] = _help(
        "bf16 autocast for trainer forwards (fp32 master weights keep small updates); 'auto': on where this device "
        "runs it faster (measured once per machine on CPU, bf16 support on CUDA)", "auto")
    attention: Literal["auto", "sdpa", "eager"] = _help(
        "attention kernel of engine and trainer: the model's 'eager' attention or torch's fused 'sdpa'; 'auto': on a CPU, "
        "eager for each role where it measures faster (once per machine; the trainer's only where a micro batch's attention "
        "probabilities fit 512 MiB), elsewhere the model's own", "auto")
    device: str = _help("torch device for engine and trainer", "cpu")
    threads: int | None = _help("torch threads per node; default: cores / local nodes", None, ge=1, note="or null")
    engine: Literal["native", "vllm"] = _help(
        "rollout engine: 'native' (torch, any device, lossless keyed speculative rollouts) or 'vllm' "
        "(CUDA only, pip install 'hivespec[gpu]'; vLLM's suffix/ngram speculative decoding)", "native")
    vllm_gpu_memory_utilization: float = _help(
        "model.engine vllm: share of GPU memory vLLM takes for weights and KV cache (the trainer needs the rest)", 0.5,
        gt=0, le=1)

    def check(self) -> None:
        if not self.device.strip():
            raise ConfigError("model.device is empty; set cpu, cuda or cuda:N")
        if self.engine == "vllm" and self.engine_dtype == "float64":
            raise ConfigError("model.engine vllm samples in bfloat16 or float32, got model.engine_dtype float64; "
                              "set model.engine_dtype: bfloat16 (or use model.engine: native)")


TASK_FAMILIES = ("arith", "count", "jsonl", "rg")


@dataclass
class TaskMix(_Section):
    SECTION: ClassVar[str] = "tasks.mix."

    family: str = _help("task family: 'arith', 'count', 'jsonl' or 'rg' (reasoning-gym: pip install 'hivespec[rg]')", "arith")
    difficulty: int = _help("difficulty knob of the family (arith 1..6, count 1..5; jsonl and rg: 1)", 1, ge=1)
    weight: float = _help("relative sampling weight", 1.0, gt=0)
    name: str | None = _help(
        "rg: the reasoning-gym dataset (e.g. leg_counting); jsonl: a .jsonl/.json/.parquet file or a Hugging Face "
        "dataset id (default: tasks.jsonl_path)", None)
    config: dict[str, Any] = _help("rg: the dataset's config (its fields, plus seed and size); peers must use the same",
                                   default_factory=dict)
    revision: str | None = _help("jsonl hub dataset: branch, tag or commit (null: the default branch or the cached one)", None)
    subset: str | None = _help("jsonl hub dataset: the subset (config) folder, e.g. 'main' for openai/gsm8k", None)
    split: str = _help("jsonl hub dataset: the split to read", "train")
    question_column: str = _help("jsonl: column holding the question", "question")
    answer_column: str = _help("jsonl: column holding the reference answer", "answer")
    answer_check: Literal["number", "math"] = _help(
        "jsonl: 'number' compares numbers; 'math' verifies with math-verify (GSM8K '#### N', MATH \\boxed{})", "number")

    def check(self) -> None:
        if self.family not in TASK_FAMILIES:
            raise ConfigError(f"unknown task family {self.family!r} in tasks.mix; use one of {', '.join(TASK_FAMILIES)}")
        if not isinstance(self.config, dict):
            raise ConfigError(f"tasks.mix config must be a mapping of the dataset's fields, got {self.config!r}")
        if self.config and self.family != "rg":
            raise ConfigError(f"tasks.mix config is for rg entries (reasoning-gym dataset fields), got one for {self.family}")
        if self.family == "rg" and not self.name:
            raise ConfigError("tasks.mix: an rg entry needs name: <reasoning-gym dataset>, e.g. {family: rg, name: leg_counting}")
        if self.family == "rg" and importlib.util.find_spec("reasoning_gym") is None:
            raise ConfigError(f"tasks.mix names reasoning-gym dataset {self.name!r} but reasoning-gym is not installed; "
                              "run: pip install 'hivespec[rg]'")


@dataclass
class TaskConfig(_Section):
    SECTION: ClassVar[str] = "tasks."

    mix: list[TaskMix] = _help("task families to draw prompts from", default_factory=lambda: [TaskMix("arith", 1), TaskMix("count", 1)])
    jsonl_path: str | None = _help("JSONL file of {question, answer} lines for the 'jsonl' family", None)
    heldout_fraction: float = _help(
        "share of questions (chosen by a hash of their text) never drawn for training, kept for held-out evaluation", 0.0,
        ge=0, lt=1)

    def check(self) -> None:
        if not self.mix:
            raise ConfigError("tasks.mix is empty; give at least one entry, e.g. [{family: arith, difficulty: 1}]")


@dataclass
class RolloutConfig(_Section):
    SECTION: ClassVar[str] = "rollout."

    prompts_per_round: int = _help("prompts this node draws each round", 4, ge=1)
    num_generations: int = _help("completions per prompt (the GRPO group size)", 4, ge=1)
    max_completion_length: int = _help("maximum new tokens per completion", 64, ge=1)
    temperature: float = _help("sampling temperature (0 = greedy)", 1.0, ge=0, note="0 = greedy")
    top_p: float = _help("nucleus sampling mass", 1.0, gt=0, le=1, note="1 = no nucleus cut")
    max_batch_size: int = _help("sequences decoded together", 16, ge=1)

    @property
    def decode_batch(self) -> int:
        """The engine's real decode batch: a round's sequences, at most ``max_batch_size``."""
        return min(self.prompts_per_round * self.num_generations, self.max_batch_size)


@dataclass
class TrainConfig(_Section):
    SECTION: ClassVar[str] = "train."

    learning_rate: float = _help("AdamW learning rate", 2e-5, gt=0)
    weight_decay: float = _help("AdamW weight decay", 0.0, ge=0)
    max_grad_norm: float = _help("gradient norm clip", 1.0, gt=0)
    tis_clip: float | None = _help(
        "truncated importance sampling cap C: weight = min(pi/mu, C) (slime --tis-clip, verl rollout_is_threshold); "
        "null: no truncation (needs tis_mask: token)", 2.0, ge=1, note="weights are truncated at C; or null")
    tis_mask: Literal["none", "token", "sequence"] = _help(
        "filter outside [tis_mask_low, tis_mask_high]: 'token' masks tokens by pi/mu (IcePop, verl rollout_rs=token), "
        "'sequence' masks whole sequences by their geometric-mean ratio (verl rollout_rs=geometric); masked tokens "
        "leave the loss and its denominator", "sequence")
    tis_mask_low: float = _help("lower ratio bound of tis_mask", 0.5, gt=0, le=1, note="the band must hold ratio 1")
    tis_mask_high: float = _help("upper ratio bound of tis_mask", 2.0, ge=1, note="the band must hold ratio 1")
    tis_veto: float | None = _help(
        "mask tokens whose behaviour probability is below this (slime/verl veto; 1e-4 is typical); null: off", None,
        gt=0, lt=1, note="a probability, or null")
    importance_sampling: bool = _help(
        "false trains on every sample as if on-policy (RL Swarm's behaviour; only for comparisons)", True)
    ppo_epochs: int = _help("optimizer steps per batch; > 1 reuses it with PPO clipping (verl ppo_epochs, TRL num_iterations)", 1,
                            ge=1)
    clip_epsilon: float = _help("PPO ratio clip: pi/pi_old kept in [1 - eps, 1 + eps] (TRL epsilon, verl clip_ratio)", 0.2,
                                gt=0, lt=1, note="0.2 is PPO's default")
    kl_coef: float = _help(
        "weight of a k3 KL penalty to each sample's behaviour policy (TRL beta, verl kl_loss_coef); 0: off", 0.0, ge=0)
    foreign_fraction: float = _help("at most this share of a step's samples come from peers", 0.5, ge=0, lt=1)
    staleness_seconds: float = _help(
        "use foreign rollouts at most this many seconds old (by the author's signed timestamp); nodes never share "
        "round numbers, so age is measured in seconds; at most 270 (envelopes signed over 300 s ago are refused as "
        "replays)", 240.0, gt=0, le=MAX_STALENESS_S, note="envelopes signed over 300 s ago are refused as replays")
    staleness_versions: int | None = _help(
        "use foreign rollouts whose author's policy version is at most this far from ours, either way; null: any. A "
        "version counts its node's own steps, so nodes drift apart by their speed and a newcomer is every step behind "
        "the veterans: a window parts them for good. The importance weights measure the policies' distance per token",
        None, ge=0, note="or null")
    micro_batch_size: int = _help("sequences per forward/backward", 8, ge=1)
    share_prompts: bool | Literal["auto"] = _help(
        "run a group's prompt once where 4 or more of its samples share a micro batch, their completions on its keys and "
        "values (the same log-probs); saves the prompt's tokens in every row but one for one more forward: 'auto': where "
        "that measures faster on this device (once per machine; 1.5x on a 2-core CPU, 0.6x on an H100 at 8 rows)", "auto")
    flat_sample_stats: bool = _help(
        "also run a forward over the samples that carry no gradient (a group whose rewards are all equal), only to add "
        "them to the importance statistics; costs a CPU node up to a tenth of its step where most groups are flat", False)

    def check(self) -> None:
        if self.tis_clip is None and self.tis_mask != "token":
            raise ConfigError("train.tis_clip: null leaves weights unbounded unless train.tis_mask is 'token'; set tis_clip: 2.0")


@dataclass
class PrivateSwarmConfig(_Section):
    SECTION: ClassVar[str] = "swarm.private."

    allowlist_file: str | None = _help(
        "private swarm: file of members' Ed25519 public keys (hex, one per line); set = private, the swarm name is its id", None)
    secret_file: str | None = _help("private swarm: file holding the 32-byte swarm secret as 64 hex digits (or $HIVESPEC_SWARM_SECRET)", None)


@dataclass
class SwarmConfig(_Section):
    SECTION: ClassVar[str] = "swarm."

    swarm: str = _help("swarm name; nodes only see records of the same swarm", "local")
    host: str = _help("address to listen on", "127.0.0.1")
    port: int = _help("TCP port (0 = any free port)", 0, ge=0, le=65535, note="0 = any free port")
    initial_peers: list[str] = _help("multiaddrs to bootstrap from (also: $HIVESPEC_INITIAL_PEERS, peers_file, the peer cache)", default_factory=list)
    peers_file: str | None = _help("file of bootstrap multiaddrs, one per line (# comments)", None)
    bootstrap_timeout: float = _help("seconds to retry bootstrap peers at start before running solo", 20.0, ge=0)
    rebootstrap_interval: float = _help("seconds between re-bootstraps (heals a split DHT; faster while solo)", 60.0, gt=0)
    require_peers: bool = _help("refuse to start when no bootstrap peer answers, instead of running solo", False)
    announce_maddrs: list[str] = _help("public multiaddrs to announce (port forwarding, a public IP behind 1:1 NAT)", default_factory=list)
    use_relay: bool = _help("libp2p circuit relay: reach peers behind NAT through relays", True)
    use_auto_relay: bool = _help(
        "behind NAT yourself: reserve relay slots on the bootstrap peers and announce <relay>/p2p-circuit addresses "
        "(the public preset's default; a node with a public IP or forwarded port sets false)", False)
    nat_port_map: bool = _help("ask the router for a port mapping (UPnP / NAT-PMP)", False)
    record_ttl: float = _help("seconds an index record lives in the DHT (validators refuse longer)", 600.0, gt=0)
    request_timeout: float = _help("seconds one DHT request or body download may take", 10.0, gt=0)
    start_timeout: float = _help("seconds p2pd and the DHT get to start", 30.0, gt=0)
    max_foreign_batches: int = _help(
        "K: peers' batches a step fetches at most, chosen among fresh announcements by peer score with exploration "
        "(bounds a node's download and verification work, whatever the swarm's size)", 4, ge=1)
    max_batches_per_peer: int = _help(
        "batches a step takes from one author at most while other authors have fresh ones (a few loud peers cannot "
        "crowd out the rest); slots of K that leaves empty go to authors' further batches, except in a step that waits "
        "for expected_peers (an author's second batch is the one its next step waits for)", 1, ge=1)
    index_bucket_s: float = _help(
        "seconds per index bucket: announcements are found by recency (the current and previous buckets' keys), "
        "never by round number", 30.0, gt=0)
    index_key_records: int = _help(
        "records one index key holds at most; a full key splits into two keys of the next level (by peer-id prefix), "
        "so a key's size is bounded whatever the swarm's size (a read brings a whole key back: 4 keeps the index "
        "a sixth of a node's bytes at 64 nodes, 16 made it a third)", 4, ge=1)
    announce_seconds: float = _help(
        "seconds a batch we serve (our own or relayed) stays announced in the current index bucket; match "
        "train.staleness_seconds", 240.0, gt=0)
    keep_seconds: float = _help("seconds our own and relayed bodies are kept to serve to peers", 600.0, gt=0)
    keep_bytes: int = _help("bytes of bodies kept to serve to peers at most", 256 * 2**20, ge=1)
    expected_peers: int = _help(
        "peers with a new batch a step waits for, at most round_timeout (0 = never wait: the public swarm's setting; "
        "a small swarm of equal nodes such as the demo may wait). Batches are matched by recency, never by round number", 0,
        ge=0, note="0 = never wait")
    round_timeout: float = _help("seconds a step waits at most for expected_peers' new batches", 120.0, gt=0)
    private: PrivateSwarmConfig = field(default_factory=PrivateSwarmConfig)

    def check(self) -> None:
        try:
            ipaddress.IPv4Address(self.host)
        except ValueError:
            raise ConfigError(
                f"swarm.host must be an IPv4 address to listen on (127.0.0.1 for this machine only, 0.0.0.0 for all), "
                f"got {self.host!r}"
            ) from None


DEFAULT_STATUS_PORT = 4483


@dataclass
class StatusConfig(_Section):
    SECTION: ClassVar[str] = "status."

    enabled: bool = _help("serve status JSON (/status) and Prometheus metrics (/metrics) for the dashboard", True)
    host: str = _help("loopback address of the status server: 127.0.0.1, ::1 or localhost", "127.0.0.1")
    port: int = _help("status server port (0 = any free port; the chosen URL goes to <home>/status.json)", DEFAULT_STATUS_PORT,
                      ge=0, le=65535, note="0 = any free port")

    def check(self) -> None:
        if self.host not in ("127.0.0.1", "::1", "localhost"):
            raise ConfigError(
                f"status.host must be a loopback address (127.0.0.1, ::1 or localhost), got {self.host!r}; "
                "/control can pause training, so reach a remote node's status through an SSH tunnel instead"
            )


@dataclass
class CheckpointConfig(_Section):
    SECTION: ClassVar[str] = "checkpoint."

    every_rounds: int = _help("save a checkpoint every N rounds (0 = only when the run ends or is stopped)", 10,
                              ge=0, note="0 = only at exit")
    keep: int = _help("complete checkpoints kept on disk, newest first (older ones are the fallback if the newest is torn)", 2,
                      ge=1, note="the previous checkpoint is the fallback")
    dir: str | None = _help("checkpoint directory (default: <home>/checkpoints)", None)
    at_exit: bool = _help("save a checkpoint when the run ends or is stopped (SIGINT/SIGTERM finish the round first)", True)
    resume: bool = _help("resume from the newest good checkpoint at start (--no-resume starts from the initial weights)", True)
    journal_hours: float | None = _help(
        "rollouts journaled (<home>/rollouts.sqlite) longer ago than this are deleted; the counts per peer stay. "
        "Nothing reads older rows: they are past every staleness window", 24.0, gt=0, note="or null: keep them all")

    def check(self) -> None:
        if self.dir is not None and not self.dir.strip():
            raise ConfigError("checkpoint.dir is empty; give a folder or null for <home>/checkpoints")

    def folder(self, home: Path) -> Path:
        """Where the checkpoints go: `dir` with ~ expanded, else <home>/checkpoints."""
        return Path(self.dir).expanduser() if self.dir else home / "checkpoints"


@dataclass
class EvalConfig(_Section):
    SECTION: ClassVar[str] = "eval."

    every_rounds: int = _help("greedy accuracy on held-out questions every N rounds (0 = off; `hivespec eval`'s questions "
                              "and scoring, node/heldout_probe.py)", 0, ge=0, note="0 = off")
    questions: int = _help("held-out questions each evaluation scores (the same ones every time)", 16, ge=1, le=4096)
    max_new_tokens: int = _help("longest greedy completion per held-out question", 48, ge=1, le=65536)
    seed: int = _help("which held-out questions (TaskSource.heldout's seed)", 0, ge=0, le=2**63 - 1)


@dataclass
class SuperviseConfig(_Section):
    SECTION: ClassVar[str] = "supervise."

    stall_after: float = _help("seconds without progress before the watchdog reports a loop as stalled", 600.0, gt=0)
    gossip_probe_every: float = _help("seconds between liveness probes of gossip (p2pd and its event loop)", 15.0, gt=0)

    # Gossip is heard from only when a probe passes: at most every gossip_probe_every, plus the watchdog's 5-s check
    # period and a probe's 5-s timeout. A shorter stall_after reported a healthy gossip stalled, stacks and all, each time.
    PROBE_SLACK_S: ClassVar[float] = 10.0

    def check(self) -> None:
        if self.stall_after <= self.gossip_probe_every + self.PROBE_SLACK_S:
            raise ConfigError(
                f"supervise.stall_after ({self.stall_after:g} s) must be more than supervise.gossip_probe_every "
                f"({self.gossip_probe_every:g} s) + {self.PROBE_SLACK_S:g} s: gossip is heard from only at each probe, so it "
                "would be reported stalled between any two; raise stall_after or lower gossip_probe_every"
            )


@dataclass
class SpeculationConfig(_Section):
    SECTION: ClassVar[str] = "speculation."

    enabled: bool = _help("lossless speculative rollouts (suffix-automaton drafter); the calibrated policy still turns it off where it cannot pay", True)
    num_speculative_tokens: int = _help("most draft tokens per sequence per step (long prompts get all, medium half, short a quarter)", 16,
                                        ge=1)
    min_prob: float = _help("stop a draft where its empirical probability falls below this", 0.1, ge=0, le=1)
    spec_factor: float = _help("a draft is at most this many times the length of the suffix it matched", 2.0, gt=0)
    window: int = _help("recent rollouts per prompt the drafter indexes", 16, ge=1)
    global_max_tokens: int = _help("tokens of recent rollouts (all prompts) in the drafter's global index", 32768, ge=1)
    max_prompts: int = _help("prompts the drafter keeps windows for (least recently used evicted)", 1024, ge=1)
    rebuild_rollouts: int = _help("stored rollouts replayed into the drafter at start-up (0 = start empty)", 2048,
                                  ge=0, note="0 = start empty")
    trace_file: str | None = _help(
        "append a rollout trace (JSON lines, .gz for gzip: own and accepted foreign rollouts in the order the drafter is fed) "
        "for bench/drafter_replay.py; recorded whether speculation is on or off (null: no trace)", None
    )

    def check(self) -> None:
        if self.trace_file is not None and not self.trace_file.strip():
            raise ConfigError("speculation.trace_file is empty; give a file path or null for no trace")


@dataclass
class SyncConfig(_Section):
    SECTION: ClassVar[str] = "sync."

    publish: bool = _help("act as a leader: publish each step's weight delta, periodic snapshots and the head for followers", False)
    snapshot_every: int = _help("a leader publishes the cumulative delta from the base checkpoint every this many versions", 8, ge=1)
    max_lag: int = _help("a follower more than this many versions behind jumps to the latest snapshot", 16, ge=0)
    poll_interval: float = _help("seconds between a follower's polls of its leader's head", 2.0, gt=0)
    fetch_timeout: float = _help("seconds a follower waits for one delta chunk", 10.0, gt=0)
    leader_timeout: float = _help(
        "seconds a follower waits for its leader's first head before it gives up (a wrong peer id, a leader not "
        "publishing, no shared bootstrap peer)", 300.0, gt=0)


@dataclass
class NodeConfig(_Section):
    name: str | None = _help("display name (default: derived from the identity key)", None)
    home: str | None = _help("data directory for identity, store and logs (default: user data dir)", None)
    seed: int | None = _help("seed for prompts and sampling (null: derived from the identity)", None,
                             ge=0, le=2**63 - 1, note="or null")
    rounds: int = _help("rounds to run (0 = forever)", 5, ge=0, note="0 = forever")
    model: ModelConfig = field(default_factory=ModelConfig)
    tasks: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    status: StatusConfig = field(default_factory=StatusConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    supervise: SuperviseConfig = field(default_factory=SuperviseConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    report_to: list[str] = _help("trackers that get each round's figures: tensorboard (<home>/tensorboard), wandb "
                                 "(<home>/wandb; WANDB_MODE=offline works); empty = none (pip install hivespec[trackers])",
                                 dataclasses.MISSING, default_factory=list)

    def check(self) -> None:
        unknown = [name for name in self.report_to if name not in TRACKERS]
        if unknown:
            raise ConfigError(f"report_to names {unknown}; the trackers are {list(TRACKERS)} (or [] for none)")
        train, rollout = self.train, self.rollout
        # The trainer's policy is the whole tempered distribution and the engine samples its nucleus: an own token's
        # weight is the mass of the nucleus it was drawn from, at least top_p. Under tis_mask_low it is masked.
        if train.importance_sampling and train.tis_mask != "none" and rollout.temperature > 0 and rollout.top_p < train.tis_mask_low:
            raise ConfigError(
                f"rollout.top_p {rollout.top_p:g} is under train.tis_mask_low {train.tis_mask_low:g}: an own sample's "
                "importance weight is the mass of the nucleus it was drawn from (at least top_p), so the mask would drop "
                f"own samples; set rollout.top_p >= {train.tis_mask_low:g} or lower train.tis_mask_low")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


TRACKERS = ("tensorboard", "wandb")  # report_to's names (node/trackers.py)


def default_home() -> Path:
    """The data directory when the config names none: ``$HIVESPEC_HOME``, else the user data dir."""
    if os.environ.get(HOME_ENV):
        return Path(os.environ[HOME_ENV]).expanduser()
    return Path(platformdirs.user_data_dir("hivespec"))


def node_home(config: NodeConfig) -> Path:
    """The node's data directory: ``config.home``, else ``default_home()``."""
    return Path(config.home).expanduser() if config.home else default_home()


def preset_path(name: str) -> Path:
    """Path of a bundled preset (``demo`` -> ``configs/demo.yaml``); a path with a suffix is used as is."""
    candidate = Path(name)
    if candidate.suffix in (".yaml", ".yml"):
        return candidate
    return CONFIG_DIR / f"{name}.yaml"


def load_config(
    path: str | Path | None = None,
    *,
    overrides: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> NodeConfig:
    """Build a NodeConfig from defaults, a YAML file, HIVESPEC_* env vars and dotted overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        file = preset_path(str(path))
        if not file.is_file():
            raise ConfigError(f"config file {file} not found; presets: {sorted(p.stem for p in CONFIG_DIR.glob('*.yaml'))}")
        try:
            loaded = yaml.safe_load(file.read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"config file {file}: cannot read it ({exc.strerror}); fix its permissions or pass another --config") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {file} is not valid YAML ({_yaml_problem(exc)}); fix that line") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{file}: the top level must be a mapping, got {type(loaded).__name__}")
        data = loaded
    env = os.environ if environ is None else environ
    for key, raw in env.items():
        if key.startswith(ENV_PREFIX) and "__" in key:
            dotted = key[len(ENV_PREFIX):].lower().replace("__", ".")
            _set_dotted(data, dotted, _yaml_value(raw, f"env {key}"), source=f"env {key}")
    for dotted, raw in (overrides or {}).items():
        _set_dotted(data, dotted, _yaml_value(raw, f"--set {dotted}"), source=f"--set {dotted}")
    return _build(NodeConfig, data, "")


@dataclass(frozen=True)
class _Typed:
    """A --set or env value: the text as typed and what YAML reads it as. A text key takes the text (`_coerce`)."""

    text: str
    value: Any

    def for_key(self, takes_text: bool) -> Any:
        """The text, stripped, for a key that takes text where YAML reads it as another scalar or cuts it (0420 is 272,
        1.10 is 1.1, yes is true, 'run #2' is 'run': a comment); else, and for quoted text, null and lists, the YAML."""
        text = self.text.strip()
        if takes_text and not isinstance(self.value, (list, dict, type(None))) and text[:1] not in ("'", '"'):
            return text
        return self.value


def _yaml_value(raw: str, source: str) -> _Typed:
    """A --set or env value read as YAML (so numbers, booleans and lists keep their type), its text kept."""
    try:
        return _Typed(raw, yaml.safe_load(raw))
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"{source}={raw!r} is not a valid value ({_yaml_problem(exc)}); quote text with brackets or colons, "
            "e.g. --set 'key=\"a: b\"'"
        ) from None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(problem)


def parse_override(text: str) -> tuple[str, str]:
    """Split ``section.field=value`` as given to ``--set``."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set expects section.field=value, got {text!r}")
    return key.strip(), value


def _set_dotted(data: dict[str, Any], dotted: str, value: Any, *, source: str) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def _build(cls: type, data: Any, prefix: str) -> Any:
    if isinstance(data, _Typed):
        data = data.value
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = prefix.rstrip(".") or "top level"
        raise ConfigError(f"unknown config key(s) {unknown} in {where}; valid keys: {sorted(fields)}")
    kwargs = {name: _coerce(hints[name], value, f"{prefix}{name}") for name, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{prefix or 'config'}: {exc}") from None


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if isinstance(value, _Typed):
        value = value.for_key(hint is str or (origin in (typing.Union, types.UnionType) and str in args))
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(inner[0], value, key)
        errors = []
        for alternative in inner:  # the first alternative that takes the value wins
            try:
                return _coerce(alternative, value, key)
            except ConfigError as exc:
                errors.append(str(exc).removeprefix(f"{key} "))
        raise ConfigError(f"{key}: {value!r} fits none of its forms: " + "; ".join(errors))
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key} must be one of {list(args)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_coerce(args[0], item, f"{key}[{i}]") for i, item in enumerate(value)]
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key} must be a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return str(value)
    return value


def describe(cls: type = NodeConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every field: the documented flag list; a number's range ends its help."""
    rows = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            rows.extend(describe(hint, f"{prefix}{f.name}."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        bounds = f.metadata.get("range")
        text = f.metadata.get("help", "") + (f" [{bounds}]" if bounds is not None else "")
        rows.append((f"{prefix}{f.name}", repr(default), text))
    return rows
