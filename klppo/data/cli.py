"""``klppo data``: prepare prompt datasets as Parquet.

klppo data gsm8k [--input DIR] --output DIR      GSM8K jsonl → train/test.parquet (verl schema)
klppo data arithmetic --output DIR [--num-train N --num-test N --seed S --negative --interaction NAME]
klppo data log --output FILE [--n N] [config keys]   logged responses (klppo.commands.log_data, docs/data.md)
"""

from __future__ import annotations

import argparse
import sys

from klppo.config.flags import FlagParser
from klppo.data.arithmetic import write_arithmetic_parquet
from klppo.data.gsm8k import convert


def _parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="klppo data", description="Prepare prompt datasets as Parquet.")
    sub = parser.add_subparsers(dest="dataset", required=True)
    g = sub.add_parser("gsm8k", help="GSM8K train.jsonl/test.jsonl → train.parquet/test.parquet")
    g.add_argument(
        "--input", default=None, help="folder with train.jsonl and test.jsonl (omit: fetch via datasets)"
    )
    g.add_argument("--output", default="~/data/gsm8k", help="output folder (default ~/data/gsm8k)")
    a = sub.add_parser("arithmetic", help="small built-in two-digit arithmetic set in GSM8K format")
    a.add_argument("--output", required=True)
    a.add_argument("--num-train", type=int, default=256)
    a.add_argument("--num-test", type=int, default=64)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument(
        "--negative", action="store_true", help="differences keep their operands' order (about half negative)"
    )
    a.add_argument(
        "--interaction",
        default=None,
        metavar="NAME",
        help="name this interaction in each row's extra_info.interaction_kwargs, with the answer as its "
        "ground_truth (multi-turn runs: docs/multi_turn.md)",
    )
    sub.add_parser("log", help="a model's responses with their log-probs and scores (docs/data.md)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.dataset == "gsm8k":
            n_train, n_test = convert(args.input, args.output)
            print(f"wrote {n_train} train and {n_test} test rows to {args.output}")
        else:
            paths = write_arithmetic_parquet(
                args.output,
                args.num_train,
                args.num_test,
                args.seed,
                negative=args.negative,
                interaction=args.interaction,
            )
            print(f"wrote {args.num_train} train and {args.num_test} test rows: {paths[0]}, {paths[1]}")
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"klppo data {args.dataset}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
