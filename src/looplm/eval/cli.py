"""`looplm eval ...` subcommands."""

from __future__ import annotations

from ..cli import UsageError, print_json, read_text_arg


def register(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a model")
    ev = p.add_subparsers(dest="eval_command", required=True)
    q = ev.add_parser("ppl", help="held-out perplexity and bits per byte, per loop exit")
    q.add_argument("model")
    q.add_argument("--text", default=None, help="text file (default: the packaged held-out sample)")
    q.add_argument("--exit-loop", type=int, default=None, help="static exit: every token leaves after loop i")
    q.add_argument("--seq-len", type=int, default=512)
    q.add_argument("--batch-size", type=int, default=4)
    q.add_argument("--max-tokens", type=int, default=None)
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_eval_ppl)


def cmd_eval_ppl(args) -> int:
    from .perplexity import perplexity
    from ..models import load_model
    from ..cli_core import sample_text
    text = read_text_arg(args.text) if args.text else sample_text()
    model, tok = load_model(args.model)
    if tok is None:
        raise UsageError(f"{args.model} has no tokenizer files; save the model with its tokenizer")
    result = perplexity(model, tok, text, seq_len=args.seq_len, batch_size=args.batch_size,
                        exit_loop=args.exit_loop, max_tokens=args.max_tokens, progress=not args.json)
    if args.json:
        print_json(result)
        return 0
    print(f"perplexity {result['perplexity']:.3f}  bits/byte {result['bits_per_byte']:.4f}  "
          f"({result['tokens']} tokens, exit after loop {result['exit_loop']})")
    for row in result["per_loop"][:-1]:
        print(f"  loop {row['loop']}: perplexity {row['perplexity']:.3f}  bits/byte {row['bits_per_byte']:.4f}")
    return 0
