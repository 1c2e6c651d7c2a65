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


def _mesh(text: str) -> tuple[int, int]:
    """``TxD``: two positive integers, the mesh's head shards and data-parallel groups."""
    try:
        tensor, groups = (int(s) for s in text.lower().split("x"))
    except ValueError:
        tensor = groups = 0
    if tensor < 1 or groups < 1:
        raise argparse.ArgumentTypeError(
            f"expected TxD with positive integers (e.g. 2x4), got {text!r}"
        )
    return tensor, groups


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
                _flag(field.name),
                action=argparse.BooleanOptionalAction,
                default=field.default,
                help=f"default {field.default}",
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


def _command(commands, name: str, **texts) -> argparse.ArgumentParser:
    """The subcommand ``name`` (``help`` and ``description`` in ``texts``) with the
    ``--run`` option every subcommand takes: the run directory it reads or writes."""
    parser = commands.add_parser(name, **texts)
    parser.add_argument(
        "--run", type=Path, default=DEFAULT_RUN, help=f"run directory ({DEFAULT_RUN})"
    )
    return parser


def _parser() -> tuple[argparse.ArgumentParser, dict]:
    """The parser and its subcommands' parsers, by name."""
    from . import data, model, train

    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    p = _command(
        commands,
        "train",
        help="train the decoder (resumes from the latest checkpoint in --run)",
        description="Trains the decoder on associative recall and copy, evaluates exact "
        "match on held-out sequences, saves checkpoints and the plot RUN/curve.png. "
        "Resumes from the latest checkpoint in --run, with the results of an "
        "uninterrupted run.",
    )
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

    p = _command(
        commands,
        "generate",
        help="greedy generation from a checkpoint, with and without the KV cache",
        description="Greedy generation from the latest checkpoint in --run for a batch of "
        "prompts of different lengths (one ragged prefill call, then one token per row "
        "per step): held-out copy and recall prompts, then long prompts to time the "
        "cache. By default both with the KV cache and without it (the whole context "
        "recomputed per token), timed side by side, and the tokens compared.",
    )
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

    _serve_parser(commands)
    _speculate_parser(commands)

    p = _command(
        commands,
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
    p.add_argument(
        "--sequences", type=positive_int, default=200, help="held-out recall sequences (200)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    _selection_parser(commands)

    p = _command(
        commands,
        "verify",
        help="nanoattn.verify on the trained model: causality, padding, decoding",
        description="Runs nanoattn.verify's causality (token ids), padding and "
        "decoding checks on the model of the latest checkpoint in --run. Exit status 1 "
        "when a check fails.",
    )
    p.add_argument(
        "--seq-lens",
        type=_lengths,
        default=None,
        help="causality lengths, e.g. 1,2,8 (default: 1 to 513)",
    )
    return parser, commands.choices


def _selection_parser(commands) -> None:
    from .selection import PAGE_SIZE, SELECTIONS

    p = _command(
        commands,
        "selection",
        help="query-aware page selection: greedy tokens and step time against every page",
        description="Decodes held-out recall sequences with the model of the latest "
        "checkpoint in --run through a paged KV cache (every sequence in one pool: one "
        "step of their prompts, then one step of one token each, the sequences' own "
        "tokens fed), once reading every page and once per --select k with page selection "
        "in the global blocks (each decode query reads the k pages whose keys bound its "
        "logits highest and its last page), and prints how often each one's greedy token "
        "equals the decoding of every page and the answer, and the time of a decode step. "
        "Page selection changes the answer: this says by how much.",
    )
    p.add_argument(
        "--sequences", type=positive_int, default=200, help="held-out recall sequences (200)"
    )
    p.add_argument("--page-size", type=positive_int, default=PAGE_SIZE,
                   help=f"tokens of a page ({PAGE_SIZE})")  # fmt: skip
    default = ",".join(map(str, SELECTIONS))
    p.add_argument(
        "--select",
        type=_lengths,
        default=list(SELECTIONS),
        help=f"the pages k read besides the last, comma-separated ({default})",
    )
    p.add_argument("--length", type=positive_int, default=None,
                   help="tokens of a held-out sequence (the run's --seq-len; longer ones "
                   "ask more queries of the same pairs)")  # fmt: skip
    p.add_argument("--decoded", type=positive_int, default=None,
                   help="decode only the last this many tokens a step each, the rest "
                   "prefilled (every token after the pairs and SEP)")  # fmt: skip
    _implementation_option(p)


def _implementation_option(p) -> None:
    """``--implementation``: the attention backend of a command that serves (both of
    what it compares)."""
    p.add_argument(
        "--implementation",
        type=_implementation,
        default=None,
        metavar="NAME",
        help=f"nanoattn's attention backend for both: {', '.join(_backend_names())}, or "
        "none: nanoattn's automatic choice (the default; not the backend the checkpoint "
        "was trained with)",
    )


def _speculate_parser(commands) -> None:
    p = _command(
        commands,
        "speculate",
        help="speculative decoding with prompt-lookup token trees against plain greedy",
        description="Generates from held-out recall prompts (sequences laid end to end) "
        "with the model of the latest checkpoint in --run, one prompt at a time: by "
        "speculative decoding (each step drafts a token tree by prompt lookup, verifies "
        "it in one call through the KV cache and keeps the path greedy decoding "
        "confirms, all in one call) and by plain greedy decoding (one token per call), "
        "then each prompt's steps in one compiled loop, each timed after a warm-up, all "
        "with their attention on --implementation. Prints the drafts accepted per step "
        "and tokens/s of both in both ways. Exit status 1 when the tokens differ.",
    )
    _implementation_option(p)
    p.add_argument("--prompts", type=positive_int, default=4, help="prompts (4)")
    p.add_argument(
        "--prompt-length", type=positive_int, default=256, help="tokens per prompt (256)"
    )
    p.add_argument(
        "--new-tokens", type=positive_int, default=64, help="tokens generated per prompt (64)"
    )
    p.add_argument("--nodes", type=positive_int, default=16, help="drafts per tree (16)")
    p.add_argument("--depth", type=positive_int, default=8, help="a tree's depth (8)")


def _pair(low_high) -> str:
    """A range as its option takes it: ``LO,HI``."""
    return "{},{}".format(*low_high)


def _serve_parser(commands) -> None:
    """The ``serve`` subcommand's parser and options."""
    from . import engine

    p = _command(
        commands,
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
        "With --shared, requests in groups that share their prompts, served by the engine "
        "with its prefix cache and without it (no static batches): prefix hits, pages "
        "shared, prompt tokens computed and tokens/s of both, their ratios against "
        "the targets. Exit status 1 when a ratio misses its target or tokens differ.",
    )
    _implementation_option(p)
    p.add_argument(
        "--target",
        type=non_negative_float,
        default=None,
        metavar="RATIO",
        help=f"continuous batching's tokens/s over static batching's, at least "
        f"({engine.TARGET:g}); with --shared, the engine's with its prefix cache over "
        f"without ({engine.PREFIX_TARGET:g}; and prompt tokens computed at most "
        f"{engine.PREFILL_TARGET:g}x); 0: not judged",
    )
    load, shared, sizes = engine.WORKLOAD, engine.SHARED, engine.SERVE
    p.add_argument("--requests", type=positive_int, default=None,
                   help=f"requests ({load['requests']}; {shared['requests']} with "
                   "--shared)")  # fmt: skip
    p.add_argument("--seed", type=non_negative_int, default=load["seed"],
                   help=f"workload seed ({load['seed']})")  # fmt: skip
    p.add_argument(
        "--prompt-lengths",
        type=_range,
        default=load["prompt_lengths"],
        metavar="LO,HI",
        help=f"prompt lengths, drawn uniformly ({_pair(load['prompt_lengths'])}; not with "
        "--shared)",
    )
    p.add_argument(
        "--new-tokens",
        type=_range,
        default=None,
        metavar="LO,HI",
        help="tokens to generate per request, drawn uniformly "
        f"({_pair(load['new_tokens'])}; {_pair(shared['new_tokens'])} with --shared)",
    )
    _shared_options(p)
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
    p.add_argument(
        "--mesh",
        type=_mesh,
        default=None,
        metavar="TxD",
        help="then the engine on a mesh of T x D devices (examples/recall/mesh.py: the "
        "heads split T ways, D data-parallel groups with a pool of --pages pages each; on a "
        "CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8), its tokens compared "
        "with the engine's on one device; not with --shared or --prefix-cache",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _shared_options(p) -> None:
    """``serve``'s options of the shared-prompt workload and the prefix cache."""
    from . import engine

    shared = engine.SHARED
    p.add_argument(
        "--shared",
        action="store_true",
        help="the shared-prompt workload (--requests in --groups groups, each group's "
        "prompt --shared-length tokens and each request's own --suffix-lengths after it), "
        "through the engine with its prefix cache and without it",
    )
    p.add_argument("--groups", type=positive_int, default=shared["groups"],
                   help=f"groups of requests sharing a prompt ({shared['groups']}; "
                   "with --shared)")  # fmt: skip
    p.add_argument("--shared-length", type=positive_int, default=shared["shared_length"],
                   help=f"tokens of a group's prompt ({shared['shared_length']}; "
                   "with --shared)")  # fmt: skip
    p.add_argument(
        "--suffix-lengths",
        type=_range,
        default=shared["suffix_lengths"],
        metavar="LO,HI",
        help="tokens of each request's own after its group's, drawn uniformly "
        f"({_pair(shared['suffix_lengths'])}; with --shared)",
    )
    p.add_argument(
        "--prefix-cache",
        action="store_true",
        help="the engine caches prompt prefixes (without --shared; with it, the engine "
        "runs with and without)",
    )


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


def _serve_requests(parser, args, task) -> list:
    """The requests of ``args`` (none for ``task`` None: its options only checked): the
    shared-prompt workload with --shared, else the workload of prompts of different
    lengths."""
    from . import engine

    load = engine.SHARED if args.shared else engine.WORKLOAD
    n, new_tokens = args.requests or load["requests"], args.new_tokens or load["new_tokens"]
    if args.shared and args.groups > n:
        parser.error(f"--groups {args.groups} must be at most --requests {n}")
    if task is None:  # the options checked only
        return []
    if not args.shared:
        return engine.workload(args.seed, task, n, args.prompt_lengths, new_tokens)
    return engine.shared_workload(args.seed, task, n, args.groups, args.shared_length,
                                  args.suffix_lengths, new_tokens)  # fmt: skip


def _serve(parser, args) -> int:
    from . import engine, train

    prefix_cache = args.prefix_cache or args.shared
    if args.mesh and prefix_cache:
        parser.error("--mesh serves without a prefix cache: not with --shared or --prefix-cache")
    try:
        config = engine.EngineConfig(args.pages, args.page_size, args.max_sequences,
                                     args.step_tokens, prefix_cache)  # fmt: skip
    except ValueError as e:
        parser.error(re.sub(r"\b(\w+)=", lambda m: _flag(m[1]) + "=", str(e)))
    _serve_requests(parser, args, None)
    trained, run, step = train.restore(_checkpoints(parser, args))
    model = engine.with_implementation(trained, args.implementation)
    requests = _serve_requests(parser, args, run.task)
    longest = max(r.need for r in requests)
    capacity = 0 if args.shared else engine.static_capacity(requests)
    if max(longest, capacity) > config.cache_tokens:
        flags = "--shared-length, --suffix-lengths" if args.shared else "--prompt-lengths"
        parser.error(
            f"--pages {args.pages} x --page-size {args.page_size} = {config.cache_tokens} "
            f"tokens of cache cannot hold a request of {flags} and --new-tokens "
            f"({max(longest, capacity)} tokens): pass more --pages"
        )
    on_mesh = _mesh_server(parser, args, model, config, longest)
    tokens = sum(r.new_tokens for r in requests)
    lengths = sorted(len(r.prompt) for r in requests)
    shared = (f" in {args.groups} groups, whose prompts share their first "
              f"{args.shared_length} tokens" if args.shared else "")  # fmt: skip
    print(
        f"model of step {step} in {args.run}; {len(requests)} requests{shared}: prompts of "
        f"{lengths[0]}-{lengths[-1]} tokens, {min(r.new_tokens for r in requests)}-"
        f"{max(r.new_tokens for r in requests)} new tokens each, {tokens} in all"
    )
    print(f"attention: {_backend(args, run)}")
    serving = _Serving(parser, args, requests, tokens, {})
    bytes_per_token = 2 * sum(  # keys and values of every layer, float32
        b.attn.config.kv_heads * b.attn.config.head_dim * 4 for b in model.blocks
    )
    memory = config.cache_tokens * bytes_per_token / 2**20
    pool = (f"a pool of {config.pages} pages of {config.page_size} tokens ({config.cache_tokens}"
            f" tokens, {memory:.1f} MiB of keys and values), at most {config.max_sequences} "
            f"requests in flight, {config.step_tokens} tokens a step")  # fmt: skip
    if args.shared:
        failed = _compare_prefix(serving, model, config, longest, pool)
    else:
        failed = _compare_static(serving, model, config, longest, pool, capacity)
    if on_mesh is not None:
        failed += _compare_mesh(serving, on_mesh, config)
    if args.check:
        checked = requests[: args.check]
        outputs = engine.alone(model, checked)
        alone = all(outputs[r.id] == serving.results["engine"].outputs[r.id] for r in checked)
        print(
            f"the first {len(checked)} requests' tokens equal their greedy decoding alone: "
            f"{'yes' if alone else 'NO'}"
        )
        if not alone:
            failed.append("requests' tokens differ from their greedy decoding alone")
    if failed:
        print(f"FAIL: {'; '.join(failed)}")
    return 1 if failed else 0


@dataclasses.dataclass
class _Serving:
    """What ``serve``'s runs share: the command line, the requests and the tokens they
    generate, and each run's :class:`engine.Served`, by name."""

    parser: argparse.ArgumentParser
    args: argparse.Namespace
    requests: list
    tokens: int
    results: dict

    def serve(self, name: str, server, line: str, prefix_cache: bool | None = None):
        """Warms ``server`` up and serves the requests, printing ``line``, the backends
        its attention took and its tokens/s; an engine's (``prefix_cache`` not None: a
        name that starts with "engine") prompt tokens computed too, and what its prefix
        cache found."""
        from tqdm import tqdm

        args = self.args
        print(line)
        try:
            backends = server.warm_up(*(() if name.startswith("engine") else (self.requests,)))
        except ValueError as e:  # a backend asked for by name that cannot serve a call
            if args.implementation is None:
                raise
            self.parser.error(f"--implementation {args.implementation}: {e}")
        print(f"  attention served by {', '.join(backends)}")
        with tqdm(total=self.tokens, unit="tok", disable=args.no_progress, leave=False) as bar:
            served = server.run(self.requests, progress=bar.update)
        self.results[name] = served
        print(
            f"  {served.tokens} tokens in {served.seconds:.2f} s, {served.steps} steps: "
            f"{served.tokens_per_second:,.0f} tokens/s"
        )
        if prefix_cache is not None:
            cache = (f", found cached {served.cached_tokens} (prefix hits: "
                     f"{served.cached_pages} pages shared, not written again), "
                     f"{served.evictions} cached pages evicted"
                     if prefix_cache else "")  # fmt: skip
            print(f"  prompt tokens computed {served.prefill_tokens}{cache}; "
                  f"{served.peak_pages} pages held at most")  # fmt: skip
        return served

    def judge(self, line: str, miss: str, ratio: float, target: float, failed: list, *,
              at_most: bool = False) -> None:  # fmt: skip
        """Prints ``line`` (a ratio) and, unless --target is 0, its verdict: ``ratio``
        at least ``target`` (at most, ``at_most``); a miss adds ``miss`` and the target
        to ``failed``."""
        if self.args.target == 0:
            print(f"{line} (not judged: --target 0)")
            return
        met = ratio <= target if at_most else ratio >= target
        print(f"{line} (target {'<=' if at_most else '>='} {target:g}x): "
              f"{'met' if met else 'MISSED'}")  # fmt: skip
        if not met:
            failed.append(f"{miss}, {'over' if at_most else 'under'} the target {target:g}x")


def _compare_static(serving: _Serving, model, config, longest: int, pool: str,
                    capacity: int) -> list:  # fmt: skip
    """The engine, then static batches of the same memory: their ratio against --target
    and their tokens compared. Returns why the exit status is 1, one phrase each."""
    from . import engine

    server = engine.Engine(model, config, longest)
    cached = ", caching prompt prefixes" if config.prefix_cache else ""
    serving.serve("engine", server, f"continuous batching{cached}: {pool}", config.prefix_cache)
    failed = []
    if serving.args.no_static:
        return failed
    requests, results = serving.requests, serving.results
    static = engine.static_for(model, config, requests)
    serving.serve(
        "static",
        static,
        f"static batches: {static.batch} rows of a full cache of {capacity} tokens "
        f"({static.batch * capacity} tokens, <= the pool's {config.cache_tokens})",
    )
    ratio = results["engine"].tokens_per_second / results["static"].tokens_per_second
    target = engine.TARGET if serving.args.target is None else serving.args.target
    serving.judge(
        f"continuous / static batching: {ratio:.2f}x the tokens/s",
        f"continuous batching made {ratio:.2f}x the tokens/s of static batching",
        ratio, target, failed,
    )  # fmt: skip
    same = results["engine"].outputs == results["static"].outputs
    print(f"every request's tokens equal in both: {'yes' if same else 'NO'}")
    if not same:
        failed.append("continuous and static batching gave different tokens")
    return failed


def _mesh_server(parser, args, model, config, longest: int):
    """The engine on a mesh of --mesh T x D devices (None without --mesh), made before
    anything is served: too few devices, or heads that T does not divide, are one
    ``error:`` line."""
    if not args.mesh:
        return None
    from . import mesh

    tensor, groups = args.mesh
    try:
        return mesh.MeshEngine(model, config, longest, mesh.make_mesh(tensor, groups))
    except ValueError as e:
        parser.error(f"--mesh {tensor}x{groups}: {e}")


def _compare_mesh(serving: _Serving, server, config) -> list:
    """The engine on the mesh: its tokens compared with the one-device engine's.
    Returns why the exit status is 1, one phrase each."""
    tensor, groups = serving.args.mesh
    line = (f"continuous batching on a mesh of {tensor} x {groups} devices: the heads "
            f"split {tensor} ways, {groups} groups of {config.pages} pages each")  # fmt: skip
    serving.serve("engine-mesh", server, line)
    same = serving.results["engine-mesh"].outputs == serving.results["engine"].outputs
    print(f"every request's tokens equal on the mesh and on one device: {'yes' if same else 'NO'}")
    return [] if same else ["the engine on the mesh gave different tokens"]


def _compare_prefix(serving: _Serving, model, config, longest: int, pool: str) -> list:
    """The engine with its prefix cache, then without: the prompt tokens computed and
    the tokens/s against their targets, and their tokens compared. Returns why the exit
    status is 1, one phrase each."""
    from . import engine

    serving.serve("engine", engine.Engine(model, config, longest),
                  f"continuous batching, caching prompt prefixes: {pool}", True)  # fmt: skip
    plain = dataclasses.replace(config, prefix_cache=False)
    serving.serve("engine without", engine.Engine(model, plain, longest),
                  "continuous batching without the prefix cache: the same pool", False)  # fmt: skip
    cached, without = serving.results["engine"], serving.results["engine without"]
    failed = []
    prefill = cached.prefill_tokens / without.prefill_tokens
    serving.judge(
        f"prompt tokens computed with / without the prefix cache: {prefill:.2f}x",
        f"the prefix cache left {prefill:.2f}x the prompt tokens to compute",
        prefill, engine.PREFILL_TARGET, failed, at_most=True,
    )  # fmt: skip
    target = engine.PREFIX_TARGET if serving.args.target is None else serving.args.target
    ratio = cached.tokens_per_second / without.tokens_per_second
    serving.judge(
        f"with / without the prefix cache: {ratio:.2f}x the tokens/s",
        f"the prefix cache made {ratio:.2f}x the tokens/s of the engine without it",
        ratio, target, failed,
    )  # fmt: skip
    same = cached.outputs == without.outputs
    print(f"every request's tokens equal with and without: {'yes' if same else 'NO'}")
    if not same:
        failed.append("the engine gave different tokens with and without the prefix cache")
    return failed


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


def _backend(args, run) -> str:
    """The attention backend a serving command runs on, in words."""
    backend = ("nanoattn's automatic choice" if args.implementation is None
               else f"implementation={args.implementation!r}")  # fmt: skip
    return (f"{backend} (--implementation; the checkpoint was trained with "
            f"implementation={run.model.implementation!r})")  # fmt: skip


def _speculate(parser, args) -> int:
    from . import engine, generate, speculate, train

    if args.prompt_length < 2:
        parser.error(f"--prompt-length must be at least 2, got {args.prompt_length}")
    trained, run, step = train.restore(_checkpoints(parser, args))
    model = engine.with_implementation(trained, args.implementation)
    print(f"model of step {step} in {args.run}; attention: {_backend(args, run)}")
    lengths = [args.prompt_length] * args.prompts
    prompts = generate.long_prompts(run.train.seed, run.task, lengths)
    result = speculate.compare(model, prompts, args.new_tokens, nodes=args.nodes,
                               depth=args.depth)  # fmt: skip
    print(
        f"{args.prompts} prompts of {args.prompt_length} tokens, {args.new_tokens} new "
        f"tokens each, trees of at most {args.nodes} drafts {args.depth} deep:"
    )
    for b, accepted in enumerate(result.accepted):
        per_step = ",".join(map(str, accepted))
        print(f"  prompt {b}: {len(accepted)} steps, drafts accepted per step {per_step}")
    n = args.prompts * args.new_tokens
    print(
        f"tokens/s, one call a step: speculative {n / result.seconds:,.0f}, greedy "
        f"{n / result.greedy_seconds:,.0f} ({result.speedup:.2f}x); each prompt in one call: "
        f"speculative {n / result.looped_seconds:,.0f}, greedy "
        f"{n / result.looped_greedy_seconds:,.0f} ({result.looped_speedup:.2f}x); tokens "
        f"equal to greedy decoding: {'yes' if result.equal else 'NO'}"
    )
    return 0 if result.equal else 1


def _selection(parser, args) -> int:
    from . import selection, train

    model, run, step = train.restore(_checkpoints(parser, args))
    T = args.length or run.task.seq_len
    decoded = args.decoded or T - 2 - 2 * run.task.pairs
    pages = -(-T // args.page_size)
    print(
        f"model of step {step} in {args.run}; {args.sequences} held-out recall sequences of "
        f"{T} tokens ({pages} pages of {args.page_size}), {decoded} decoding steps each; "
        f"{_backend(args, run)}"
    )
    try:
        found = selection.measure(model, run.task, run.train.seed, args.sequences,
                                  args.page_size, args.select, length=args.length,
                                  decoded=args.decoded,
                                  implementation=args.implementation)  # fmt: skip
    except ValueError as e:
        parser.error(str(e).replace("decoded=", "--decoded=").replace("seq_len=", "--length="))
    print(f"  {'pages read':22}{'equal to every page':>22}{'answers right':>16}{'ms a step':>12}")
    for s in found:
        a = s.agreement
        name = "every page" if s.pages is None else f"{s.pages} and the last"
        equal = f"{a.equal}/{a.steps} {a.fraction:.2%}"
        right = f"{a.answers_right / a.answer_steps:.2%}"
        print(f"  {name:22}{equal:>22}{right:>16}{s.seconds * 1e3:>12.2f}")
    return 0


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
                    "speculate": _speculate, "quantized": _quantized,
                    "selection": _selection, "verify": _verify}  # fmt: skip
    run = commands_run[args.command]
    return run(commands[args.command], args)


if __name__ == "__main__":
    sys.exit(main())
