"""``nanoattn verify MODULE:OBJECT``: check any attention function for causality."""

import importlib
import inspect
import json
import os
import sys

from .._validate import describe
from ..verify import check_causality
from ..verify._causality import DEFAULT_SEQ_LENS
from ._common import UsageError, int_list


def add_parser(commands) -> None:
    verify = commands.add_parser(
        "verify",
        help="prove that an attention function hides the future",
        description="Import OBJECT from MODULE (a callable fn(x) -> y on float32 (B, T, D) "
        "inputs in evaluation mode, or a zero-argument factory returning one) and run "
        "nanoattn.verify.check_causality on it. Exit status 0 when every check passes, 1 when "
        "one fails, 2 when the target cannot be imported or called or an option is bad.",
    )
    verify.add_argument(
        "target",
        metavar="MODULE:OBJECT",
        help="e.g. mypkg.layers:make_attention (the current directory is importable)",
    )
    verify.add_argument("--d-model", type=int, required=True, help="input width D")
    verify.add_argument(
        "--seq-lens",
        type=int_list,
        default=list(DEFAULT_SEQ_LENS),
        help="lengths to test (default " + ",".join(map(str, DEFAULT_SEQ_LENS)) + ")",
    )
    verify.add_argument("--batch", type=int, default=2, help="batch size (default 2)")
    verify.add_argument(
        "--atol", type=float, default=1e-5, help="tolerance for unchanged outputs (default 1e-5)"
    )
    verify.add_argument("--json", action="store_true", help="print machine-readable JSON")
    verify.set_defaults(run=run)


def load_target(target: str):
    """Imports ``MODULE:OBJECT`` and returns the function to check."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"target must look like MODULE:OBJECT, got {target!r}")
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
    if not callable(obj):
        raise UsageError(f"{target} is a {type(obj).__name__}, not a callable")
    if _takes_no_arguments(obj):
        try:
            obj = obj()
        except Exception as e:
            raise UsageError(f"calling the factory {target}() failed: {describe(e)}") from None
        if not callable(obj):
            raise UsageError(
                f"the factory {target}() returned a {type(obj).__name__}, not a callable"
            )
    return obj


def _takes_no_arguments(obj) -> bool:
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return False
    return not any(
        p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        for p in params
    )


def run(args) -> int:
    if args.d_model < 1 or args.batch < 1:
        raise UsageError(f"--d-model and --batch must be >= 1, got {args.d_model}, {args.batch}")
    if not args.seq_lens or min(args.seq_lens) < 1:
        raise UsageError(f"--seq-lens must be lengths >= 1, got {args.seq_lens}")
    if not args.atol >= 0:
        raise UsageError(f"--atol must be >= 0, got {args.atol}")
    fn = load_target(args.target)
    try:
        report = check_causality(
            fn, d_model=args.d_model, seq_lens=args.seq_lens, batch=args.batch, atol=args.atol
        )
    except Exception as e:
        raise UsageError(f"calling {args.target} failed: {describe(e)}") from None
    if args.json:
        print(json.dumps({"target": args.target, **report.to_dict()}, indent=2))
    else:
        print(
            f"nanoattn verify {args.target} (d_model {args.d_model}, batch {args.batch}, "
            f"lengths {','.join(map(str, args.seq_lens))})"
        )
        print(report)
    return 0 if report.passed else 1
