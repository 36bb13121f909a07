"""Command line: `python -m engine demo [...]` (the main job) and `python -m engine explain ...`."""
from __future__ import annotations

import argparse
import sys
import textwrap

from engine.cli import explain as explain_mod
from engine.cli.usage import OneLineParser, quiet_on_closed_pipe
from engine.host.ledger_tables import WIDTH


def _explain_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain",
        help="print the row ledger of one step as tables",
        description=explain_mod.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("requests", nargs="*", help="KIND:ID[:key=value,...], one per request")
    p.add_argument("--json", metavar="FILE", help="read the batch from a JSON file instead")
    p.add_argument("--max-draft-tokens", type=int, default=None)
    p.add_argument("--keep", type=int, default=None, help="prefill compaction: keep_tokens")
    p.add_argument("--bucket", type=int, default=None, help="show the padding of this graph bucket")
    p.add_argument("--example", action="store_true", help="explain the built-in example batch")


def run_explain(args: argparse.Namespace) -> int:
    for name in ("max_draft_tokens", "keep", "bucket"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "max_draft_tokens" else 1):
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be >= {0 if name == 'max_draft_tokens' else 1}")
    if args.json:
        seqs, max_draft, keep = explain_mod.load_json_batch(args.json)
        return _print_explained(args, seqs, max_draft, keep)
    try:
        if args.requests and not args.example:
            seqs = [explain_mod.parse_request(spec) for spec in args.requests]
            max_draft = 0
        else:
            seqs = [explain_mod.parse_request(spec) for spec in explain_mod.EXAMPLE_BATCH]
            max_draft = explain_mod.EXAMPLE_MAX_DRAFT_TOKENS
            print(textwrap.fill("Example batch: " + " ".join(explain_mod.EXAMPLE_BATCH), WIDTH,
                                subsequent_indent="    ", break_on_hyphens=False) + "\n")
        if args.max_draft_tokens is None:
            max_draft = max([max_draft, *(s.seqlen_q - 1 for s in seqs if not s.is_prompt)])
        return _print_explained(args, seqs, max_draft, None)
    except ValueError as err:
        # A batch given as KIND:ID:key=value arguments hears its own keys back (write=, not mtp_write_slot=).
        raise explain_mod.in_spec_words(err) from None


def _print_explained(args: argparse.Namespace, seqs: list, max_draft: int, keep: int | None) -> int:
    print(explain_mod.explain(
        seqs,
        max_draft_tokens=max_draft if args.max_draft_tokens is None else args.max_draft_tokens,
        compaction_keep_tokens=keep if args.keep is None else args.keep,
        bucket=args.bucket,
    ))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:
        from engine.cli import demo  # imports torch and the model: only for the demo

        return demo.main(argv[1:])
    parser = OneLineParser(prog="python -m engine")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    _explain_parser(sub)
    sub.add_parser("demo", help="the main job: the decode loop on SmolLM2 (see `demo --help`)")
    args = parser.parse_args(argv)
    try:
        return quiet_on_closed_pipe(lambda: run_explain(args))
    except (ValueError, OSError) as err:  # a bad batch or an unreadable file: one line, no traceback
        print(f"python -m engine explain: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
