"""The ``statebridge`` command line.

    statebridge plan --model DIR_OR_CONFIG_JSON --prefill-tp P --decode-tp D --layout DLS [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Sequence

from statebridge.errors import StatebridgeError
from statebridge.state.layout import LAYOUT_PRESETS
from statebridge.state.plan import TransferPlan
from statebridge.state.spec import StateSpec

__all__ = ["main"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="print the transfer plan between a prefill and a decode TP group",
                       description="Per (prefill rank, decode rank): runs and bytes moved for one "
                                   "request, and totals.")
    p.add_argument("--model", required=True,
                   help="checkpoint directory or config.json (LFM2 or Mamba2, Hugging Face format)")
    p.add_argument("--prefill-tp", type=_positive_int, required=True, help="prefill TP size")
    p.add_argument("--decode-tp", type=_positive_int, required=True, help="decode TP size")
    p.add_argument("--layout", default="DLS",
                   help=f"page layout of both sides: {', '.join(LAYOUT_PRESETS)} or CONV+SSM "
                        f"orders like LDS+HLPN (default: DLS)")
    p.add_argument("--decode-layout", default=None,
                   help="page layout of the decode side when it differs (default: --layout)")
    p.add_argument("--dtype", default=None,
                   help="state dtype (default: the config's torch_dtype)")
    p.add_argument("--ssm-dtype", default=None,
                   help="SSM state dtype alone, e.g. float32 (default: --dtype)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args: argparse.Namespace) -> int:
    spec = StateSpec.from_pretrained(args.model, dtype=args.dtype, ssm_dtype=args.ssm_dtype)
    plan = TransferPlan.build(spec, args.prefill_tp, args.layout, args.decode_tp,
                              args.decode_layout)
    summary = plan.summary()
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"model {spec.model_type}: {spec.num_state_layers} state layers, "
          f"{spec.bytes_per_request():,} state bytes per request at TP=1")
    for name, side in (("prefill", summary["src"]), ("decode", summary["dst"])):
        print(f"{name}: TP={side['tp']} layout={side['layout']} page={side['page_size']:,} B "
              f"(state {side['data_bytes']:,} B)")
    print(f"{'prefill':>7} {'decode':>6} {'runs':>8} {'bytes':>14} {'staged':>6}")
    for pair in summary["pairs"]:
        print(f"{pair['src_rank']:>7} {pair['dst_rank']:>6} {pair['runs']:>8} "
              f"{pair['bytes']:>14,} {'yes' if pair['staged'] else 'no':>6}")
    print(f"total per request: {summary['messages_per_request']} messages, "
          f"{summary['bytes_per_request']:,} bytes, "
          f"{summary['staging_bytes_per_request']:,} staging bytes")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="statebridge", description=__doc__.split("\n")[1])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plan(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * args.verbose,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except StatebridgeError as e:
        print(f"statebridge {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
