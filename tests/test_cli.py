"""The installed `statebridge` console script."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from statebridge.state.plan import TransferPlan
from statebridge.state.spec import StateSpec

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"


def run_script(*args: str) -> subprocess.CompletedProcess:
    """The installed console script, in a process of its own."""
    exe = shutil.which("statebridge")
    cmd = [exe] if exe else [sys.executable, "-m", "statebridge.cli"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120)


def run(*args: str) -> subprocess.CompletedProcess:
    """``statebridge ARGS`` in this process (the script's own ``main``; a process each would
    spend a second or more importing torch): its exit status, stdout and stderr."""
    from statebridge.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:                       # argparse's errors exit 2
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("model,p,d,layout", [("mamba2-2.7b.json", 2, 4, "DLS"),
                                              ("lfm2-1.2b.json", 1, 4, "LSD"),
                                              ("mamba2-2.7b.json", 4, 2, "LDS")])
def test_plan_json(model, p, d, layout):
    out = run("plan", "--model", str(CONFIGS / model), "--prefill-tp", str(p),
              "--decode-tp", str(d), "--layout", layout, "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    plan = TransferPlan.build(StateSpec.from_pretrained(CONFIGS / model), p, layout, d)
    assert summary["messages_per_request"] == sum(len(x.runs) for x in plan)
    assert summary["messages_per_request"] == sum(pair["runs"] for pair in summary["pairs"])
    assert summary["bytes_per_request"] == sum(pair["bytes"] for pair in summary["pairs"])
    assert summary["bytes_per_request"] == d * plan.dst.data_bytes
    assert {(x["src_rank"], x["dst_rank"]) for x in summary["pairs"]} == set(plan.pairs)


def test_plan_table_and_directory_model(tmp_path):
    (tmp_path / "config.json").write_text((CONFIGS / "lfm2-1.2b.json").read_text())
    out = run_script("plan", "--model", str(tmp_path), "--prefill-tp", "2", "--decode-tp", "1")
    assert out.returncode == 0, out.stderr
    assert "10 recurrent-state layers" in out.stdout
    assert "total per request: 2 messages, 81,920 bytes" in out.stdout
    # LFM2-1.2B has 6 attention layers: without --prompt-len the plan says KV is missing.
    assert "6 attention layers: their KV depends on the prompt length" in out.stdout


# LFM2-1.2B: 6 attention layers x 8 KV heads x 64 x bf16 = 12,288 KV bytes per token (TP=1).
KV_BYTES_PER_TOKEN = 6 * 2 * 8 * 64 * 2


@pytest.mark.parametrize("p,d,kv_layout,tokens,runs", [
    (1, 4, "HB", 1024, 4 * 2),        # 4 pairs x 2 heads each: one run per head
    (4, 1, "HB", 1024, 4 * 2),
    (2, 4, "HB", 1024, 4 * 2),
    (1, 4, "BH", 1024, 4 * 64),       # one run per block (the source holds more heads)
    (2, 2, "BH", 1024, 2),            # equal TP: the whole table is one run per pair
    (1, 4, "HB", 1, 4 * 2),           # a 1-token prompt moves one whole block
    (1, 4, "HB", 17, 4 * 2),
])
def test_plan_prompt_len_adds_kv(p, d, kv_layout, tokens, runs):
    out = run("plan", "--model", str(CONFIGS / "lfm2-1.2b.json"), "--prefill-tp", str(p),
              "--decode-tp", str(d), "--prompt-len", str(tokens), "--kv-layout", kv_layout,
              "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    kv = summary["kv"]
    blocks = -(-tokens // 16)
    assert kv["blocks"] == blocks and kv["block_size"] == 16
    assert kv["kv_bytes"] == blocks * 16 * KV_BYTES_PER_TOKEN           # whole blocks move
    assert kv["kv_runs"] == runs == sum(x["kv_runs"] for x in kv["pairs"])
    assert summary["total_messages_per_request"] == summary["messages_per_request"] + runs
    assert summary["total_bytes_per_request"] == summary["bytes_per_request"] + kv["kv_bytes"]


def test_plan_kv_runs_do_not_grow_with_layers_in_the_heads_outermost_layout(tmp_path):
    config = json.loads((CONFIGS / "lfm2-1.2b.json").read_text())
    config["layer_types"] = ["conv", "full_attention"] * 8                # 8 attention layers
    (tmp_path / "config.json").write_text(json.dumps(config))
    def kv_runs(model, layout):
        out = run("plan", "--model", str(model), "--prefill-tp", "1", "--decode-tp", "4",
                  "--prompt-len", "1024", "--kv-layout", layout, "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["kv"]["kv_runs"]
    assert kv_runs(tmp_path, "HB") == kv_runs(CONFIGS / "lfm2-1.2b.json", "HB") == 8
    assert kv_runs(tmp_path, "LH") > kv_runs(CONFIGS / "lfm2-1.2b.json", "LH")


@pytest.mark.parametrize("args,needle", [
    (["--prefill-tp", "3", "--decode-tp", "1"], "not divisible by TP size 3"),
    (["--prefill-tp", "1", "--decode-tp", "2", "--layout", "XYZ"], "unknown layout 'XYZ'"),
    (["--prefill-tp", "0", "--decode-tp", "2"], "'0'"),
])
def test_plan_errors_exit_nonzero_with_the_value(args, needle):
    out = run("plan", "--model", str(CONFIGS / "lfm2-1.2b.json"), *args)
    assert out.returncode == 2
    assert needle in out.stderr and "Traceback" not in out.stderr


def test_plan_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    out = run("plan", "--model", str(tmp_path), "--prefill-tp", "1", "--decode-tp", "1")
    assert out.returncode == 2 and "'llama'" in out.stderr



def test_keygen_writes_keys_and_refuses_overwrite(tmp_path, capsys):
    """In-process (main()), the subprocess path is the same parser; one subprocess run below."""
    import stat

    import zmq.auth

    from statebridge.cli import main

    keys = tmp_path / "keys"
    assert main(["keygen", str(keys), "--name", "node", "--name", "client"]) == 0
    out = capsys.readouterr().out
    for name in ("server", "node", "client"):
        assert f"wrote public key {keys / name}.key" in out
        assert f"wrote secret key {keys / name}.key_secret" in out
        assert stat.S_IMODE((keys / f"{name}.key_secret").stat().st_mode) == 0o600
        public, secret = zmq.auth.load_certificate(keys / f"{name}.key_secret")
        assert len(public) == 40 and len(secret) == 40
    before = (keys / "client.key").read_bytes()
    assert main(["keygen", str(keys), "--name", "client"]) == 2
    assert f"{keys / 'client.key'} exists; refusing to overwrite" in capsys.readouterr().err
    assert (keys / "client.key").read_bytes() == before
    assert main(["keygen", str(keys), "--name", "client", "--force"]) == 0
    assert (keys / "client.key").read_bytes() != before


def test_generate_names_a_missing_keys_dir(tmp_path):
    missing = tmp_path / "nowhere"
    out = run("generate", "--decode", "127.0.0.1:1", "--prompt-ids", "1", "--keys", str(missing))
    assert out.returncode == 2 and str(missing) in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("command", ["prefill", "decode"])
def test_unset_flags_leave_the_environment_in_charge(command, monkeypatch):
    from statebridge.cli import _config, _node_config, build_parser

    base = [command, "--model", "m", "--tp", "1", "--port", "1"]
    if command == "decode":
        base += ["--prefill", "127.0.0.1:2"]
    monkeypatch.setenv("STATEBRIDGE_BIND_HOST", "127.0.0.2")
    monkeypatch.setenv("STATEBRIDGE_UCX_ERROR_HANDLING", "1")
    monkeypatch.setenv("STATEBRIDGE_PEER_TIMEOUT", "7")
    config = _config(build_parser().parse_args(base))
    assert (config.bind_host, config.ucx_error_handling, config.peer_timeout) == \
        ("127.0.0.2", True, 7.0)
    flags = base + ["--host", "127.0.0.3", "--no-ucx-error-handling", "--peer-timeout", "2"]
    config = _config(build_parser().parse_args(flags))
    assert (config.bind_host, config.ucx_error_handling, config.peer_timeout) == \
        ("127.0.0.3", False, 2.0)
    node = _node_config(build_parser().parse_args(base + ["--num-pages", "5"]))
    assert (node.layout, node.num_pages, node.policy) == ("DLS", 5, "fail")


@pytest.mark.parametrize("command", ["prefill", "decode"])
def test_max_prefill_tokens_reaches_the_config(command, monkeypatch, capsys):
    from statebridge.cli import _config, build_parser

    base = [command, "--model", "m", "--tp", "1", "--port", "1"]
    if command == "decode":
        base += ["--prefill", "127.0.0.1:2"]
    assert _config(build_parser().parse_args(base)).max_prefill_tokens == 2048
    monkeypatch.setenv("STATEBRIDGE_MAX_PREFILL_TOKENS", "512")
    assert _config(build_parser().parse_args(base)).max_prefill_tokens == 512
    config = _config(build_parser().parse_args(base + ["--max-prefill-tokens", "96"]))
    assert config.max_prefill_tokens == 96
    with pytest.raises(SystemExit):
        build_parser().parse_args(base + ["--max-prefill-tokens", "0"])
    assert "--max-prefill-tokens" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["prefill", "decode"])
def test_supervision_flags_reach_the_config(command, monkeypatch, capsys):
    from statebridge.cli import _config, build_parser

    base = [command, "--model", "m", "--tp", "1", "--port", "1"]
    if command == "decode":
        base += ["--prefill", "127.0.0.1:2"]
    config = _config(build_parser().parse_args(base))
    assert (config.on_rank_loss, config.rank_start_timeout) == ("restart", 120.0)
    monkeypatch.setenv("STATEBRIDGE_ON_RANK_LOSS", "exit")
    monkeypatch.setenv("STATEBRIDGE_RANK_START_TIMEOUT", "30")
    config = _config(build_parser().parse_args(base))
    assert (config.on_rank_loss, config.rank_start_timeout) == ("exit", 30.0)
    config = _config(build_parser().parse_args(
        base + ["--on-rank-loss", "restart", "--rank-start-timeout", "9.5"]))
    assert (config.on_rank_loss, config.rank_start_timeout) == ("restart", 9.5)
    with pytest.raises(SystemExit):
        build_parser().parse_args(base + ["--on-rank-loss", "linger"])
    assert "invalid choice: 'linger'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["prefill", "decode"])
def test_verify_transfers_flag_reaches_the_config(command, monkeypatch):
    from statebridge.cli import _config, build_parser
    from statebridge.config import ConnectorConfig
    from statebridge.errors import ConfigError

    base = [command, "--model", "m", "--tp", "1", "--port", "1"]
    if command == "decode":
        base += ["--prefill", "127.0.0.1:2"]
    assert _config(build_parser().parse_args(base)).verify_transfers is False     # off
    assert _config(build_parser().parse_args(base + ["--verify-transfers"])).verify_transfers
    monkeypatch.setenv("STATEBRIDGE_VERIFY_TRANSFERS", "1")
    assert _config(build_parser().parse_args(base)).verify_transfers is True
    assert _config(build_parser().parse_args(
        base + ["--no-verify-transfers"])).verify_transfers is False
    with pytest.raises(ConfigError, match="verify_transfers must be a bool, got 'yes'"):
        ConnectorConfig(verify_transfers="yes")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_node_whose_ranks_do_not_start_in_time_exits_2_naming_them(tmp_path):
    import time

    from statebridge.models.checkpoint import make_checkpoint
    from statebridge.net import free_port

    model = make_checkpoint("lfm2", tmp_path / "m", tokenizer=False)
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "statebridge.cli", "prefill", "--model",
                          str(model), "--tp", "1", "--port", str(free_port()),
                          "--rank-start-timeout", "3",
                          "--rank-model", "tests.connector._helpers:HangingModel"],
                         capture_output=True, text=True, timeout=100,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "ranks [0] did not start within 3 s" in out.stderr
    assert time.monotonic() - start < 60


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
@pytest.mark.parametrize("command", ["prefill", "decode"])
def test_a_node_asked_for_cuda_without_a_gpu_exits_2_before_any_rank_starts(tmp_path, command):
    from statebridge.models.checkpoint import make_checkpoint
    from statebridge.net import free_port

    model = make_checkpoint("lfm2", tmp_path / "m", tokenizer=False)
    extra = ["--prefill", f"127.0.0.1:{free_port()}"] if command == "decode" else []
    out = subprocess.run([sys.executable, "-m", "statebridge.cli", command, "--model",
                          str(model), "--tp", "2", "--port", str(free_port()), "--device",
                          "cuda:1", *extra],
                         capture_output=True, text=True, timeout=100,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "device cuda:1 asks for CUDA, but no GPU is visible" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("arch", ["granite-hybrid", "lfm2-hybrid"])
def test_make_checkpoint_hybrid_arch(tmp_path, arch):
    from statebridge.hf_config import ModelConfig

    out = run("make-checkpoint", "--arch", arch, "--out", str(tmp_path / "ckpt"))
    assert out.returncode == 0, out.stderr
    assert f"wrote {arch} tiny checkpoint" in out.stdout
    config = ModelConfig.load(tmp_path / "ckpt")
    expected = {"granite-hybrid": "granitemoehybrid", "lfm2-hybrid": "lfm2"}[arch]
    assert config.model_type == expected and config.attention_layers
    assert StateSpec.from_pretrained(tmp_path / "ckpt").kv is not None   # KV moves too
    # an unknown arch names the value and the choices
    bad = run("make-checkpoint", "--arch", "granite", "--out", str(tmp_path / "bad"))
    assert bad.returncode != 0 and "'granite'" in bad.stderr and "granite-hybrid" in bad.stderr


def test_make_checkpoint_arch_choices_are_the_writers():
    from statebridge.cli import CHECKPOINT_ARCHS
    from statebridge.models.checkpoint import ARCHS, PRESETS

    assert list(CHECKPOINT_ARCHS) == list(ARCHS)
    assert {preset for _, preset in PRESETS} == {"tiny", "small", "vllm"}
    assert set(PRESETS) == {(a, p) for a in ARCHS for p in ("tiny", "small", "vllm")}


def test_vllm_presets_have_attention_heads_vllm_cpu_serves():
    from statebridge.hf_config import ModelConfig
    from statebridge.models.checkpoint import ARCHS, _preset_config

    for arch in ARCHS:
        config = _preset_config(arch, "vllm", "float32", None)
        heads = config.get("num_attention_heads")
        if heads and "full_attention" in config.get("layer_types", ()):
            assert config["hidden_size"] // heads >= 32, arch     # vLLM CPU: head_dim >= 32
        if config["model_type"] == "lfm2":                        # vLLM's Lfm2Config reads them
            assert config["conv_dim"] == config["block_dim"] == config["hidden_size"]
        ModelConfig.from_dict(config)                             # statebridge reads it


@pytest.mark.parametrize("command", ["prefill", "decode"])
def test_kv_pool_flags_reach_the_node_config(command):
    from statebridge.cli import _node_config, build_parser

    base = [command, "--model", "m", "--tp", "1", "--port", "1"]
    if command == "decode":
        base += ["--prefill", "127.0.0.1:2"]
    node = _node_config(build_parser().parse_args(base))
    # No size given: every size is unset (0) and the pool holds the default tokens.
    assert (node.kv_layout, node.block_size, node.kv_blocks, node.kv_memory, node.kv_tokens,
            node.kv_gib) == ("HB", 16, 0, 0, 0, 0.0)
    assert _node_config(build_parser().parse_args(
        base + ["--kv-tokens", "5000"])).kv_tokens == 5000
    assert _node_config(build_parser().parse_args(base + ["--kv-gib", "1.5"])).kv_gib == 1.5
    node = _node_config(build_parser().parse_args(
        base + ["--kv-layout", "LH", "--block-size", "32", "--kv-memory", "1.5GiB"]))
    assert (node.kv_layout, node.block_size, node.kv_memory) == ("LH", 32, 3 << 29)
    assert _node_config(build_parser().parse_args(base + ["--kv-blocks", "77"])).kv_blocks == 77
    assert _node_config(build_parser().parse_args(
        base + ["--kv-memory", "4096"])).kv_memory == 4096


@pytest.mark.parametrize("command", ["prefill", "decode"])
def test_the_device_flag_reaches_the_node_config(command):
    from statebridge.cli import _node_config, build_parser

    base = [command, "--model", "m", "--tp", "1", "--port", "1"]
    if command == "decode":
        base += ["--prefill", "127.0.0.1:2"]
    assert _node_config(build_parser().parse_args(base)).device == "auto"
    for flag, expected in (("cpu", "cpu"), ("CUDA", "cuda"), ("cuda:3", "cuda:3")):
        assert _node_config(build_parser().parse_args(base + ["--device", flag])).device == \
            expected


@pytest.mark.parametrize("flag,value,needle", [
    ("--device", "gpu", "'gpu'"), ("--device", "cpu:1", "'cpu:1'"),
    ("--kv-memory", "lots", "'lots'"), ("--kv-memory", "0MiB", "'0MiB'"),
    ("--kv-tokens", "0", "'0'"), ("--kv-tokens", "-5", "'-5'"), ("--kv-gib", "nan", "'nan'"),
    ("--kv-gib", "0", "'0'"),
    ("--kv-blocks", "0", "0"), ("--block-size", "-4", "-4"), ("--kv-layout", "XY", "'XY'")])
def test_bad_kv_pool_flags_exit_nonzero_naming_the_value(flag, value, needle, capsys):
    from statebridge.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["decode", "--model", "m", "--tp", "1", "--prefill",
                                   "127.0.0.1:2", flag, value])
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_kv_pool_size_from_the_memory_budget_names_what_does_not_fit(tmp_path):
    from statebridge.config import NodeConfig
    from statebridge.errors import ConfigError
    from statebridge.models.checkpoint import make_checkpoint
    from statebridge.state.kv import BlockGeometry

    spec = StateSpec.from_pretrained(make_checkpoint("granite-hybrid", tmp_path / "g"))
    per_block = BlockGeometry(spec.kv, 4, "HB", 16, 1).nbytes   # one replicated KV head
    assert NodeConfig(kv_memory=10 * per_block + 5).num_blocks(spec, 4) == 10
    assert NodeConfig(kv_blocks=3).num_blocks(spec, 4) == 3
    with pytest.raises(ConfigError, match=rf"kv_memory=100 bytes holds no KV block of "
                                          rf"{per_block} bytes"):
        NodeConfig(kv_memory=100).num_blocks(spec, 4)
    conv_only = StateSpec.from_pretrained(make_checkpoint("lfm2", tmp_path / "l"))
    assert NodeConfig(kv_blocks=3).num_blocks(conv_only, 2) == 0


def test_http_flags_reach_the_http_config(monkeypatch):
    from statebridge.cli import _http_config, build_parser

    base = ["decode", "--model", "m", "--tp", "1", "--port", "1", "--prefill", "127.0.0.1:2"]
    assert _http_config(build_parser().parse_args(base)) is None      # no --http-port: no HTTP
    monkeypatch.setenv("STATEBRIDGE_API_KEY", "from-env")
    http = _http_config(build_parser().parse_args(base + ["--http-port", "8000"]))
    assert (http.port, http.host, http.api_key, http.served_model_name) == \
        (8000, "", "from-env", "")
    http = _http_config(build_parser().parse_args(base + [
        "--http-port", "0", "--http-host", "0.0.0.0", "--api-key", "k",
        "--served-model-name", "tiny"]))
    assert (http.port, http.host, http.api_key, http.served_model_name) == \
        (0, "0.0.0.0", "k", "tiny")
    node_args = build_parser().parse_args(base + ["--max-new-tokens", "64"])
    from statebridge.cli import _node_config

    assert _node_config(node_args).max_new_tokens == 64


def test_http_config_refuses_bad_values():
    from statebridge.config import HttpConfig
    from statebridge.errors import ConfigError

    for bad in (dict(port=70000), dict(port=True), dict(max_inflight=-1),
                dict(default_max_tokens=0), dict(node_timeout=0)):
        with pytest.raises(ConfigError):
            HttpConfig(**bad)


@pytest.mark.parametrize("command", ["prefill", "decode"])
def test_prefix_caching_flags_reach_the_node_config(command):
    from statebridge.cli import _node_config, build_parser

    base = [command, "--model", "m", "--tp", "2", "--port", "1"]
    if command == "decode":
        base += ["--prefill", "127.0.0.1:2"]
    node = _node_config(build_parser().parse_args(base))
    # On by default (vLLM's default), a checkpoint every 256 tokens, the default budget.
    assert (node.prefix_cache, node.prefix_stride, node.prefix_cache_gib) == (True, 256, 0.0)
    assert _node_config(build_parser().parse_args(
        base + ["--no-enable-prefix-caching"])).prefix_cache is False
    assert _node_config(build_parser().parse_args(
        base + ["--enable-prefix-caching"])).prefix_cache is True
    if command == "prefill":
        from statebridge.node.prefill_node import prefix_cache_bytes

        node = _node_config(build_parser().parse_args(
            base + ["--prefix-checkpoint-tokens", "64", "--prefix-cache-gib", "1.5"]))
        assert (node.prefix_stride, node.prefix_cache_gib) == (64, 1.5)
        assert prefix_cache_bytes(node, 2) == 3 << 28          # per rank: split over TP 2
        assert prefix_cache_bytes(node.replace(prefix_cache_gib=0.0), 2) is None
        assert prefix_cache_bytes(node.replace(prefix_cache=False), 2) is None
    else:
        # Routing by prefix is the decode node's (on; off: round robin, for comparisons).
        assert build_parser().parse_args(base).prefix_routing is True
        assert build_parser().parse_args(base + ["--no-prefix-routing"]).prefix_routing is False
        # The sizes are the prefill node's: the decode node has no such flags.
        with pytest.raises(SystemExit):
            build_parser().parse_args(base + ["--prefix-checkpoint-tokens", "64"])


@pytest.mark.parametrize("flag,value,needle", [
    ("--prefix-checkpoint-tokens", "-1", "'-1'"), ("--prefix-checkpoint-tokens", "-3", "'-3'"),
    ("--prefix-checkpoint-tokens", "1.5", "'1.5'"), ("--prefix-cache-gib", "0", "'0'"),
    ("--prefix-cache-gib", "inf", "'inf'"), ("--prefix-cache-gib", "lots", "'lots'")])
def test_bad_prefix_caching_flags_exit_nonzero_naming_the_value(flag, value, needle, capsys):
    from statebridge.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["prefill", "--model", "m", "--tp", "1", "--port", "1",
                                   flag, value])
    assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("field,value,needle", [
    ("prefix_stride", -1, "prefix_stride must be an integer >= 0 (0: no periodic "
                          "checkpoints), got -1"),
    ("prefix_stride", True, "got True"),
    ("prefix_cache_gib", -1.0, "prefix_cache_gib must be a positive number of GiB (0: the "
                               "default), got -1.0"),
    ("prefix_cache_gib", float("nan"), "got nan"),
    ("prefix_cache", "yes", "prefix_cache must be True or False, got 'yes'")])
def test_node_config_refuses_bad_prefix_settings(field, value, needle):
    from statebridge.config import NodeConfig
    from statebridge.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        NodeConfig(**{field: value})
    assert needle in str(e.value)


def test_prefix_cache_budget_that_holds_no_checkpoint_or_exceeds_the_pools_is_refused():
    from statebridge.config import NodeConfig
    from statebridge.errors import ConfigError
    from statebridge.node.prefill_node import check_prefix_budget

    gib = 1 << 30
    check_prefix_budget(NodeConfig(), 2, pool_bytes=10, page_bytes=1)      # default: no check
    check_prefix_budget(NodeConfig(prefix_cache_gib=1.0), 2, gib, gib // 2)
    with pytest.raises(ConfigError, match=r"prefix_cache_gib=1 gives each of the 2 ranks "
                                          r"536,870,912 B, more than its page and KV pools"):
        check_prefix_budget(NodeConfig(prefix_cache_gib=1.0), 2, gib // 4, 4096)
    with pytest.raises(ConfigError, match=r"prefix_cache_gib=1e-06 gives each of the 4 ranks "
                                          r"268 B, less than one checkpoint page of 4,096 B"):
        check_prefix_budget(NodeConfig(prefix_cache_gib=1e-6), 4, gib, 4096)
    # Off: nothing to check.
    check_prefix_budget(NodeConfig(prefix_cache=False, prefix_cache_gib=1.0), 2, 1, 1)


def test_prefix_sizes_with_the_cache_off_warn(caplog):
    from statebridge.cli import _node_config, build_parser

    args = build_parser().parse_args(["prefill", "--model", "m", "--tp", "1", "--port", "1",
                                      "--no-enable-prefix-caching", "--prefix-cache-gib", "2"])
    with caplog.at_level("WARNING", logger="statebridge.cli"):
        assert _node_config(args).prefix_cache is False
    assert "--prefix-cache-gib 2: no effect with --no-enable-prefix-caching" in caplog.text


@pytest.mark.parametrize("model,p,kv_per_token", [("lfm2-1.2b.json", 2, KV_BYTES_PER_TOKEN // 2),
                                                  ("lfm2-1.2b.json", 1, KV_BYTES_PER_TOKEN),
                                                  ("mamba2-2.7b.json", 4, 0)])
def test_plan_shows_what_the_prefix_cache_holds_per_rank(model, p, kv_per_token):
    """One checkpoint is one page of the prefill side; cached KV per token is the rank's
    share of the KV heads."""
    out = run("plan", "--model", str(CONFIGS / model), "--prefill-tp", str(p), "--decode-tp",
              "1", "--json")
    summary = json.loads(out.stdout)
    prefix = summary["prefix_cache"]
    assert prefix == {"tp": p, "checkpoint_bytes_per_rank": summary["src"]["page_size"],
                      "kv_bytes_per_token_per_rank": kv_per_token, "stride": 256,
                      "bytes_per_stride_per_rank": summary["src"]["page_size"]
                      + 256 * kv_per_token}
    text = run("plan", "--model", str(CONFIGS / model), "--prefill-tp", str(p), "--decode-tp",
               "1").stdout
    assert f"prefix cache (prefill TP={p}): one checkpoint = one page, " \
           f"{summary['src']['page_size']:,} B per rank" in text
    assert (f"cached KV {kv_per_token:,} B per token per rank" in text) == bool(kv_per_token)


def test_the_prefill_memory_line_names_the_prefix_cache_share():
    from statebridge.config import NodeConfig
    from statebridge.node.prefill_node import prefix_memory_text

    sizes = dict(page_bytes=1 << 20, num_pages=64, block_bytes=1 << 16, num_blocks=1000)
    assert prefix_memory_text(NodeConfig(), 2, **sizes) == (
        "; prefix cache (checkpoints at prompt ends, branch points and every 256 tokens): up "
        "to 32 pages + 500 KV blocks = "
        "63.2 MiB per rank of these pools")
    assert prefix_memory_text(NodeConfig(prefix_stride=0), 1, **{**sizes, "num_blocks": 0}) == (
        "; prefix cache (checkpoints at prompt ends and branch points): up to 32 pages = "
        "32.0 MiB per rank of "
        "these pools")
    assert prefix_memory_text(NodeConfig(prefix_cache_gib=1.0, prefix_stride=128), 4,
                              **sizes) == ("; prefix cache (checkpoints at prompt ends, branch "
                                           "points and every 128 tokens): up "
                                           "to 256.0 MiB (--prefix-cache-gib 1) per rank of "
                                           "these pools")
    assert prefix_memory_text(NodeConfig(prefix_cache=False), 1, **sizes) == "; prefix cache off"
