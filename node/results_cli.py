"""The commands for what a run leaves behind: ``hivespec export`` (a model folder), ``report`` (plots), ``eval`` (held-out accuracy).

`add_result_commands(sub)` adds their parsers to the ``hivespec`` command line (node/cli.py calls
it once). Like the rest of the CLI, nothing heavy is imported until a command runs, and every
input a user can fix ends in `InputError` (one line, exit 2, printed by `cli.main`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def cmd_export(args: argparse.Namespace) -> int:
    from hivespec.node.config import InputError, default_home
    from hivespec.node.export import check_out, checkpoint_policy, export_policy, find_policy, push_export

    if args.home and args.checkpoint:
        raise InputError("pass --home (a node's latest policy) or --checkpoint (one checkpoint), not both")
    if args.revision and not args.model:
        raise InputError("--revision goes with --model (the base a bare checkpoint was trained from); a recorded policy "
                         "loads the revision its node ran, so leave --revision out")
    if args.private and not args.push_to_hub:
        raise InputError("--private goes with --push-to-hub OWNER/NAME (the repo it creates); alone it does nothing")
    if args.push_to_hub:  # before minutes of export, not after: the repo id, a token, online
        from hivespec.node.hub import check_upload

        check_upload(args.push_to_hub)
    out = Path(args.out).expanduser()
    check_out(out)  # before the policy is found and verified
    if args.checkpoint:
        source = checkpoint_policy(Path(args.checkpoint).expanduser())
    else:
        source = find_policy(Path(args.home).expanduser() if args.home else default_home())
    record = source.record
    print(f"exporting policy version {record.policy_version} ({record.rounds} rounds) of "
          f"{record.node or 'an unrecorded node'} from {source.origin} ...", flush=True)
    result = export_policy(source, out, dtype=args.dtype, model=args.model, revision=args.revision,
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


def _eval_tasks(args: argparse.Namespace, record):
    """The task source whose held-out questions are asked: --config's mix, else the one the policy trained with."""
    import json

    from hivespec.node.config import InputError, load_config
    from hivespec.node.tasks.source import TaskSource

    overrides = {}
    if not args.config and record is not None and any(e.get("family") == "jsonl" and not e.get("name") for e in record.tasks):
        # The entry read tasks.jsonl_path, a file the record does not name (tasks.mix's own error would say to set it).
        raise InputError("the policy trained on a jsonl task file given as tasks.jsonl_path, which its record does not "
                         "name; pass --config with the config it trained with (its tasks.jsonl_path and tasks.mix)")
    if not args.config and record is not None and record.tasks:
        overrides = {"tasks.mix": json.dumps(record.tasks), "tasks.heldout_fraction": str(record.heldout_fraction)}
    if args.heldout_fraction is not None:
        overrides["tasks.heldout_fraction"] = str(args.heldout_fraction)
    if not args.config and not overrides.get("tasks.mix"):
        raise InputError("the model records no task mix; pass --config with the preset it trained on (e.g. demo)")
    tasks = load_config(args.config, overrides=overrides).tasks
    if tasks.heldout_fraction <= 0:
        raise InputError("the task mix has tasks.heldout_fraction 0: no question is held out of training. Train with "
                         "--set tasks.heldout_fraction=0.25 (the demo preset does), or pass --heldout-fraction to ask the "
                         "questions that split would hold out (the policy may then have trained on them)")
    return TaskSource.from_config(tasks), tasks


def _model_folder(folder: Path) -> Path:
    """``folder`` where it holds a model; an `InputError` naming what is missing before any model is loaded and scored."""
    from hivespec.node.config import InputError

    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise InputError(f"--model {folder} {what}; pass the folder `hivespec export --out` wrote")
    if not (folder / "config.json").is_file():
        raise InputError(f"--model {folder} has no config.json; pass the folder `hivespec export --out` wrote")
    return folder


def cmd_eval(args: argparse.Namespace) -> int:
    import gc
    import json

    import torch

    from hivespec.node.config import InputError, default_home
    from hivespec.node.evaluate import EvalSettings, fitting_questions, format_table, score_model, to_json
    from hivespec.node.export import EVAL_ADVICE, EXPORT_RECORD, find_policy, load_policy_model, read_export_record
    from hivespec.node.latest_policy import file_sha256
    from hivespec.node.model.device import check_device
    from hivespec.node.model.loader import (
        ModelSourceError,
        configure_threads,
        load_model,
        load_model_config,
        load_tokenizer,
        model_fingerprint,
    )

    configure_threads()
    if args.home and args.model:
        raise InputError("pass --home (a node's latest policy) or --model (an exported folder), not both")
    device = check_device(args.device, setting="--device", on_cpu="pass --device cpu")
    if args.model:
        folder = _model_folder(Path(args.model).expanduser())
        record = read_export_record(folder)
        trained_name = str(folder)
        if record is not None and record.weights and (folder / record.weights).is_file() \
                and file_sha256(folder / record.weights) != record.weights_sha256:
            # Not refused: a user may have changed the folder's weights on purpose (trained it further in place).
            print(f"note: --model {folder}: {record.weights} is not the file hivespec export wrote (its sha256 differs "
                  f"from {EXPORT_RECORD}'s): scoring the weights as they are; if you did not change them, export again",
                  file=sys.stderr, flush=True)

        def load_trained():
            try:
                return load_model(str(folder)), load_tokenizer(str(folder))
            except (ModelSourceError, OSError) as exc:  # a config.json without whole weights or tokenizer files beside it
                reason = " ".join(str(exc).removeprefix(f"cannot load model {str(folder)!r}: ").split())
                raise InputError(f"cannot load --model {folder}: {reason[:240]}; pass the folder `hivespec export --out` "
                                 "wrote") from None
    else:
        home = Path(args.home).expanduser() if args.home else default_home()
        source = find_policy(home, EVAL_ADVICE)
        record = source.record if source.recorded else None
        trained_name = f"{home}, policy version {source.record.policy_version}"

        def load_trained():
            model, tokenizer, _ = load_policy_model(source, model=None if source.recorded else args.base, advice=EVAL_ADVICE)
            return model.float(), tokenizer
    base_name = args.base or (record.model if record is not None else None)
    if not base_name:
        raise InputError("the model records no base model; pass --base (e.g. smollm2-135m-instruct)")
    base_revision = args.revision or (record.commit or record.revision if record is not None and base_name == record.model else None)
    source_tasks, task_config = _eval_tasks(args, record)
    settings = EvalSettings(questions=args.n, samples=args.samples, temperature=args.temperature,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    try:
        questions = source_tasks.heldout(seed=settings.seed, count=settings.questions)
    except ValueError as exc:
        raise InputError(f"{exc}; ask fewer questions with --n") from None
    # Everything that can refuse is checked before any scoring (minutes on a CPU): the base's config and tokenizer
    # (no weights), then the trained model, loaded and verified (weights sha256, fingerprint). The trained model is
    # scored first, so only one model is in memory at a time; keyed sampling makes the order irrelevant to the scores.
    base_tokenizer = load_tokenizer(base_name, revision=base_revision)
    # Architecture and tokenizer, not the hub commit: --base/--revision may name another revision on purpose.
    base_fingerprint = model_fingerprint(load_model_config(base_name, revision=base_revision), base_tokenizer, with_revision=False)
    trained, tokenizer = load_trained()
    fingerprint = model_fingerprint(trained.config, tokenizer, with_revision=False)
    if fingerprint != base_fingerprint:
        raise InputError(f"{trained_name} has model fingerprint {fingerprint}, the base {base_name} {base_fingerprint}: "
                         "they are not the same architecture and tokenizer; pass the base it was trained from with --base")
    positions = getattr(trained.config, "max_position_embeddings", None)
    questions, skipped = fitting_questions(source_tasks, tokenizer, questions, settings.max_new_tokens, positions)
    too_long = (f"too long for the model's {positions} positions with --max-new-tokens {settings.max_new_tokens} (a "
                "training round skips them too)")
    if not questions:
        raise InputError(f"every one of the {len(skipped)} held-out questions is {too_long}: nothing to score; lower "
                         "--max-new-tokens, or ask other questions with --seed or --config")
    if skipped:
        print(f"skipped {len(skipped)} of {len(questions) + len(skipped)} held-out questions, {too_long}: "
              f"{', '.join(t.prompt_id for t in skipped[:5])}{' ...' if len(skipped) > 5 else ''}",
              file=sys.stderr if args.json else sys.stdout, flush=True)
    dtype = getattr(torch, args.dtype)

    def score(label: str, name: str, model, tokenizer):
        if not args.json:
            print(f"scoring {label} ({name}) on {len(questions)} held-out questions ...", flush=True)

        def say(line: str) -> None:
            print(f"  {label}, {line}", file=sys.stderr if args.json else sys.stdout, flush=True)  # --json: stdout is the JSON

        return score_model(model.to(device=device, dtype=dtype), tokenizer, source_tasks, questions, settings, label=label, name=name, on_progress=say)

    trained_scores = score("trained", trained_name, trained, tokenizer)
    del trained
    gc.collect()
    rows = [score("base", base_name, load_model(base_name, revision=base_revision), base_tokenizer), trained_scores]
    mix = ", ".join(f"{m.family}:d{m.difficulty}" + (f":{m.name}" if m.name else "") for m in task_config.mix)
    if args.json:
        print(json.dumps(to_json(rows, settings, questions, skipped), indent=1))
    else:
        print(format_table(rows, settings, f"held-out accuracy on {len(questions)} questions of {mix} (held-out share "
                           f"{task_config.heldout_fraction:g}, question seed {settings.seed}), {args.dtype}, at most "
                           f"{settings.max_new_tokens} new tokens"
                           + (f"; {len(skipped)} more skipped, too long for the model" if skipped else "")))
    return 0


def add_result_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``export``, ``report`` and ``eval`` to the ``hivespec`` subcommands."""
    from hivespec.node.cli_numbers import number

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

    evaluate = sub.add_parser("eval", help="held-out accuracy (greedy, pass@k) of the base model and a trained policy, side by side")
    evaluate.add_argument("--home", help="evaluate this node's latest policy (default $HIVESPEC_HOME or the user data dir)")
    evaluate.add_argument("--model", metavar="DIR", help="evaluate an exported folder (hivespec export) instead")
    evaluate.add_argument("--base", help="the base model to compare with (default: the one the policy was trained from)")
    evaluate.add_argument("--revision", help="the base model's hub revision (default: the one the policy recorded)")
    evaluate.add_argument("--config", help="a preset whose task mix is asked (default: the mix the policy trained with)")
    evaluate.add_argument("--heldout-fraction", type=float, help="the held-out share of questions (default: the mix's)")
    evaluate.add_argument("--n", type=number(int, low=1), default=32, help="held-out questions (default 32)")
    evaluate.add_argument("--samples", type=number(int, low=0), default=8, help="sampled completions per question for pass@k (default 8; 0: greedy only)")
    evaluate.add_argument("--temperature", type=number(float, low=0), default=1.0, help="sampling temperature of the pass@k completions (default 1.0)")
    evaluate.add_argument("--max-new-tokens", type=number(int, low=1), default=48, help="most new tokens per completion (default 48, the demo's)")
    evaluate.add_argument("--seed", type=number(int, low=0), default=0, help="which held-out questions (default 0)")
    evaluate.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights' dtype while generating")
    evaluate.add_argument("--device", default="cpu", help="where the models generate: cpu, cuda or cuda:N (default cpu)")
    evaluate.add_argument("--json", action="store_true", help="print every metric, and the per-question scores, as JSON")
    evaluate.set_defaults(func=cmd_eval)
