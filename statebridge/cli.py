"""The ``statebridge`` command line.

    statebridge demo
    statebridge keygen DIR [--name NAME] [--force]
    statebridge make-checkpoint --arch {lfm2,mamba2,lfm2-hybrid,granite-hybrid} --out DIR
                                [--preset tiny|small]
    statebridge prefill --model DIR --tp P --port N [--layout DLS] [--no-enable-prefix-caching]
                        [--prefix-checkpoint-tokens 256] [--prefix-cache-gib G]
    statebridge decode --model DIR --tp D --prefill HOST:PORT [--prefill ...] --port M
                       [--http-port H [--http-host HOST] [--api-key KEY]]
    statebridge generate --decode HOST:PORT --prompt-ids 1,2,3 [--max-new-tokens K] [--json]
    statebridge plan --model DIR_OR_CONFIG_JSON --prefill-tp P --decode-tp D --layout DLS [--json]
    statebridge bench --preset mamba2-2.7b --pairs 2x4,4x2 --layouts DLS,LDS,LSD --json FILE

Exit status of the node commands (``prefill``, ``decode``): 0 after SIGTERM/SIGINT; 2 when the
node cannot start (bad flags, checkpoint, a rank that fails to start or does not start within
``--rank-start-timeout``); 3 when a running node cannot serve any more (its rank group failed:
``--on-rank-loss exit``, a failed restart, or too many restarts) -- a supervisor (systemd,
Kubernetes) restarts it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Sequence

from statebridge.devices import DEVICE_HELP
from statebridge.errors import StatebridgeError
from statebridge.state.kv import DEFAULT_BLOCK_SIZE, DEFAULT_KV_LAYOUT, KV_LAYOUT_PRESETS
from statebridge.state.layout import LAYOUT_PRESETS
from statebridge.state.plan import TransferPlan
from statebridge.state.spec import StateSpec

__all__ = ["main", "EXIT_START_FAILED", "EXIT_NODE_FAILED"]

#: Exit status of a node command that could not start; of a node that failed while serving.
EXIT_START_FAILED = 2
EXIT_NODE_FAILED = 3

#: ``make-checkpoint --arch`` choices: the keys of :data:`statebridge.models.checkpoint.ARCHS`
#: (spelled out so that building the parser does not import the model runtime; a test checks
#: that the two agree).
CHECKPOINT_ARCHS = ("lfm2", "mamba2", "lfm2-hybrid", "granite-hybrid")
#: ``decode --front-door`` choices (:attr:`statebridge.config.NodeConfig.FRONT_DOORS`).
NODE_FRONT_DOORS = ("auto", "on", "off")


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
               "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def _device(text: str) -> str:
    """``--device``: auto, cpu, cuda or cuda:N (statebridge.devices), normalised."""
    from statebridge.devices import DeviceSpec

    try:
        return str(DeviceSpec.parse(text))
    except StatebridgeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _byte_size(text: str) -> int:
    """``1073741824``, ``512MiB``, ``2G``... (binary units) -> bytes."""
    body = text.strip().lower()
    number = body.rstrip("kmgib")
    unit = body[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _SIZE_UNITS or not value > 0:
        raise argparse.ArgumentTypeError(f"expected a size like 268435456, 256MiB or 1GiB, got "
                                         f"{text!r}")
    return int(value * _SIZE_UNITS[unit])


def _number_type(name: str, parse: Callable[[str], Any], what: str,
                 accept: Callable[[Any], bool]) -> Callable[[str], Any]:
    """An argparse ``type``: ``parse(text)`` if it parses and ``accept`` takes it, else an
    error "expected {what}, got {text!r}"."""
    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    convert.__name__ = convert.__qualname__ = name
    return convert


_positive_int = _number_type("_positive_int", int, "a positive integer", lambda v: v >= 1)
_positive_float = _number_type("_positive_float", float, "a positive number",
                               lambda v: 0 < v < float("inf"))
_non_negative_int = _number_type("_non_negative_int", int, "a non-negative integer",
                                 lambda v: v >= 0)


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
                   help="state dtype (default: the config's dtype, else torch_dtype)")
    p.add_argument("--ssm-dtype", default=None,
                   help="SSM state dtype alone, e.g. float32 (default: --dtype)")
    p.add_argument("--kv-dtype", default=None,
                   help="attention KV dtype (default: --dtype)")
    p.add_argument("--prompt-len", type=_non_negative_int, default=None, metavar="N",
                   help="tokens of KV a request carries (hybrid models: the KV part of the plan "
                        "depends on it)")
    p.add_argument("--kv-layout", default=DEFAULT_KV_LAYOUT,
                   help=f"KV block layout of both sides: {', '.join(KV_LAYOUT_PRESETS)} or an "
                        f"order of BHLCTE ending in E (default: {DEFAULT_KV_LAYOUT})")
    p.add_argument("--decode-kv-layout", default=None,
                   help="KV block layout of the decode side when it differs (default: "
                        "--kv-layout)")
    p.add_argument("--block-size", type=_positive_int, default=DEFAULT_BLOCK_SIZE,
                   help=f"tokens per KV block (default {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args: argparse.Namespace) -> int:
    spec = StateSpec.from_pretrained(args.model, dtype=args.dtype, ssm_dtype=args.ssm_dtype,
                                     kv_dtype=args.kv_dtype)
    plan = TransferPlan.build(spec, args.prefill_tp, args.layout, args.decode_tp,
                              args.decode_layout)
    summary = plan.summary()
    kv = None
    if spec.kv is not None and args.prompt_len is not None:
        kv = _kv_summary(spec, args)
        summary["kv"] = kv
        summary["total_messages_per_request"] = summary["messages_per_request"] + kv["kv_runs"]
        summary["total_bytes_per_request"] = summary["bytes_per_request"] + kv["kv_bytes"]
    elif spec.kv is not None:
        summary["kv"] = None
        summary["note"] = _KV_NOTE.format(layers=spec.kv.num_layers)
    summary["prefix_cache"] = prefix = _prefix_summary(spec, args, summary["src"]["page_size"])
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"model {spec.model_type}: {spec.num_state_layers} recurrent-state layers, "
          f"{spec.bytes_per_request():,} state bytes per request at TP=1")
    if spec.kv is not None and kv is None:
        print(summary["note"])
        print("recurrent state alone (without KV):")
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
    if kv is not None:
        print(f"attention KV: {spec.kv.num_layers} layers x {spec.kv.num_kv_heads} KV heads x "
              f"{spec.kv.head_dim}, {args.prompt_len} tokens = {kv['blocks']} blocks of "
              f"{kv['block_size']} (layout {kv['src_layout']} -> {kv['dst_layout']}, contiguous "
              f"block tables in larger pools)")
        print(f"{'prefill':>7} {'decode':>6} {'KV runs':>8} {'KV bytes':>14}")
        for pair in kv["pairs"]:
            print(f"{pair['src_rank']:>7} {pair['dst_rank']:>6} {pair['kv_runs']:>8} "
                  f"{pair['kv_bytes']:>14,}")
        print(f"total KV per request: {kv['kv_runs']} runs, {kv['kv_bytes']:,} bytes; "
              f"with the recurrent state: {summary['total_messages_per_request']} messages, "
              f"{summary['total_bytes_per_request']:,} bytes")
    line = (f"prefix cache (prefill TP={args.prefill_tp}): one checkpoint = one page, "
            f"{prefix['checkpoint_bytes_per_rank']:,} B per rank")
    if prefix["kv_bytes_per_token_per_rank"]:
        line += (f"; cached KV {prefix['kv_bytes_per_token_per_rank']:,} B per token per rank; "
                 f"every {prefix['stride']} tokens cached (a checkpoint and their KV) take "
                 f"{prefix['bytes_per_stride_per_rank']:,} B per rank")
    print(line)
    return 0


def _prefix_summary(spec: StateSpec, args: argparse.Namespace, page_size: int) -> dict:
    """What the prefill node's prefix cache holds per rank: one checkpoint (a page of the
    prefill side's layout), the KV of one cached token (its share of the KV heads), and a
    span of 256 cached tokens (a checkpoint and their KV)."""
    kv_per_token = 0
    if spec.kv is not None:
        from statebridge.state.kv import BlockGeometry

        block = BlockGeometry(spec.kv, args.prefill_tp, args.kv_layout, args.block_size, 1)
        kv_per_token = block.bytes_per_block // args.block_size
    stride = 256                                    # a span of cached tokens, for scale
    return {"tp": args.prefill_tp, "checkpoint_bytes_per_rank": page_size,
            "kv_bytes_per_token_per_rank": kv_per_token, "stride": stride,
            "bytes_per_stride_per_rank": page_size + stride * kv_per_token}


_KV_NOTE = ("this model has {layers} attention layers: their KV depends on the prompt length; "
            "give --prompt-len N for the KV runs and bytes")


def _kv_summary(spec: StateSpec, args: argparse.Namespace) -> dict:
    from statebridge.state.kv import BlockGeometry, KVPlan, blocks_for

    # Pools larger than the request (as in serving): a table spanning a whole pool would
    # coalesce further than any real one.
    pool = 2 * blocks_for(args.prompt_len, args.block_size) + 1
    src = BlockGeometry(spec.kv, args.prefill_tp, args.kv_layout, args.block_size, pool)
    dst = BlockGeometry(spec.kv, args.decode_tp, args.decode_kv_layout or args.kv_layout,
                        args.block_size, pool)
    return KVPlan(src, dst).summary(args.prompt_len)


def _config_args(p: argparse.ArgumentParser) -> None:
    # Every default is None: an unset flag leaves the value to STATEBRIDGE_* variables
    # (ConnectorConfig.from_env) and then to the dataclass defaults, never shadowing either.
    p.add_argument("--host", default=None,
                   help="address to bind (default $STATEBRIDGE_BIND_HOST or 127.0.0.1; 0.0.0.0 "
                        "only if you mean it)")
    p.add_argument("--layout", default=None,
                   help=f"page layout: {', '.join(LAYOUT_PRESETS)} or CONV+SSM (default DLS)")
    p.add_argument("--num-pages", type=_positive_int, default=None,
                   help="state pages per rank = requests in flight (default 64)")
    p.add_argument("--peer-timeout", type=float, default=None,
                   help="seconds of silence before a peer is declared lost (default 3)")
    p.add_argument("--on-rank-loss", choices=("restart", "exit"), default=None,
                   help="when a rank process dies or goes silent: restart the node's rank "
                        "group (requests in flight fail; default), or exit with status 3 for a "
                        "supervisor to restart the node. A failed restart, or the 4th within "
                        "10 minutes, exits too")
    p.add_argument("--rank-start-timeout", type=float, default=None, metavar="SECONDS",
                   help="bound on starting the rank group (model load, TP rendezvous), at "
                        "start and at each restart (default 120; raise it for a checkpoint of "
                        "several GB on a cold disk)")
    p.add_argument("--verify-transfers", action=argparse.BooleanOptionalAction, default=None,
                   help="end-to-end transfer verification: the prefill node sends a checksum of "
                        "the bytes each decode rank receives, the decode node checks what "
                        "landed before the first step; a mismatch fails the request (or "
                        "recomputes it: --policy recompute) and is counted in /metrics. Give "
                        "it to BOTH nodes: a decode node that verifies refuses a prefill node "
                        "that does not (default $STATEBRIDGE_VERIFY_TRANSFERS or off)")
    p.add_argument("--max-prefill-tokens", type=_positive_int, default=None, metavar="TOKENS",
                   help="token budget of one prefill step on a rank: queued prompts run "
                        "together up to it, longer ones in chunks (default 2048)")
    p.add_argument("--ucx-error-handling", action=argparse.BooleanOptionalAction, default=None,
                   help="UCX endpoint error handling (detects dead peers in UCX, but forces TCP "
                        "lanes: much slower on one host; default $STATEBRIDGE_UCX_ERROR_HANDLING "
                        "or off)")
    p.add_argument("--kv-layout", default=None, choices=tuple(KV_LAYOUT_PRESETS),
                   help="KV block pool layout of models with attention layers (default HB: "
                        "heads outermost, the fewest transfer runs)")
    p.add_argument("--block-size", type=_positive_int, default=None,
                   help="tokens per KV block; the same on prefill and decode nodes (default 16)")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-tokens", type=_positive_int, default=None, metavar="N",
                    help="KV pool of the node in tokens: every rank holds N tokens (its share "
                         "of the KV heads), at any TP (default: 4 max-length requests, 4 x "
                         "(max prompt + max new tokens) = 49152 tokens with the default limits)")
    kv.add_argument("--kv-gib", type=_positive_float, default=None, metavar="G",
                    help="KV pool of the node in GiB, split evenly over its ranks")
    kv.add_argument("--kv-blocks", type=_positive_int, default=None,
                    help="KV blocks per rank")
    kv.add_argument("--kv-memory", type=_byte_size, default=None, metavar="SIZE",
                    help="deprecated (the tokens it holds depend on TP): KV pool bytes per rank; "
                         "use --kv-tokens or --kv-gib")
    p.add_argument("--enable-prefix-caching", dest="prefix_cache",
                   action=argparse.BooleanOptionalAction, default=None,
                   help="prefix caching (default on): the prefill node keeps recurrent-state "
                        "checkpoints and full KV blocks of the prompts it prefilled and starts "
                        "a prompt that shares their prefix from them; the decode node asks for "
                        "hits and routes each request to the prefill node holding its longest "
                        "prefix. --no-enable-prefix-caching on either node turns it off")
    p.add_argument("--device", type=_device, default=None, metavar="auto|cpu|cuda[:N]",
                   help=f"{DEVICE_HELP} (default auto)")
    p.add_argument("--rank-model", default=None, metavar="MODULE:CLASS",
                   help="the RankModel class each rank runs (swap in your own implementation; "
                        "default statebridge.node.rank_model:ModelRankModel)")
    _keys_args(p, "node")


def _keys_args(p: argparse.ArgumentParser, default_name: str) -> None:
    p.add_argument("--keys", default=None, metavar="DIR",
                   help="CurveZMQ keys directory written by `statebridge keygen` (default: "
                        "$STATEBRIDGE_KEYS_DIR; none: unauthenticated control plane)")
    p.add_argument("--key-name", default=None, metavar="NAME",
                   help=f"the key pair in DIR this process dials with (default {default_name})")


def _config(args: argparse.Namespace):
    from statebridge.config import ConnectorConfig

    overrides = {name: value for name, value in (("bind_host", args.host),
                                                  ("ucx_error_handling", args.ucx_error_handling),
                                                  ("verify_transfers", args.verify_transfers),
                                                  ("peer_timeout", args.peer_timeout),
                                                  ("on_rank_loss", args.on_rank_loss),
                                                  ("rank_start_timeout",
                                                   args.rank_start_timeout),
                                                  ("max_prefill_tokens",
                                                   args.max_prefill_tokens))
                 if value is not None}
    if args.keys is not None:
        overrides["keys_dir"] = os.path.abspath(args.keys) if args.keys else ""
    if args.key_name is not None:
        overrides["key_name"] = args.key_name
    return ConnectorConfig.from_env(**overrides)


def _node_config(args: argparse.Namespace):
    """The node's settings: its flags where given, else the NodeConfig defaults."""
    from statebridge.config import NodeConfig

    if getattr(args, "prefix_cache", None) is False:
        given = [f"{flag} {value:g}" for flag, value in (
            ("--prefix-checkpoint-tokens", getattr(args, "prefix_stride", None)),
            ("--prefix-cache-gib", getattr(args, "prefix_cache_gib", None))) if value is not None]
        if given:
            logging.getLogger("statebridge.cli").warning(
                "%s: no effect with --no-enable-prefix-caching", ", ".join(given))
    if getattr(args, "kv_memory", None) is not None:
        logging.getLogger("statebridge.cli").warning(
            "--kv-memory is deprecated: it sizes each rank's pool in bytes, so a node at lower "
            "TP holds fewer tokens than its peer; use --kv-tokens N or --kv-gib G (per node)")
    return NodeConfig().replace(**{name: getattr(args, name, None) for name in (
        "layout", "num_pages", "max_batch", "max_prompt_len", "max_new_tokens", "policy",
        "rank_model", "kv_layout", "block_size", "kv_blocks", "kv_memory", "kv_tokens",
        "kv_gib", "device", "front_door", "prefix_cache", "prefix_stride",
        "prefix_cache_gib")})


def _http_config(args: argparse.Namespace):
    """The HTTP front door's settings (None without --http-port); STATEBRIDGE_API_KEY when
    --api-key is not given."""
    from statebridge.config import HttpConfig

    if args.http_port is None:
        return None
    return HttpConfig.from_env(port=args.http_port, host=args.http_host, api_key=args.api_key,
                               served_model_name=args.served_model_name,
                               max_body_bytes=args.max_body_bytes)


def _stop_on_signal() -> threading.Event:
    """An event set by SIGINT/SIGTERM. Installed before a node starts, so a signal that arrives
    while it starts (or right after it says ready) still shuts it down cleanly."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _wait(stop: threading.Event, fatal) -> str:
    """Until a signal (returns "") or the node fails for good (returns ``fatal()``, why)."""
    while not stop.wait(0.2):
        why = fatal()
        if why:
            return why
    return ""


def _failed(args: argparse.Namespace, why: str) -> int:
    print(f"statebridge {args.command}: the node cannot serve any more: {why}; exiting "
          f"(status {EXIT_NODE_FAILED}) for its supervisor to restart it", file=sys.stderr,
          flush=True)
    return EXIT_NODE_FAILED


def _serve_until_stopped(args: argparse.Namespace, stop: threading.Event, node: Any) -> int:
    """Wait until a signal or ``node.fatal``, close the node; the command's exit status."""
    try:
        why = _wait(stop, lambda: node.fatal)
    finally:
        node.close()
    return _failed(args, why) if why else 0


def _cmd_prefill(args: argparse.Namespace) -> int:
    from statebridge.node.prefill_node import start_prefill_node

    stop = _stop_on_signal()
    started = time.monotonic()
    node = _node_config(args)
    server = start_prefill_node(args.model, args.tp, port=args.port, node=node,
                                config=_config(args))
    print(server.group.memory_line() + _prefix_memory(server, node), flush=True)
    print(f"prefill node ready on {server.address} (TP {args.tp}, {node.layout}): ready in "
          f"{time.monotonic() - started:.1f} s", flush=True)
    return _serve_until_stopped(args, stop, server)


def _prefix_memory(server: Any, node: Any) -> str:
    """The prefix cache's share of the prefill node's pools (the memory line's end)."""
    from statebridge.node.prefill_node import prefix_memory_text

    group = server.group
    geo = group.kv_geometry
    return prefix_memory_text(node, group.tp_size, page_bytes=group.geometry.page_size,
                              num_pages=group.num_pages,
                              block_bytes=geo.bytes_per_block if geo is not None else 0,
                              num_blocks=group.num_blocks)


def _cmd_decode(args: argparse.Namespace) -> int:
    from statebridge.node.decode_node import DecodeNode

    stop = _stop_on_signal()
    node = DecodeNode(args.model, args.tp, args.prefill, port=args.port,
                      node=_node_config(args), config=_config(args), http=_http_config(args),
                      prefix_routing=args.prefix_routing)
    # Up now; it serves once a prefill node answers (it keeps dialling them meanwhile, and
    # clients asking get not_ready with the reason).
    print(node.coordinator.group.memory_line(), flush=True)
    ready, why = node.status()
    state = f"prefill {', '.join(args.prefill)}" if ready else f"not serving yet: {why}"
    if node.http is not None:
        print(f"OpenAI-compatible HTTP API on {node.http.url}/v1 (model "
              f"{node.http.model_name!r}{', API key required' if node.http.keyed else ''})",
              flush=True)
    door = node.address if node.router is not None else "HTTP only, zmq front door off"
    when = f": ready in {node.ready_after:.1f} s" if ready else ""
    print(f"decode node {'ready' if ready else 'up'} on {door} (TP {args.tp}, "
          f"{node.node_config.layout}, {state}){when}", flush=True)
    return _serve_until_stopped(args, stop, node)


def _token_list(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") \
            from None
    if not tokens:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return tokens


def _cmd_generate(args: argparse.Namespace) -> int:
    from statebridge.config import ConnectorConfig
    from statebridge.node.client import Client
    from statebridge.security import CurveKeys

    # The client's key pair is "client" unless --key-name says otherwise (STATEBRIDGE_KEY_NAME
    # names the nodes' pair); the directory comes from --keys or STATEBRIDGE_KEYS_DIR.
    config = ConnectorConfig.from_env(key_name=args.key_name or "client",
                                      **({"keys_dir": args.keys} if args.keys is not None
                                         else {}))
    keys = CurveKeys.from_config(config)
    with Client(args.decode, timeout=args.timeout, keys=keys) as client:
        if args.json:
            out = client.generate(args.prompt_ids, max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, top_p=args.top_p, seed=args.seed)
            print(json.dumps({"request_id": out.request_id, "tokens": out.tokens,
                              "ttft_s": out.ttft, "transfer_s": out.transfer_seconds,
                              "transfer_bytes": out.transfer_bytes,
                              "recomputed": out.recomputed,
                              "cached_tokens": out.cached_tokens}))
            return 0
        for msg in client.stream(args.prompt_ids, max_new_tokens=args.max_new_tokens,
                                 temperature=args.temperature, top_p=args.top_p, seed=args.seed):
            if msg.tokens:
                print(" ".join(map(str, msg.tokens)), end=" ", flush=True)
        print()
    return 0


def _cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from statebridge.models.checkpoint import make_checkpoint

    make_checkpoint(args.arch, args.out, preset=args.preset, seed=args.seed)
    print(f"wrote {args.arch} {args.preset} checkpoint to {args.out}")
    return 0


def _cmd_keygen(args: argparse.Namespace) -> int:
    from statebridge.security import generate_keys

    names = args.name or ["node"]
    written = generate_keys(args.dir, names, force=args.force)
    for path in written:
        kind = "secret" if path.endswith("_secret") else "public"
        print(f"wrote {kind} key {path}")
    print(f"nodes: --keys {args.dir} (they listen with server.key_secret and admit every *.key "
          f"in {args.dir}); a client host needs server.key and its own pair")
    return 0


def _add_keygen(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keygen", help="write CurveZMQ key pairs for an authenticated control plane",
                       description="Writes NAME.key (public) and NAME.key_secret (mode 0600) in "
                                   "DIR, and the server pair shared by all listening sockets "
                                   "(server.key, server.key_secret) when DIR has none. Nodes "
                                   "started with --keys DIR admit only peers whose public key "
                                   "is a *.key file in DIR.")
    p.add_argument("dir", metavar="DIR", help="keys directory (created with mode 0700)")
    p.add_argument("--name", action="append", default=None, metavar="NAME",
                   help="key pair to write (repeatable; default node). Use one per client, "
                        "e.g. --name client; --name server replaces the server pair (with --force)")
    p.add_argument("--force", action="store_true",
                   help="replace existing key pairs (peers holding the old keys are refused)")
    p.set_defaults(func=_cmd_keygen)


def _cmd_demo(args: argparse.Namespace) -> int:
    from statebridge.node.demo import run_demo

    return run_demo(arch=args.arch, prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
                    layout=args.layout, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                    device=args.device)


def _add_nodes(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prefill", help="run a prefill node (P rank processes + one server)")
    p.add_argument("--model", required=True, help="checkpoint directory (HF format)")
    p.add_argument("--tp", type=_positive_int, required=True, help="TP size")
    p.add_argument("--port", type=int, required=True, help="control port decode nodes connect to")
    p.add_argument("--prefix-checkpoint-tokens", dest="prefix_stride", type=_non_negative_int,
                   default=None, metavar="N",
                   help="prefix caching: keep a recurrent-state checkpoint every N prompt tokens "
                        "(default 256, independent of --block-size; 0: none), besides one at "
                        "each prompt's end and one where a prompt branches off an earlier one; "
                        "a later prompt resumes from the last checkpoint it shares")
    p.add_argument("--prefix-cache-gib", dest="prefix_cache_gib", type=_positive_float,
                   default=None, metavar="G",
                   help="prefix caching: GiB of the node's page and KV pools (split evenly over "
                        "its ranks) that cached checkpoints and KV blocks may hold; requests "
                        "in flight always win over them (default: half of each pool)")
    _config_args(p)
    p.set_defaults(func=_cmd_prefill)

    p = sub.add_parser("decode", help="run a decode node (D rank processes + the front door)")
    p.add_argument("--model", required=True, help="checkpoint directory (HF format)")
    p.add_argument("--tp", type=_positive_int, required=True, help="TP size")
    p.add_argument("--prefill", action="append", required=True, metavar="HOST:PORT",
                   help="a prefill node (repeat for several: each request goes to the one "
                        "holding the longest cached prefix of its prompt, balanced by queued "
                        "prefill tokens; round robin with --no-enable-prefix-caching)")
    p.add_argument("--port", type=int, required=True,
                   help="port of the zmq front door clients connect to (not bound when the "
                        "door is off, see --front-door)")
    p.add_argument("--front-door", choices=NODE_FRONT_DOORS, default=None,
                   help="the zmq front door: on, off (HTTP only), or auto (default): on unless "
                        "--api-key is set without --keys, since the door would let anyone who "
                        "reaches the port generate without the key")
    p.add_argument("--prefix-routing", action=argparse.BooleanOptionalAction, default=True,
                   help="with prefix caching and several --prefill nodes, send each request to "
                        "the one holding the longest cached prefix of its prompt (default); "
                        "--no-prefix-routing: round robin, for comparisons")
    p.add_argument("--max-batch", type=_positive_int, default=None,
                   help="requests per decode step (default 32)")
    p.add_argument("--max-prompt-len", type=_positive_int, default=None,
                   help="longest prompt accepted (default 8192)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=None,
                   help="most tokens a request may generate (default 4096)")
    p.add_argument("--policy", choices=("fail", "recompute"), default=None,
                   help="when a transfer fails: error to the client, or prefill locally")
    p.add_argument("--http-port", type=_non_negative_int, default=None, metavar="PORT",
                   help="also serve the OpenAI-compatible HTTP API (/v1/completions, "
                        "/v1/chat/completions, /v1/models, /health, /metrics) on PORT; needs "
                        "the checkpoint's tokenizer")
    p.add_argument("--http-host", default=None, metavar="HOST",
                   help="address the HTTP API binds (default: --host)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require Authorization: Bearer KEY on /v1/* (default "
                        "$STATEBRIDGE_API_KEY; none: open)")
    p.add_argument("--max-body-bytes", type=_byte_size, default=None, metavar="SIZE",
                   help="largest HTTP request body read; larger ones get 413 before or while "
                        "they are read (default 1MiB)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in the HTTP API (default: the checkpoint "
                        "directory's name)")
    _config_args(p)
    p.set_defaults(func=_cmd_decode)

    p = sub.add_parser("generate", help="send a prompt to a decode node and print the tokens")
    p.add_argument("--decode", required=True, metavar="HOST:PORT")
    p.add_argument("--prompt-ids", type=_token_list, required=True, help="e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=_positive_int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--json", action="store_true", help='print one JSON object ("tokens": [...])')
    _keys_args(p, "client")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("make-checkpoint", help="write a small random HF-format checkpoint")
    p.add_argument("--arch", choices=CHECKPOINT_ARCHS, required=True,
                   help="lfm2 (ShortConv only), mamba2, lfm2-hybrid (LFM2 with attention "
                        "layers, LFM2-1.2B's pattern) or granite-hybrid (dense Granite-4.0-H: "
                        "Mamba2 with sparse attention)")
    p.add_argument("--out", required=True)
    p.add_argument("--preset", choices=("tiny", "small", "vllm"), default="tiny",
                   help="tiny, small, or vllm (tiny shapes with 32-wide attention heads, which "
                        "vLLM's CPU attention kernel needs)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_make_checkpoint)

    p = sub.add_parser("demo", help="tiny checkpoint, prefill TP=2 + decode TP=4 on localhost, "
                                    "checked against a single-process run")
    p.add_argument("--arch", choices=CHECKPOINT_ARCHS, default="lfm2-hybrid",
                   help="the tiny checkpoint served (default lfm2-hybrid: LFM2 with attention "
                        "layers, so recurrent state and KV move)")
    p.add_argument("--prefill-tp", type=_positive_int, default=2)
    p.add_argument("--decode-tp", type=_positive_int, default=4)
    p.add_argument("--layout", default="DLS")
    p.add_argument("--prompts", type=_positive_int, default=4)
    p.add_argument("--max-new-tokens", type=_positive_int, default=8)
    p.add_argument("--device", type=_device, default="cpu", metavar="auto|cpu|cuda[:N]",
                   help="both nodes' --device and the single-process run's (default cpu)")
    p.set_defaults(func=_cmd_demo)


def _cmd_proxy(args: argparse.Namespace) -> int:
    from statebridge.node.proxy import Proxy, serve

    proxy = Proxy(args.prefill, args.decode, model_dir=args.model, block_size=args.block_size,
                  routing=args.prefix_routing)
    serve(proxy, args.host, args.port)
    return 0


def _add_proxy(sub) -> None:
    p = sub.add_parser("proxy", help="the OpenAI API in front of `vllm serve` prefill and decode "
                                     "instances running StatebridgeConnector")
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a prefill instance (kv_producer), e.g. http://127.0.0.1:8100; repeat")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a decode instance (kv_consumer); repeat")
    p.add_argument("--port", type=_positive_int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="the checkpoint (its tokenizer): route each request to the prefill "
                        "instance caching the longest prefix of its prompt (else round robin)")
    p.add_argument("--block-size", type=_positive_int, default=32,
                   help="the instances' --block-size (prefix hashing granularity)")
    p.add_argument("--prefix-routing", action=argparse.BooleanOptionalAction, default=True)
    p.set_defaults(func=_cmd_proxy)


def _cmd_check_gpu(args: argparse.Namespace) -> int:
    from statebridge.gpucheck import main

    return main(args.out, parts=args.parts)


def _add_check_gpu(sub: argparse._SubParsersAction) -> None:
    from statebridge.gpucheck import default_parts

    names = [p.name for p in default_parts(".")]
    p = sub.add_parser("check-gpu", help="the device check on a GPU machine (a few minutes): "
                                         "CUDA tests, the runner vs transformers, two nodes on "
                                         "one GPU, the device-memory gather benchmark")
    p.add_argument("--out", default="report.json", help="the JSON report (default report.json)")
    p.add_argument("--part", dest="parts", action="append", choices=names,
                   help="run only this part (repeatable; default all)")
    p.set_defaults(func=_cmd_check_gpu)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="statebridge", description=__doc__.split("\n")[1])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_nodes(sub)
    _add_plan(sub)
    _add_keygen(sub)
    _add_check_gpu(sub)
    _add_proxy(sub)
    from statebridge.bench import hetero_tp

    hetero_tp.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * args.verbose
    if args.command in ("prefill", "decode"):
        # A node says what it is doing while it starts (phases, weights, capacity): INFO
        # unless -vv asks for more.
        level = min(level, logging.INFO)
    logging.basicConfig(level=level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except StatebridgeError as e:
        print(f"statebridge {args.command}: error: {e}", file=sys.stderr)
        return EXIT_START_FAILED


if __name__ == "__main__":
    sys.exit(main())
