"""``nanoattn verify MODULE:OBJECT``: check any attention function, model or decoder:
causality (``check_causality``), with ``--mask MODULE:MASK_FN`` the receptive field a
mask claims (``check_mask``), or with ``--decode`` the KV-cache path
(``check_decoding``)."""

import argparse
import importlib
import inspect
import json
import os
import sys

from .._base.validate import describe
from ..verify import PagedDecoder, check_causality, check_decoding, check_mask
from ..verify.command_line import (
    CAPACITY_SLACK,
    CAUSALITY_SEQ_LENS,
    DECODE_SEQ_LEN,
    LAPS,
    MASK_SEQ_LENS,
    as_decoder,
    default_seq_len,
    raised_everywhere,
    within,
)
from . import _stages
from ._common import UsageError, add_command, int_list

CAUSALITY_ATOL = 1e-5


def add_parser(commands) -> None:
    add_command(
        commands,
        "verify",
        run,
        (_add_target, _add_checks, _add_lengths, _add_tolerance_and_output),
        help="prove that an attention function hides the future, or that a decoder's "
        "KV cache computes its full forward",
        description="Import OBJECT from MODULE and check it. By default OBJECT is a callable "
        "fn(x) -> y in evaluation mode (or a zero-argument factory returning one), x float32 "
        "(B, T, D) (--d-model D) or int token ids (B, T) (--vocab V), and "
        "nanoattn.verify.check_causality runs on it. With --mask MODULE:MASK_FN, OBJECT is a "
        "single self-attention layer and nanoattn.verify.check_mask proves that it sees exactly "
        "what MASK_FN(b, n, q_pos, k_pos) -> bool claims. With --decode, OBJECT is a decoder "
        "(full, init, step) (or a zero-argument factory returning one; "
        "nanoattn.verify.decoders builds it for nanoattn's and flax's modules; a "
        "nanoattn.verify.Decoder also brings its rewind, capacity and max_chunk; a "
        "nanoattn.verify.PagedDecoder, a paged layer's, runs through a shuffled page pool "
        "with forks and random programs of a server's allocator calls) and "
        "nanoattn.verify.check_decoding runs on it. On a terminal, a stage still running after "
        "about 2 s says on stderr what it is doing (nothing with --json). "
        "Exit status 0 when every check passes, 1 when one fails (also when the target raises "
        "at some lengths), 2 when the target cannot be imported or raises at every length, or "
        "an option is bad.",
    )


def _add_target(verify) -> None:
    """What is checked, and its inputs."""
    verify.add_argument(
        "target",
        metavar="MODULE:OBJECT",
        help="e.g. mypkg.layers:make_attention (the current directory is importable)",
    )
    verify.add_argument("--d-model", type=int, help="input width D, for float inputs (B, T, D)")
    verify.add_argument(
        "--vocab", type=int, help="vocabulary size V, for models on token ids (B, T)"
    )


def _add_checks(verify) -> None:
    """Which check runs: causality by default, --decode or --mask."""
    verify.add_argument(
        "--decode",
        action="store_true",
        help="OBJECT is a decoder (full, init, step): run check_decoding",
    )
    verify.add_argument(
        "--mask",
        metavar="MODULE:MASK_FN",
        help="OBJECT is one self-attention layer and MASK_FN(b, n, q_pos, k_pos) -> bool the "
        "mask it should realise (True = may attend; or a zero-argument factory returning it): "
        "run check_mask, which proves that each output depends on exactly the inputs MASK_FN "
        "lets it see",
    )
    verify.add_argument(
        "--n-heads",
        type=_positive_int,
        metavar="N",
        help="--mask: the query heads MASK_FN is asked about (default 1); an output sees the "
        "union of its heads' keys",
    )


def _add_lengths(verify) -> None:
    """The lengths checked: --seq-lens and --max-len, or with --decode --seq-len."""
    verify.add_argument(
        "--seq-lens",
        type=int_list,
        help="causality: lengths to test (default "
        + ",".join(map(str, CAUSALITY_SEQ_LENS))
        + "; with --mask "
        + ",".join(map(str, MASK_SEQ_LENS))
        + ")",
    )
    verify.add_argument(
        "--max-len",
        type=_positive_int,
        metavar="N",
        help="causality and --mask: try no length above N (a model with a fixed context, such as "
        "nanoGPT's block_size); without it a length where the target raises fails the check "
        "and the other lengths still run",
    )
    verify.add_argument(
        "--seq-len",
        type=int,
        help=f"--decode: the length of the decoded sequence (default {DECODE_SEQ_LEN}; "
        f"{LAPS} C + {CAPACITY_SLACK} for a Decoder with a capacity of C slots)",
    )
    verify.add_argument(
        "--one-token",
        action="store_true",
        help="--decode: the step takes one token per call (check_decoding(chunked=False))",
    )


def _add_tolerance_and_output(verify) -> None:
    """The batch, the tolerance and the output format."""
    verify.add_argument("--batch", type=int, default=2, help="batch size (default 2)")
    verify.add_argument(
        "--atol",
        type=float,
        help=f"tolerance for unchanged outputs (default {CAUSALITY_ATOL:g}; with --decode "
        "1e-5, or 3e-2 for 16-bit outputs, times the largest output, at least 1)",
    )
    verify.add_argument("--json", action="store_true", help="print machine-readable JSON")


def _positive_int(text: str) -> int:
    """Parses ``--max-len`` and ``--n-heads``: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def load_target(
    target: str, decode: bool = False, what: str = "target must look like MODULE:OBJECT"
):
    """Imports ``MODULE:OBJECT`` and returns the function (or with ``decode`` the
    decoder, as a :class:`~nanoattn.verify.Decoder`: one given whole keeps its
    ``rewind``, ``capacity`` and ``max_chunk``; a
    :class:`~nanoattn.verify.PagedDecoder` is kept as it is) to check; a zero-argument factory is
    called.
    ``what``: the start of the error for a ``target`` of another form."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"{what}, got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:
        raise UsageError(f"cannot import {module_name}: {describe(e)}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    decoder = as_decoder(obj) if decode else None
    if decoder is not None:
        return decoder
    if not callable(obj):
        wanted = "a (full, init, step) decoder" if decode else "a callable"
        raise UsageError(f"{target} is {_a(obj)}, not {wanted}")
    if _takes_no_arguments(obj):
        try:
            obj = obj()
        except Exception as e:
            raise UsageError(f"calling the factory {target}() failed: {describe(e)}") from None
        if decode and as_decoder(obj) is None:
            raise UsageError(
                f"the factory {target}() returned {_a(obj)}, not a (full, init, step) decoder"
            )
        if not decode and not callable(obj):
            raise UsageError(f"the factory {target}() returned {_a(obj)}, not a callable")
    elif decode:
        raise UsageError(f"{target} takes arguments: --decode needs a (full, init, step) decoder")
    return as_decoder(obj) if decode else obj


def _takes_no_arguments(obj) -> bool:
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return False
    return not any(
        p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        for p in params
    )


def _check_options(args) -> None:
    if (args.d_model is None) == (args.vocab is None):
        raise UsageError("give --d-model D for float inputs or --vocab V for token ids (one)")
    if args.d_model is not None and args.d_model < 1:
        raise UsageError(f"--d-model must be >= 1, got {args.d_model}")
    if args.vocab is not None and args.vocab < 2:
        raise UsageError(f"--vocab must be >= 2, got {args.vocab}")
    if args.batch < 1:
        raise UsageError(f"--batch must be >= 1, got {args.batch}")
    if args.atol is not None and not args.atol >= 0:
        raise UsageError(f"--atol must be >= 0, got {args.atol}")
    if args.mask is not None and args.decode:
        raise UsageError("--mask checks one attention layer, --decode a decoder: give one")
    if args.n_heads is not None and args.mask is None:
        raise UsageError("--n-heads only applies with --mask")
    if args.decode:
        if args.seq_lens is not None:
            raise UsageError("--seq-lens is for the causality check; with --decode use --seq-len")
        if args.max_len is not None:
            raise UsageError("--max-len is for the causality check; with --decode use --seq-len")
        if args.seq_len is not None and args.seq_len < 2:
            raise UsageError(f"--seq-len must be >= 2, got {args.seq_len}")
    else:
        for flag, value in (("--seq-len", args.seq_len), ("--one-token", args.one_token)):
            if value:
                raise UsageError(f"{flag} only applies with --decode")
        if args.seq_lens is not None and (not args.seq_lens or min(args.seq_lens) < 1):
            raise UsageError(f"--seq-lens must be lengths >= 1, got {args.seq_lens}")
        if args.seq_lens and args.max_len is not None and min(args.seq_lens) > args.max_len:
            raise UsageError(
                f"every length of --seq-lens {','.join(map(str, args.seq_lens))} exceeds "
                f"--max-len {args.max_len}"
            )


def run(args) -> int:
    _check_options(args)
    stage = _stages.on_stderr("nanoattn verify", quiet=args.json)
    with stage(f"loading {args.target}"):
        target = load_target(args.target, decode=args.decode)
    inputs = {"d_model": args.d_model, "vocab": args.vocab}
    width = f"d_model {args.d_model}" if args.vocab is None else f"vocab {args.vocab}"
    try:
        if args.decode:
            capacity = getattr(target, "capacity", None)  # a PagedDecoder has none
            seq_len = args.seq_len or default_seq_len(capacity)  # check_decoding's default
            chunked = "" if args.one_token else " and in chunks"
            with stage(f"checking decoding of {seq_len} tokens one by one{chunked}"):
                report = check_decoding(
                    target,  # whole: its rewind, capacity and max_chunk are checked too
                    **inputs,
                    seq_len=seq_len,
                    chunked=not args.one_token,
                    batch=args.batch,
                    atol=args.atol,
                )
            bound = "" if capacity is None else f", capacity {capacity}"
            if isinstance(target, PagedDecoder):
                bound = f", pages of {target.page_size}"
            what = f"--decode ({width}, batch {args.batch}, length {seq_len}{bound})"
        else:
            report, what = _check_field(args, target, inputs, width, stage)
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"calling {args.target} failed: {describe(e)}") from None
    if args.json:
        print(json.dumps({"target": args.target, **report.to_dict()}, indent=2))
    else:
        print(f"nanoattn verify {args.target} {what}")
        print(report)
    return 0 if report.passed else 1


def _check_field(args, target, inputs: dict, width: str, stage):
    """``check_causality``, or with ``--mask`` ``check_mask``, on ``target``: the report
    and what was checked, for the title line."""
    mask_fn = None
    if args.mask is not None:
        with stage(f"loading {args.mask}"):
            mask_fn = load_target(args.mask, what="--mask must look like MODULE:MASK_FN")
    defaults = CAUSALITY_SEQ_LENS if mask_fn is None else MASK_SEQ_LENS
    seq_lens = within(args.seq_lens or list(defaults), args.max_len, "seq_lens")
    common = dict(
        inputs,
        seq_lens=seq_lens,
        max_len=args.max_len,
        batch=args.batch,
        atol=CAUSALITY_ATOL if args.atol is None else args.atol,
    )
    checking = "causality" if mask_fn is None else f"the mask {args.mask}"
    with stage(f"checking {checking} at {len(seq_lens)} lengths up to {max(seq_lens)}"):
        if mask_fn is None:
            report = check_causality(target, **common)
        else:
            try:
                report = check_mask(target, mask_fn, n_heads=args.n_heads or 1, **common)
            except Exception as e:  # a bad mask_fn, or fn's output is not (B, T, ...)
                raise UsageError(
                    f"checking {args.target} against {args.mask} failed: {describe(e)}"
                ) from None
        error = raised_everywhere(report)  # at some lengths only, a check fails
        if error is not None:
            raise UsageError(f"calling {args.target} failed: {error}")
    bound = "" if args.max_len is None else f", max-len {args.max_len}"
    heads = "" if args.n_heads is None else f", {args.n_heads} heads"
    lengths = ",".join(map(str, seq_lens))
    mask = "" if mask_fn is None else f"--mask {args.mask} "
    return report, f"{mask}({width}, batch {args.batch}{heads}, lengths {lengths}{bound})"


def _a(obj) -> str:
    """The type of ``obj`` with its article: "an int", "a float"."""
    name = type(obj).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"
