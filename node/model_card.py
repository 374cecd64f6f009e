"""The exported policy's model card: ``README.md`` with Hugging Face Hub metadata and its provenance.

`render_model_card(CardFacts)` is a pure function. The YAML front matter is the Hub's model
card metadata (``library_name``, ``pipeline_tag``, ``base_model`` and ``base_model_relation``
where the base is a Hub repo, ``license`` where it is known, ``tags``); the body states where the
policy came from: the base model and its revision (or the embedded model's package and version),
the policy version and weights hashes, rounds and steps trained, the task mix and sampling
settings, the swarm, and the peers whose signed rollouts it accepted and trained on, with counts.
What the node did not record is written as "not recorded", never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from hivespec.node.credits import Credits
from hivespec.node.latest_policy import PolicyRecord

TAGS = ["hivespec", "reinforcement-learning", "grpo", "swarm-training"]


@dataclass(frozen=True)
class BaseModel:
    """The model training started from, as a card states it."""

    name: str  # model.name as configured
    description: str  # one sentence for people: what the starting weights were
    hub_id: str | None = None  # the Hub repo the weights derive from (front matter base_model)
    commit: str | None = None  # the Hub commit loaded
    license: str | None = None  # the base model's license, where known
    revision_note: str = ""  # what stands for a revision when there is no Hub commit (e.g. a package version)


@dataclass(frozen=True)
class WeightFile:
    name: str
    sha256: str
    bytes: int


@dataclass(frozen=True)
class CardFacts:
    base: BaseModel
    policy: PolicyRecord  # fields the node did not record are empty strings
    origin: str  # where export read the weights: the node's latest-policy record or a checkpoint
    dtype: str
    files: list[WeightFile]
    credits: Credits
    hivespec_version: str
    exported_at: str  # UTC, ISO 8601


def front_matter(facts: CardFacts) -> dict[str, Any]:
    meta: dict[str, Any] = {"library_name": "transformers", "pipeline_tag": "text-generation"}
    if facts.base.hub_id:
        meta["base_model"] = facts.base.hub_id
        meta["base_model_relation"] = "finetune"
    if facts.base.license:
        meta["license"] = facts.base.license
    meta["tags"] = list(TAGS)
    return meta


def _or_unknown(value: Any) -> str:
    return "not recorded" if value in (None, "") else str(value)


def _value(value: Any) -> str:
    """A setting as the YAML config spells it (true, null), not as Python prints it."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip() if value is None or isinstance(value, bool) else str(value)


def _code(value: Any) -> str:
    return "not recorded" if value in (None, "") else f"`{value}`"


def _task_rows(tasks: list[dict[str, Any]]) -> list[str]:
    rows = ["| family | difficulty | weight | source |", "|---|---|---|---|"]
    for entry in tasks:
        source = entry.get("name") or "procedural (regenerated from the prompt id)"
        rows.append(f"| {entry.get('family')} | {entry.get('difficulty')} | {entry.get('weight')} | {source} |")
    return rows


def _credit_rows(credits: Credits) -> list[str]:
    if not credits.journal:
        return ["The node's rollout journal was not available: contributors are not recorded."]
    if not credits.peers:
        return ["No peer's rollouts were accepted: this policy trained on its own rollouts only."]
    trained_known = credits.own_trained is not None
    rows = [
        f"{len(credits.peers)} peer(s) contributed signed rollouts. *Accepted* counts rollouts that passed this node's intake "
        "(Ed25519 signature, schema, model fingerprint, staleness, reward re-computed by this node's verifier) and were "
        "journaled; *trained on* counts the samples of that peer that carried a gradient in this node's training steps"
        + ("." if trained_known else " (not recorded: the node kept no events log)."),
        "",
        "| peer id | rollouts accepted | samples trained on |",
        "|---|---:|---:|",
    ]
    rows += [f"| `{p.peer_id}` | {p.accepted} | {_or_unknown(p.trained)} |" for p in credits.peers]
    rows += ["", f"Own rollouts journaled: {credits.own_rollouts}; own samples trained on: {_or_unknown(credits.own_trained)}."]
    return rows


def render_model_card(facts: CardFacts) -> str:
    """The README.md text: Hub metadata front matter, then provenance, training, contributors and usage."""
    policy, base = facts.policy, facts.base
    title = f"{policy.node} policy" if policy.node else "hivespec policy"
    swarm = f" in swarm `{policy.swarm}`" if policy.swarm else ""
    weights = "; ".join(f"`{f.name}` ({f.bytes / 1e6:.1f} MB) sha256 `{f.sha256}`" for f in facts.files)
    master = policy.train_dtype or "float32"
    cast = f"the trainer's {master} master weights" if facts.dtype == master else f"cast from the trainer's {master} master weights"
    rollout, train = policy.rollout, policy.train
    lines = [
        "---",
        yaml.safe_dump(front_matter(facts), sort_keys=False).rstrip(),
        "---",
        "",
        f"# {title}",
        "",
        (f"A policy trained with GRPO by a hivespec swarm node{swarm}, on its own rollouts and on "
         "the signed rollouts of its peers, with filtered truncated importance weights for the peers' samples."),
        "",
        "## Provenance",
        "",
        "| | |",
        "|---|---|",
        f"| base model | {base.description} |",
        f"| base model revision | {_code(base.commit) if base.commit else (base.revision_note or 'not recorded')} |",
        f"| node | {_or_unknown(policy.node)} (peer id {_code(policy.peer_id)}) |",
        f"| swarm | {_code(policy.swarm)} |",
        f"| policy version | {policy.policy_version} (optimizer steps taken) |",
        f"| rounds run | {_or_unknown(policy.rounds)} |",
        (f"| policy hash | {_code(policy.policy_hash)} (hivespec state hash of the node's engine weights after its last sync, as its "
         "round events and followers report it) |"),
        f"| model fingerprint | {_code(policy.fingerprint)} (architecture and tokenizer; peers with another one are refused) |",
        f"| weights | {weights}; {facts.dtype}, {cast} |",
        f"| exported from | {facts.origin} |",
        f"| exported | {facts.exported_at} with hivespec {facts.hivespec_version} |",
        "",
        "## Training",
        "",
        *(_task_rows(policy.tasks) if policy.tasks else ["Task mix: not recorded."]),
        "",
        f"Held-out share of questions (never trained on): {policy.heldout_fraction}." if policy.tasks else "",
        "Rollouts: " + (", ".join(f"{key} {rollout[key]}" for key in (
            "prompts_per_round", "num_generations", "max_completion_length", "temperature", "top_p") if key in rollout)
            or "not recorded") + ".",
        "Training: " + (", ".join(f"{key} {_value(value)}" for key, value in train.items()) or "not recorded") + ".",
        "",
        "## Contributors",
        "",
        *_credit_rows(facts.credits),
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")',
        'tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")',
        "```",
        "",
        "Join a swarm with it as the starting policy: `hivespec join --model path/to/this/folder`.",
        "",
    ]
    return "\n".join(lines)
