"""``python -m examples.recall train|generate|serve|quantized|verify``: parses, calls
the example's functions and prints.

Every bad option, and a run directory with no checkpoint for ``generate``, ``serve``,
``quantized`` and ``verify``, is a usage error: argparse's usage, one ``error:`` line
naming the flags, exit status 2."""

import argparse
import dataclasses
import importlib.util
import math
import re
import sys
import time
from pathlib import Path

DEFAULT_RUN = Path(__file__).resolve().parent / "runs" / "default"
PROG = "python -m examples.recall"
# What the example imports beyond nanoattn's own dependencies: pyproject.toml's
# [examples] extra (top-level module names; tests/test_example_recall.py checks both).
EXTRA_MODULES = ("matplotlib", "optax", "orbax", "tqdm")


def _number(convert, check, expected: str):
    """An argparse type: ``convert(text)``, kept when ``check`` holds, else the error
    argparse prints as ``argument --flag: expected ..., got ...``."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not check(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


positive_int = _number(int, lambda n: n >= 1, "an integer >= 1")
non_negative_int = _number(int, lambda n: n >= 0, "an integer >= 0")
positive_float = _number(float, lambda x: math.isfinite(x) and x > 0, "a number > 0")
non_negative_float = _number(float, lambda x: math.isfinite(x) and x >= 0, "a number >= 0")
rate = _number(float, lambda x: 0 <= x < 1, "a rate in [0, 1)")
fraction = _number(float, lambda x: 0 <= x <= 1, "a fraction in [0, 1]")


def _none_or(parse):
    def parse_optional(text: str):
        return None if text.lower() == "none" else parse(text)

    return parse_optional


def _implementation(text: str) -> str | None:
    """A nanoattn backend's name, or none (nanoattn chooses); nanoattn checks the name."""
    from nanoattn.nnx import AttentionConfig

    name = None if text.lower() == "none" else text
    try:
        AttentionConfig(d_model=1, n_heads=1, implementation=name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def _backend_names() -> tuple[str, ...]:
    """nanoattn's backends, by name (its registry; ``_implementation`` checks a name)."""
    from nanoattn._backends import registry

    return registry.names()


def _lengths(text: str) -> list[int]:
    """Comma-separated sequence lengths, each >= 1: ``1,2,8``."""
    try:
        lengths = [int(s) for s in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers >= 1 (e.g. 1,2,8), got {text!r}"
        )
    return lengths


def _range(text: str) -> tuple[int, int]:
    """``LO,HI``: two integers with 1 <= LO <= HI."""
    try:
        low, high = (int(s) for s in text.split(","))
    except ValueError:
        low = high = 0
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(
            f"expected LO,HI with integers 1 <= LO <= HI (e.g. 16,384), got {text!r}"
        )
    return low, high


# The type of every option made from a config field: its range, checked as it is parsed.
_FIELD_TYPES = {
    # TrainConfig
    "seed": non_negative_int,
    "steps": positive_int,
    "batch": positive_int,
    "lr": positive_float,
    "warmup": non_negative_int,
    "weight_decay": non_negative_float,
    "eval_every": positive_int,
    "eval_recall": positive_int,
    "eval_copy": positive_int,
    "checkpoint_every": positive_int,
    "log_every": positive_int,
    # ModelConfig
    "d_model": positive_int,
    "n_heads": positive_int,
    "n_kv_heads": positive_int,
    "n_layers": positive_int,
    "mlp_ratio": positive_int,
    "dropout": rate,
    "rope_base": positive_float,
    "local_window": _none_or(non_negative_int),
    "implementation": _implementation,
    # TaskConfig
    "pairs": positive_int,
    "seq_len": positive_int,
    "n_keys": positive_int,
    "n_values": positive_int,
    "copy_fraction": fraction,
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_dataclass_options(parser, cls, skip=()):
    """One ``--option`` per field of the dataclass ``cls``, its default in the help."""
    group = parser.add_argument_group(f"{cls.__name__} ({cls.__module__.split('.')[-1]}.py)")
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        if field.type is bool:
            group.add_argument(
                _flag(field.name), action=argparse.BooleanOptionalAction, default=field.default
            )
        else:
            group.add_argument(
                _flag(field.name),
                type=_FIELD_TYPES[field.name],
                default=field.default,
                metavar=field.name.upper(),
                help=f"default {field.default}",
            )


def _options(parser, args, cls, skip=(), **given):
    """``cls`` built from the parsed options; a combination it rejects (say a width
    the heads do not divide) is a usage error, its message naming the flags."""
    names = [f.name for f in dataclasses.fields(cls) if f.name not in skip]
    try:
        return cls(**{name: getattr(args, name) for name in names}, **given)
    except ValueError as e:
        # The configs name fields as name=value: say --name=value, the flag's spelling.
        fields = "|".join(names)
        parser.error(re.sub(rf"\b({fields})=", lambda m: _flag(m[1]) + "=", str(e)))


def _run_option(parser):
    parser.add_argument(
        "--run", type=Path, default=DEFAULT_RUN, help=f"run directory ({DEFAULT_RUN})"
    )


def _parser() -> tuple[argparse.ArgumentParser, dict]:
    """The parser and its subcommands' parsers, by name."""
    from . import data, engine, model, train

    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser(
        "train",
        help="train the decoder (resumes from the latest checkpoint in --run)",
        description="Trains the decoder on associative recall and copy, evaluates exact "
        "match on held-out sequences, saves checkpoints and the plot RUN/curve.png. "
        "Resumes from the latest checkpoint in --run, with the results of an "
        "uninterrupted run.",
    )
    _run_option(p)
    p.add_argument("--restart", action="store_true", help="discard the run's checkpoints first")
    p.add_argument(
        "--stop-at",
        type=positive_int,
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
    _run_option(p)
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="only without the cache: recompute the context for every token",
    )
    p.add_argument(
        "--context",
        type=positive_int,
        default=512,
        help="cache capacity and longest context of the timing batch (512)",
    )
    p.add_argument(
        "--new-tokens",
        type=positive_int,
        default=32,
        help="tokens generated per row in the timing batch (32)",
    )
    p.add_argument("--batch", type=positive_int, default=4, help="rows of the timing batch (4)")

    p = commands.add_parser(
        "serve",
        help="continuous batching over a paged KV cache, against static batches",
        description="Serves a seeded queue of requests (prompts of held-out recall "
        "sequences laid end to end, of different lengths, each with its own number of "
        "tokens to generate greedily) with the model of the latest checkpoint in --run: "
        "first by continuous batching over a paged KV cache (requests admitted as others "
        "finish, each step one jitted call mixing prompt chunks and decode tokens), then "
        "through static batches with full caches of the same memory (batch x capacity <= "
        "pages x page size), both with their attention on --implementation. Prints the "
        "tokens/s of both and their ratio against --target, and checks that both give "
        "every request the same tokens, and --check of them their greedy decoding alone. "
        "Exit status 1 when the ratio misses the target or tokens differ.",
    )
    _run_option(p)
    p.add_argument(
        "--implementation",
        type=_implementation,
        default=None,
        metavar="NAME",
        help=f"nanoattn's attention backend for both: {', '.join(_backend_names())}, or "
        "none: nanoattn's automatic choice (the default; not the backend the checkpoint "
        "was trained with)",
    )
    p.add_argument(
        "--target",
        type=non_negative_float,
        default=engine.TARGET,
        metavar="RATIO",
        help=f"continuous batching's tokens/s over static batching's, at least "
        f"({engine.TARGET:g}); 0: not judged",
    )
    load, sizes = engine.WORKLOAD, engine.SERVE
    p.add_argument("--requests", type=positive_int, default=load["requests"],
                   help=f"requests ({load['requests']})")  # fmt: skip
    p.add_argument("--seed", type=non_negative_int, default=load["seed"],
                   help=f"workload seed ({load['seed']})")  # fmt: skip
    p.add_argument(
        "--prompt-lengths",
        type=_range,
        default=load["prompt_lengths"],
        metavar="LO,HI",
        help="prompt lengths, drawn uniformly ({},{})".format(*load["prompt_lengths"]),
    )
    p.add_argument(
        "--new-tokens",
        type=_range,
        default=load["new_tokens"],
        metavar="LO,HI",
        help="tokens to generate per request, drawn uniformly ({},{})".format(*load["new_tokens"]),
    )
    p.add_argument("--pages", type=positive_int, default=sizes.pages,
                   help=f"pages of the pool ({sizes.pages})")  # fmt: skip
    p.add_argument("--page-size", type=positive_int, default=sizes.page_size,
                   help=f"tokens a page holds ({sizes.page_size})")  # fmt: skip
    p.add_argument("--max-sequences", type=positive_int, default=sizes.max_sequences,
                   help=f"requests in flight at most ({sizes.max_sequences})")  # fmt: skip
    p.add_argument(
        "--step-tokens",
        type=positive_int,
        default=sizes.step_tokens,
        help=f"tokens of a step, decode tokens and prompt chunks ({sizes.step_tokens}; "
        "a step of fewer runs at a smaller size: up to 3 halvings, at least 8)",
    )
    p.add_argument(
        "--check",
        type=non_negative_int,
        default=4,
        help="requests checked against their greedy decoding alone (4)",
    )
    p.add_argument(
        "--no-static", action="store_true", help="only the engine (no ratio: --target not judged)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = commands.add_parser(
        "quantized",
        help="int8 and float8 KV caches: greedy tokens and each layer's error",
        description="Decodes held-out recall sequences with the model of the latest "
        "checkpoint in --run through a float32, an int8 and a float8_e4m3fn KV cache (one "
        "prefill call of the prompt, then one token per call, the sequence's own tokens "
        "fed) and prints how often each quantized cache's greedy token equals the float "
        "cache's, at every step and at the answer steps (target: int8 at least 99%% of "
        "the steps), then each attention layer's output decoded through each cache against "
        "its float64 forward. A progress bar names each stage as it runs (each decoding "
        "compiles first). Exit status 1 when int8 misses the target.",
    )
    _run_option(p)
    p.add_argument(
        "--sequences", type=positive_int, default=200, help="held-out recall sequences (200)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = commands.add_parser(
        "verify",
        help="nanoattn.verify on the trained model: causality, padding, decoding",
        description="Runs nanoattn.verify's causality (token ids), padding and "
        "decoding checks on the model of the latest checkpoint in --run. Exit status 1 "
        "when a check fails.",
    )
    _run_option(p)
    p.add_argument(
        "--seq-lens",
        type=_lengths,
        default=None,
        help="causality lengths, e.g. 1,2,8 (default: 1 to 513)",
    )
    return parser, commands.choices


def _checkpoints(parser, args) -> Path:
    """The run's checkpoint directory; no checkpoint in it is a usage error."""
    from . import checkpoint

    directory = args.run / "checkpoints"
    if checkpoint.latest(directory) is None:
        train = f"{PROG} train" + ("" if args.run == DEFAULT_RUN else f" --run {args.run}")
        parser.error(f"no checkpoint in --run {args.run}: train first ({train})")
    return directory


def _train(parser, args) -> int:
    from . import data, model, train

    if args.run.exists() and not args.run.is_dir():
        parser.error(f"--run {args.run} is a file, not a directory")
    task = _options(parser, args, data.TaskConfig)
    sizes = _options(parser, args, model.ModelConfig, skip=("vocab",), vocab=task.vocab)
    run = train.Run(sizes, task, _options(parser, args, train.TrainConfig))
    if not args.restart:
        try:
            train.check_resumable(run, args.run)
        except ValueError as e:
            parser.error(str(e))
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


def _generate(parser, args) -> int:
    from . import generate, train

    shortest = args.context - args.new_tokens - 8 * (args.batch - 1)
    if shortest < 1:
        parser.error(
            f"--context {args.context} leaves no room for --batch {args.batch} prompts "
            f"(lengths 8 apart) and --new-tokens {args.new_tokens}: the shortest prompt "
            f"would have {shortest} tokens; pass --context "
            f"{args.new_tokens + 8 * (args.batch - 1) + 1} or more"
        )
    model, run, step = train.restore(_checkpoints(parser, args))
    print(f"model of step {step} in {args.run}")
    both = not args.no_cache
    status = 0

    max_copy = run.task.max_copy
    copy_lengths = sorted({n for n in (3, 9, 17) if n < max_copy} | {max_copy})
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


def _serve(parser, args) -> int:
    from tqdm import tqdm

    from . import engine, train

    try:
        config = engine.EngineConfig(args.pages, args.page_size, args.max_sequences,
                                     args.step_tokens)  # fmt: skip
    except ValueError as e:
        parser.error(re.sub(r"\b(\w+)=", lambda m: _flag(m[1]) + "=", str(e)))
    trained, run, step = train.restore(_checkpoints(parser, args))
    model = engine.with_implementation(trained, args.implementation)
    requests = engine.workload(
        args.seed, run.task, args.requests, args.prompt_lengths, args.new_tokens
    )
    longest = max(r.need for r in requests)
    capacity = engine.static_capacity(requests)
    if max(longest, capacity) > config.cache_tokens:
        parser.error(
            f"--pages {args.pages} x --page-size {args.page_size} = {config.cache_tokens} "
            f"tokens of cache cannot hold a request of --prompt-lengths and --new-tokens "
            f"({max(longest, capacity)} tokens): pass more --pages"
        )
    tokens = sum(r.new_tokens for r in requests)
    print(
        f"model of step {step} in {args.run}; {len(requests)} requests: prompts of "
        f"{min(len(r.prompt) for r in requests)}-{max(len(r.prompt) for r in requests)} "
        f"tokens, {min(r.new_tokens for r in requests)}-{max(r.new_tokens for r in requests)} "
        f"new tokens each, {tokens} in all"
    )
    backend = ("nanoattn's automatic choice" if args.implementation is None
               else f"implementation={args.implementation!r}")  # fmt: skip
    print(
        f"attention: {backend} (--implementation; the checkpoint was trained with "
        f"implementation={run.model.implementation!r})"
    )
    bytes_per_token = 2 * sum(  # keys and values of every layer, float32
        b.attn.config.kv_heads * b.attn.config.head_dim * 4 for b in model.blocks
    )
    memory = config.cache_tokens * bytes_per_token / 2**20
    results = {}

    def serve(name, server, line):
        print(line)
        try:
            backends = server.warm_up(*(() if name == "engine" else (requests,)))
        except ValueError as e:  # a backend asked for by name that cannot serve a call
            if args.implementation is None:
                raise
            parser.error(f"--implementation {args.implementation}: {e}")
        print(f"  attention served by {', '.join(backends)}")
        with tqdm(total=tokens, unit="tok", disable=args.no_progress, leave=False) as bar:
            served = server.run(requests, progress=bar.update)
        results[name] = served
        print(
            f"  {served.tokens} tokens in {served.seconds:.2f} s, {served.steps} steps: "
            f"{served.tokens_per_second:,.0f} tokens/s"
        )

    server = engine.Engine(model, config, longest)
    serve(
        "engine",
        server,
        f"continuous batching: a pool of {config.pages} pages of {config.page_size} tokens "
        f"({config.cache_tokens} tokens, {memory:.1f} MiB of keys and values), at most "
        f"{config.max_sequences} requests in flight, {config.step_tokens} tokens a step",
    )
    failed = []  # why the exit status is 1, one phrase each
    if not args.no_static:
        static = engine.static_for(model, config, requests)
        serve(
            "static",
            static,
            f"static batches: {static.batch} rows of a full cache of {capacity} tokens "
            f"({static.batch * capacity} tokens, <= the pool's {config.cache_tokens})",
        )
        ratio = results["engine"].tokens_per_second / results["static"].tokens_per_second
        line = f"continuous / static batching: {ratio:.2f}x the tokens/s"
        if args.target:
            met = ratio >= args.target
            print(f"{line} (target >= {args.target:g}x): {'met' if met else 'MISSED'}")
            if not met:
                failed.append(
                    f"continuous batching made {ratio:.2f}x the tokens/s of static batching, "
                    f"under the target {args.target:g}x"
                )
        else:
            print(f"{line} (not judged: --target 0)")
        same = results["engine"].outputs == results["static"].outputs
        print(f"every request's tokens equal in both: {'yes' if same else 'NO'}")
        if not same:
            failed.append("continuous and static batching gave different tokens")
    if args.check:
        checked = requests[: args.check]
        outputs = engine.alone(model, checked)
        alone = all(outputs[r.id] == results["engine"].outputs[r.id] for r in checked)
        print(
            f"the first {len(checked)} requests' tokens equal their greedy decoding alone: "
            f"{'yes' if alone else 'NO'}"
        )
        if not alone:
            failed.append("requests' tokens differ from their greedy decoding alone")
    if failed:
        print(f"FAIL: {'; '.join(failed)}")
    return 1 if failed else 0


def _quantized(parser, args) -> int:
    from tqdm import tqdm

    from . import quantized, train

    model, run, step = train.restore(_checkpoints(parser, args))
    prompt = 2 + 2 * run.task.pairs
    print(
        f"model of step {step} in {args.run}; {args.sequences} held-out recall sequences, "
        f"{run.task.seq_len - prompt} decoding steps each: a prompt of {prompt} tokens in "
        "one call, then one token per call, the sequence's own tokens fed"
    )
    stages = quantized.stages(model)
    with tqdm(total=len(stages), unit="stage", disable=args.no_progress, leave=False) as bar:

        def begin(stage):
            bar.update(stages.index(stage) - bar.n)  # the stages before it are done
            bar.set_postfix_str(stage)

        found = quantized.measure(model, run.task, run.train.seed, args.sequences, begin)
        bar.update(bar.total - bar.n)
    print("greedy tokens equal to the float cache's:")
    print(f"  {'cache':16}{'every step':>22}{'answer steps':>22}{'answers right':>16}")
    for dtype, a in found.agreement.items():
        name = "float32" if dtype is None else dtype
        every = f"{a.equal}/{a.steps} {a.fraction:.2%}"
        answers = f"{a.answer_equal}/{a.answer_steps} {a.answer_fraction:.2%}"
        right = f"{a.answers_right / a.answer_steps:.2%}"
        print(f"  {name:16}{every:>22}{answers:>22}{right:>16}")
    int8 = found.agreement["int8"].fraction
    print(
        f"int8 cache: {int8:.2%} of the steps (target >= {quantized.TARGET:.0%}): "
        f"{'met' if found.passed else 'MISSED'}"
    )
    print("each attention layer decoded through the cache, against its float64 forward "
          "(max |difference| / max |output|):")  # fmt: skip
    names = ["float32" if d is None else d for d in found.errors[0]]
    print(f"  {'layer':10}" + "".join(f"{n:>16}" for n in names))
    for layer, errors in enumerate(found.errors):
        window = model.config.attention(layer).window
        kind = "global" if window is None else f"window {window[0]}"
        print(f"  {f'{layer} {kind}':10}" + "".join(f"{e:>16.2e}" for e in errors.values()))
    return 0 if found.passed else 1


def _verify(parser, args) -> int:
    from . import train, verify

    model, _, step = train.restore(_checkpoints(parser, args))
    seq_lens = args.seq_lens
    print(f"nanoattn.verify on the model of step {step} in {args.run}")
    start = time.perf_counter()
    reports = verify.verify(model, seq_lens=seq_lens)
    for report in reports:
        print(report)
    passed = all(r.passed for r in reports)
    print(f"{'PASS' if passed else 'FAIL'} ({time.perf_counter() - start:.0f} s)")
    return 0 if passed else 1


def main(argv=None) -> int:
    missing = [name for name in EXTRA_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"{PROG}: error: the example needs {', '.join(missing)}, not installed: "
            "pip install -e '.[examples]' (from the repository root)",
            file=sys.stderr,
        )
        return 2
    parser, commands = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse says so after the top-level usage; the subcommand's is of use
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    commands_run = {"train": _train, "generate": _generate, "serve": _serve,
                    "quantized": _quantized, "verify": _verify}  # fmt: skip
    run = commands_run[args.command]
    return run(commands[args.command], args)


if __name__ == "__main__":
    sys.exit(main())
