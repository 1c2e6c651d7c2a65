"""``python -m examples.recall train|generate|verify``: parses, calls the example's
functions and prints."""

import argparse
import dataclasses
import sys
import time
from pathlib import Path

DEFAULT_RUN = Path(__file__).resolve().parent / "runs" / "default"


def _optional_int(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def _optional_str(text: str) -> str | None:
    return None if text.lower() == "none" else text


_TYPES = {int: int, float: float, int | None: _optional_int, str | None: _optional_str}


def _add_dataclass_options(parser, cls, skip=()):
    """One ``--option`` per field of the dataclass ``cls``, its default in the help."""
    group = parser.add_argument_group(f"{cls.__name__} ({cls.__module__.split('.')[-1]}.py)")
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        flag = "--" + field.name.replace("_", "-")
        if field.type is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            group.add_argument(
                flag,
                type=_TYPES[field.type],
                default=field.default,
                metavar=field.name.upper(),
                help=f"default {field.default}",
            )


def _options(args, cls, skip=(), **given):
    names = [f.name for f in dataclasses.fields(cls) if f.name not in skip]
    return cls(**{name: getattr(args, name) for name in names}, **given)


def _parser() -> argparse.ArgumentParser:
    from . import data, model, train

    parser = argparse.ArgumentParser(prog="python -m examples.recall", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser(
        "train",
        help="train the decoder (resumes from the latest checkpoint in --run)",
        description="Trains the decoder on associative recall and copy, evaluates exact "
        "match on held-out sequences, saves checkpoints and the plot RUN/curve.png. "
        "Resumes from the latest checkpoint in --run, with the results of an "
        "uninterrupted run.",
    )
    p.add_argument("--run", type=Path, default=DEFAULT_RUN, help=f"run directory ({DEFAULT_RUN})")
    p.add_argument("--restart", action="store_true", help="discard the run's checkpoints first")
    p.add_argument(
        "--stop-at",
        type=int,
        default=None,
        metavar="STEP",
        help="stop after this step (resume later with the same command)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_dataclass_options(p, train.TrainConfig)
    _add_dataclass_options(p, model.ModelConfig, skip=("vocab",))
    _add_dataclass_options(p, data.TaskConfig)

    p = commands.add_parser(
        "generate",
        help="greedy generation from a checkpoint, with and without the KV cache",
        description="Greedy generation from the latest checkpoint in --run for a batch of "
        "prompts of different lengths (one ragged prefill call, then one token per row "
        "per step): held-out copy and recall prompts, then long prompts to time the "
        "cache. By default both with the KV cache and without it (the whole context "
        "recomputed per token), timed side by side, and the tokens compared.",
    )
    p.add_argument("--run", type=Path, default=DEFAULT_RUN, help=f"run directory ({DEFAULT_RUN})")
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="only without the cache: recompute the context for every token",
    )
    p.add_argument(
        "--context",
        type=int,
        default=512,
        help="cache capacity and longest context of the timing batch (512)",
    )
    p.add_argument(
        "--new-tokens",
        type=int,
        default=32,
        help="tokens generated per row in the timing batch (32)",
    )
    p.add_argument("--batch", type=int, default=4, help="rows of the timing batch (4)")

    p = commands.add_parser(
        "verify",
        help="nanoattn.verify on the trained model: causality, padding, decoding",
        description="Runs nanoattn.verify's causality (token ids), padding and "
        "decoding checks on the model of the latest checkpoint in --run. Exit status 1 "
        "when a check fails.",
    )
    p.add_argument("--run", type=Path, default=DEFAULT_RUN, help=f"run directory ({DEFAULT_RUN})")
    p.add_argument(
        "--seq-lens", default=None, help="causality lengths, e.g. 1,2,8 (default: 1 to 513)"
    )
    return parser


def _train(args) -> int:
    from . import data, model, train

    task = _options(args, data.TaskConfig)
    sizes = _options(args, model.ModelConfig, skip=("vocab",), vocab=task.vocab)
    run = train.Run(sizes, task, _options(args, train.TrainConfig))
    print(f"model {run.model}\ntask {run.task}\ntrain {run.train}")
    try:
        _, run = train.train(
            run, args.run, stop_at=args.stop_at, restart=args.restart, progress=not args.no_progress
        )
    except KeyboardInterrupt:
        print("interrupted: run the same command to resume from the saved step")
        return 130
    curve = args.run / "curve.png"
    train.plot(run, curve)
    last = run.evals()[-1] if run.evals() else None
    if last:
        print(
            f"held-out exact match at step {last['step']}: recall {last['recall']:.2%} "
            f"(answers {last['recall_answers']:.2%}), copy {last['copy']:.2%}"
        )
    print(f"checkpoints in {args.run / 'checkpoints'}, plot {curve}")
    return 0


def _generate(args) -> int:
    from . import generate, train

    model, run, step = train.restore(args.run / "checkpoints")
    print(f"model of step {step} in {args.run}")
    both = not args.no_cache
    status = 0

    copy_lengths = sorted({3, 9, 17, run.task.max_copy})
    cuts = [0, run.task.queries - 1]
    prompts, expected = generate.task_prompts(run.train.seed, run.task, copy_lengths, cuts)
    n = max(len(e) for e in expected)
    result = generate.compare(
        model, prompts, n, max(map(len, prompts)) + n, cache=both, no_cache=True
    )
    tokens = result.cached if both else result.uncached
    how = "with the cache" if both else "no cache"
    print(
        f"\n{len(prompts)} held-out prompts of lengths {[len(p) for p in prompts]}, "
        f"one batch, {n} new tokens per row ({how}):"
    )
    for prompt, want, got in zip(prompts, expected, tokens):
        got = got[: len(want)].tolist()
        kind = "copy  " if prompt[0] == 3 else "recall"
        tail = " ".join(map(str, prompt[-6:]))
        more = " ..." if len(got) > 12 else ""
        verdict = "right" if got == want else "WRONG"
        print(f"  {kind} ...{tail:>22} -> {' '.join(map(str, got[:12]))}{more}  {verdict}")

    lengths = [args.context - args.new_tokens - 8 * b for b in range(args.batch)]
    prompts = generate.long_prompts(run.train.seed, run.task, lengths)
    print(
        f"\ntiming: {args.batch} prompts of {lengths[-1]}-{lengths[0]} tokens, "
        f"{args.new_tokens} new tokens per row, contexts up to {args.context}"
    )
    timing = generate.compare(model, prompts, args.new_tokens, args.context, cache=both)
    rows = []
    if both:
        t = timing.cached_time
        rows.append(("with the KV cache", f"{1e3 * t['prefill']:.1f} ms", t["per token"]))
    rows.append(("no cache (recompute)", "-", timing.uncached_time["per token"]))
    print(f"  {'':22}{'prefill':>10}{'per token':>12}{'tokens/s':>12}")
    for name, prefill, per in rows:
        print(f"  {name:22}{prefill:>10}{1e3 * per:>9.2f} ms{args.batch / per:>12,.0f}")
    if both:
        same = result.equal and timing.equal
        print(
            f"  speedup per token: {timing.speedup:.1f}x; cached tokens equal uncached: "
            f"{'yes' if same else 'NO'}"
        )
        status = 0 if same else 1
    return status


def _verify(args) -> int:
    from . import train, verify

    model, _, step = train.restore(args.run / "checkpoints")
    seq_lens = None if args.seq_lens is None else [int(s) for s in args.seq_lens.split(",")]
    print(f"nanoattn.verify on the model of step {step} in {args.run}")
    start = time.perf_counter()
    reports = verify.verify(model, seq_lens=seq_lens)
    for report in reports:
        print(report)
    passed = all(r.passed for r in reports)
    print(f"{'PASS' if passed else 'FAIL'} ({time.perf_counter() - start:.0f} s)")
    return 0 if passed else 1


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    return {"train": _train, "generate": _generate, "verify": _verify}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
