"""``python -m rlkl_lightning.world``: build a world, from your texts or the default one.

    python -m rlkl_lightning.world --texts reviews.csv [--out DIR] [--seed N] [...]
    python -m rlkl_lightning.world          # the default world (built on first use anyway)

Prints the world's directory and the command that runs the study on it. Every option of
:class:`~rlkl_lightning.world.config.CustomWorldConfig` is a flag (``--help`` lists them).
"""

from __future__ import annotations

import json
import shlex
import sys
from typing import Any

from rlkl_lightning.world.config import CustomWorldConfig


def parse_args(argv: list[str] | None = None) -> dict[str, Any]:
    """The command line: ``texts``, ``out``, ``threads``, ``quiet``, ``world`` (a dict).

    ``world`` holds the :class:`~rlkl_lightning.world.config.CustomWorldConfig` fields.
    """
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(
        exit_on_error=False,  # main prints the message alone, without the usage dump
        prog="python -m rlkl_lightning.world",
        description=(
            "Build a world (tokenizer, SFT reference model, prompts, validation and held-out "
            "splits) from your texts, or the default world when no --texts are given."
        ),
    )
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML of the options")
    parser.add_argument(
        "--texts",
        type=str,
        nargs="+",
        default=None,
        help=".txt, .csv, .tsv, .json, .jsonl or .parquet files, or directories of them or "
        "written by datasets' save_to_disk",
    )
    parser.add_argument(
        "--out", type=str | None, default=None, help="the world's directory (default: the cache)"
    )
    parser.add_argument(
        "--threads", type=int | None, default=None, help="torch threads for SFT (default: all)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress messages")
    parser.add_class_arguments(CustomWorldConfig, as_group=True)
    args = parser.parse_args(argv).as_dict()
    args.pop("config", None)
    args["world"] = {name: args.pop(name) for name in CustomWorldConfig.__dataclass_fields__}
    return args


def main(argv: list[str] | None = None):
    """Build the world and print where it is; returns the ``World``.

    A bad option or input ends with ``error: MESSAGE`` alone and exit status 1; Ctrl-C with
    the builder's line saying what was kept, and status 130.
    """
    try:
        return _main(argv)
    except KeyboardInterrupt:
        raise SystemExit(130) from None


def _main(argv: list[str] | None):
    """:func:`main` without its answer to Ctrl-C."""
    from argparse import ArgumentError

    from rlkl_lightning.errors import parser_message

    try:
        args = parse_args(argv)
    except ArgumentError as error:
        sys.exit(f"error: {parser_message(str(error))}")
    progress = not args["quiet"]
    if not args["texts"]:
        from rlkl_lightning.world import build_world

        world = build_world(progress=progress, num_threads=args["threads"])
        print(f"default world: {world.root}")
        return world
    from rlkl_lightning.world.custom import build_custom_world

    try:
        world = build_custom_world(
            args["texts"],
            CustomWorldConfig(**args["world"]),
            out=args["out"],
            progress=progress,
            num_threads=args["threads"],
        )
    except ValueError as error:
        sys.exit(f"error: {error}")
    print(describe(world))
    return world


def describe(world) -> str:
    """What a custom world holds, and the command of a study on it."""
    stats, report, s = world.corpus.stats, world.report, world.config
    n = stats["num_texts"]
    try:  # the tokenizer's own size: on a small corpus it stops short of `vocab_size`
        vocab = int(json.loads((world.model_dir / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        vocab = s.vocab_size
    units = sorted(set(stats["units"].values()))
    not_utf8 = sum(stats.get("not_utf8_lines", {}).values())  # absent in worlds built before
    lines = [
        f"world: {world.root}",
        f"  texts: {stats['read']:,} read ({', '.join(units) or 'rows'}), {stats['empty']:,} "
        f"empty, {stats['duplicates']:,} duplicates, {stats['truncated']:,} cut to "
        f"{s.max_chars:,} characters; {stats['kept']:,} kept"
        + (f", subsampled to {stats['subsampled_to']:,}" if stats["subsampled_to"] else "")
        + (f"; {not_utf8:,} lines not UTF-8 (read as Windows-1252 or Latin-1)" if not_utf8 else ""),
        f"  splits: train {n['train']:,}, validation {n['validation']:,}, test {n['test']:,}; "
        f"{stats['num_prompts']:,} prompts of up to {stats['max_prompt_tokens']} tokens",
        f"  tokenizer {vocab:,} tokens"
        + (f" (of {s.vocab_size:,} asked)" if vocab < s.vocab_size else "")
        + f"; model {s.n_layer} layers x {s.n_embd} "
        f"({report['parameters'] / 1e6:.2f}M parameters), {s.sft_steps} SFT steps "
        f"({report['sft_epochs']} epochs)",
        f"  held-out perplexity {report['test_perplexity']:.2f} (unigram "
        f"{report['unigram_test_perplexity']:.2f}); built in {report['build_seconds']:.0f} s",
        "run the study on it:",
        f"  python -m rlkl_lightning.compare --config configs/compare.yaml --world "
        f"{shlex.quote(str(world.root))}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
