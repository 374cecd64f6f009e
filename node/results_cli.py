"""The commands for what a run leaves behind: ``hivespec export`` (a model folder) and ``hivespec report`` (plots).

`add_result_commands(sub)` adds their parsers to the ``hivespec`` command line (node/cli.py calls
it once). Like the rest of the CLI, nothing heavy is imported until a command runs, and every
input a user can fix ends in `InputError` (one line, exit 2, printed by `cli.main`).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_export(args: argparse.Namespace) -> int:
    from hivespec.node.config import InputError, default_home
    from hivespec.node.export import checkpoint_policy, export_policy, find_policy, push_export

    if args.home and args.checkpoint:
        raise InputError("pass --home (a node's latest policy) or --checkpoint (one checkpoint), not both")
    if args.checkpoint:
        source = checkpoint_policy(Path(args.checkpoint).expanduser())
    else:
        source = find_policy(Path(args.home).expanduser() if args.home else default_home())
    record = source.record
    print(f"exporting policy version {record.policy_version} ({record.rounds} rounds) of "
          f"{record.node or 'an unrecorded node'} from {source.origin} ...", flush=True)
    result = export_policy(source, Path(args.out).expanduser(), dtype=args.dtype, model=args.model, revision=args.revision,
                           trust_remote_code=args.trust_remote_code)
    card = result.card
    print(f"exported to {result.out}/: {', '.join(p.name for p in result.files)}")
    for weights in card.files:
        print(f"  {weights.name}: {weights.bytes / 1e6:.1f} MB, sha256 {weights.sha256}")
    credits = card.credits
    if credits.peers:
        print(f"  credits {len(credits.peers)} peer(s) for {credits.foreign_accepted} accepted rollouts (README.md)")
    print(f"load it: AutoModelForCausalLM.from_pretrained({str(result.out)!r}), or hivespec join --model {result.out}")
    if args.push_to_hub:
        url = push_export(result.out, args.push_to_hub, private=args.private, card=card)
        print(f"uploaded to https://huggingface.co/{args.push_to_hub}: {url}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from hivespec.node.run_report import write_report

    run_dir = Path(args.run_dir).expanduser()
    written = write_report(run_dir, Path(args.out).expanduser() if args.out else None)
    print(f"report of {run_dir}: {written[-1]}")
    for path in written[:-1]:
        print(f"  {path}")
    return 0


def add_result_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``export`` and ``report`` to the ``hivespec`` subcommands."""
    export = sub.add_parser("export", help="write a node's trained policy as a Hugging Face model folder with a model card")
    export.add_argument("--home", help="the node's data directory: its latest policy (default $HIVESPEC_HOME or the user data dir)")
    export.add_argument("--checkpoint", metavar="DIR", help="export this checkpoint (a ckpt-NNNNNN folder, or a folder of them: the newest)")
    export.add_argument("--out", required=True, metavar="DIR", help="the folder to write (new, or empty)")
    export.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="weight dtype of the folder (default float32: the trainer's master weights exactly)")
    export.add_argument("--model", help="the base model a bare checkpoint was trained from (model.name), when its home keeps no record")
    export.add_argument("--revision", help="with --model: the hub revision the node loaded")
    export.add_argument("--trust-remote-code", action="store_true", help="load a base model that needs its repo's code")
    export.add_argument("--push-to-hub", metavar="REPO", help="then upload the folder to this Hub model repo (owner/name; needs a token)")
    export.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    export.set_defaults(func=cmd_export)

    report = sub.add_parser("report", help="plot a run's rounds (reward, foreign samples and weights, phase times) and summarize it")
    report.add_argument("run_dir", metavar="RUN_DIR", help="a demo run directory (node-<i>/events.jsonl), or a folder of events logs")
    report.add_argument("--out", metavar="DIR", help="where to write the PNGs and summary.md (default RUN_DIR/report)")
    report.set_defaults(func=cmd_report)
