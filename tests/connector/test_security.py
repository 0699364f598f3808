"""CurveZMQ on the control plane: keygen, config validation, keyed sockets, and keyed groups
that serve authorized peers and refuse the others with AuthenticationError (never a hang)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import uuid

import pytest
import zmq
import zmq.auth

from statebridge.config import ConnectorConfig
from statebridge.connector import control as c
from statebridge.connector import messages as m
from statebridge.connector.stats import Counters
from statebridge.errors import AuthenticationError, ConfigError
from statebridge.security import CurveKeys, authorized_keys, generate_keys, key_files
from statebridge.testing.probes import instrumented, probes_of

from ._helpers import FAST, SPECS, SYNTHETIC, expected_checksum, log_to_stderr, wait_until

# Handshakes get a generous bound: a refusal must come from the monitor (AuthenticationError),
# never from this timeout (TransferTimeoutError), so the test cannot pass by waiting.
KEYED = FAST.replace(handshake_timeout=60.0)


@pytest.fixture
def keys_dir(tmp_path):
    generate_keys(tmp_path / "keys", ["node", "client"])
    return str(tmp_path / "keys")


# -- keygen -------------------------------------------------------------------------------------
def test_keygen_writes_loadable_pairs_with_private_secrets(tmp_path):
    d = tmp_path / "k"
    written = generate_keys(d, ["node", "client-a"])
    names = sorted(os.path.basename(p) for p in written)
    assert names == sorted(f"{n}{ext}" for n in ("server", "node", "client-a")
                           for ext in (".key", ".key_secret"))
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    for path in written:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode == (0o600 if path.endswith("_secret") else 0o644), (path, oct(mode))
        public, secret = zmq.auth.load_certificate(path)
        assert len(public) == 40 and (secret is None) == (not path.endswith("_secret"))
    keys = CurveKeys.load(d, "client-a", listen=True)
    assert keys.public == zmq.auth.load_certificate(key_files(d, "client-a")[0])[0]
    assert keys.server_public == zmq.auth.load_certificate(key_files(d, "server")[0])[0]
    assert keys.server_secret is not None and keys.secret not in repr(keys).encode()
    assert authorized_keys(d) == {keys.public, keys.server_public,
                                  CurveKeys.load(d, "node").public}


def test_keygen_refuses_to_overwrite_unless_forced(tmp_path):
    d = tmp_path / "k"
    generate_keys(d, ["node"])
    before = {n: open(d / n, "rb").read() for n in os.listdir(d)}
    with pytest.raises(ConfigError, match=r"node\.key exists; refusing to overwrite"):
        generate_keys(d, ["node"])
    with pytest.raises(ConfigError, match=r"node\.key exists"):
        generate_keys(d, ["client", "node"])          # all or nothing: client not written
    assert {n: open(d / n, "rb").read() for n in os.listdir(d)} == before
    generate_keys(d, ["client"])                      # a new name next to the server pair
    assert open(d / "server.key", "rb").read() == before["server.key"]
    generate_keys(d, ["node"], force=True)
    assert open(d / "node.key", "rb").read() != before["node.key"]
    assert open(d / "server.key", "rb").read() == before["server.key"]
    assert stat.S_IMODE(os.stat(d / "node.key_secret").st_mode) == 0o600


@pytest.mark.parametrize("name", ["", "../x", "a/b", "-x", "x.key", "a b"], ids=repr)
def test_keygen_bad_names(tmp_path, name):
    with pytest.raises(ConfigError, match="key name"):
        generate_keys(tmp_path / "k", [name])
    assert not (tmp_path / "k").exists()


# -- config ---------------------------------------------------------------------------------------
def test_config_keys_dir_pointing_nowhere_names_the_path(tmp_path):
    missing = str(tmp_path / "no-such-dir")
    with pytest.raises(ConfigError, match="no-such-dir"):
        ConnectorConfig(keys_dir=missing)
    with pytest.raises(ConfigError, match="no-such-dir"):
        ConnectorConfig.from_env({"STATEBRIDGE_KEYS_DIR": missing})


def test_config_keys_dir_missing_files_names_the_file(tmp_path, keys_dir):
    with pytest.raises(ConfigError, match=r"nobody\.key_secret"):
        ConnectorConfig(keys_dir=keys_dir, key_name="nobody")
    os.unlink(os.path.join(keys_dir, "server.key"))
    with pytest.raises(ConfigError, match=r"server\.key"):
        ConnectorConfig(keys_dir=keys_dir)
    with pytest.raises(ConfigError, match="key name"):
        ConnectorConfig(keys_dir=keys_dir, key_name="../node")


def test_config_from_env_reads_keys(keys_dir):
    config = ConnectorConfig.from_env({"STATEBRIDGE_KEYS_DIR": keys_dir,
                                       "STATEBRIDGE_KEY_NAME": "client"})
    assert (config.keys_dir, config.key_name) == (keys_dir, "client")
    assert CurveKeys.from_config(config).name == "client"
    assert CurveKeys.from_config(ConnectorConfig()) is None


def test_listening_needs_the_server_secret(tmp_path, keys_dir):
    client_dir = tmp_path / "client-host"
    client_dir.mkdir()
    for name in ("server.key", "client.key", "client.key_secret"):
        shutil.copy(os.path.join(keys_dir, name), client_dir / name)
    CurveKeys.load(client_dir, "client")                 # enough to dial
    with pytest.raises(ConfigError, match=r"server\.key_secret"):
        CurveKeys.load(client_dir, "client", listen=True)
    (client_dir / "client.key_secret").write_text("garbage\n")
    with pytest.raises(ConfigError, match=r"client\.key_secret"):
        CurveKeys.load(client_dir, "client")


# -- sockets (one process, no ranks) -------------------------------------------------------------
def _exchange(router: zmq.Socket, dealer: zmq.Socket, watch: c.HandshakeWatch) -> bytes:
    c.send_dealer(dealer, m.Heartbeat(node_id="probe", seq=7))
    assert router.poll(20_000), "keyed router never received the message"
    identity, msg = c.recv_router(router, 1 << 20)
    assert msg == m.Heartbeat(node_id="probe", seq=7)
    c.send_router(router, identity, m.Heartbeat(node_id="server", seq=8))
    assert c.poll_dealer(dealer, watch, 20.0)
    return dealer.recv()


@pytest.fixture
def keyed_router(keys_dir):
    ctx = zmq.Context.instance()
    counters = Counters()
    router, port = c.bind_router(ctx, "127.0.0.1", keys=CurveKeys.load(keys_dir, listen=True),
                                 counters=counters, name="test-router")
    yield router, f"127.0.0.1:{port}", counters
    router.close(0)


def test_keyed_sockets_talk(keys_dir, keyed_router):
    router, address, counters = keyed_router
    dealer, watch = c.dial_dealer(zmq.Context.instance(), address,
                                  keys=CurveKeys.load(keys_dir, "client"))
    try:
        reply = _exchange(router, dealer, watch)
        assert m.decode(reply) == m.Heartbeat(node_id="server", seq=8)
        assert watch.succeeded and watch.socket is None      # the monitor ended itself
        assert counters.get("auth_refused") == 0
    finally:
        watch.close()
        dealer.close(0)


def _foreign_keys(tmp_path, keys_dir) -> CurveKeys:
    """A pair that is NOT in keys_dir, with keys_dir's (public) server key: the usual intruder."""
    other = tmp_path / "intruder"
    generate_keys(other, ["node"])
    shutil.copy(os.path.join(keys_dir, "server.key"), other / "server.key")
    return CurveKeys.load(other, "node")


@pytest.mark.parametrize("who", ["no-keys", "unknown-key", "wrong-server-key"])
def test_refused_dialer_gets_authentication_error(tmp_path, keys_dir, keyed_router, who):
    router, address, counters = keyed_router
    if who == "no-keys":
        keys, match = None, "requires CURVE keys and we have none"
    elif who == "unknown-key":
        keys, match = _foreign_keys(tmp_path, keys_dir), "does not accept our public key"
    else:
        generate_keys(tmp_path / "other", ["node"])
        keys, match = CurveKeys.load(tmp_path / "other", "node"), "server.key probably does not match"
    dealer, watch = c.dial_dealer(zmq.Context.instance(), address, keys=keys)
    try:
        c.send_dealer(dealer, m.Heartbeat(node_id="intruder", seq=1))
        with pytest.raises(AuthenticationError, match=match) as info:
            c.poll_dealer(dealer, watch, 60.0)
        assert info.value.peer == address and address in str(info.value)
        assert not router.poll(0), "a refused peer's message reached the router"
        wait_until(lambda: counters.get("auth_refused") >= 1, 20, "refusal counted")
    finally:
        watch.close()
        dealer.close(0)
    # The router keeps serving authorized peers.
    good, good_watch = c.dial_dealer(zmq.Context.instance(), address,
                                     keys=CurveKeys.load(keys_dir, "client"))
    try:
        _exchange(router, good, good_watch)
    finally:
        good_watch.close()
        good.close(0)


def test_keyed_dialer_against_a_keyless_router_is_told_so(keys_dir):
    ctx = zmq.Context.instance()
    router, port = c.bind_router(ctx, "127.0.0.1")
    dealer, watch = c.dial_dealer(ctx, f"127.0.0.1:{port}",
                                  keys=CurveKeys.load(keys_dir, "client"))
    try:
        with pytest.raises(AuthenticationError, match="we use CURVE keys and the server has none"):
            c.poll_dealer(dealer, watch, 60.0)
        assert not router.poll(0)
    finally:
        watch.close()
        dealer.close(0)
        router.close(0)


def test_public_key_added_to_dir_is_admitted_without_restart(tmp_path, keys_dir, keyed_router):
    router, address, counters = keyed_router
    keys = _foreign_keys(tmp_path, keys_dir)
    shutil.copy(key_files(keys.keys_dir, "node")[0], os.path.join(keys_dir, "newcomer.key"))
    dealer, watch = c.dial_dealer(zmq.Context.instance(), address, keys=keys)
    try:
        _exchange(router, dealer, watch)
    finally:
        watch.close()
        dealer.close(0)


# -- groups: prefill server + decode coordinators over real rank processes -----------------------
@pytest.fixture(scope="module")
def hosts():
    """Two rank hosts shared by every group here (host r runs rank r of each group)."""
    from statebridge.testing.hosts import RankHostPool

    with RankHostPool(2, initializer=log_to_stderr) as pool:
        yield pool


def _transfer(decode, server_stats_fn, n: int) -> None:
    ids = [f"sec-{i}-{uuid.uuid4().hex[:6]}" for i in range(n)]
    results = [f.result(timeout=60) for f in [decode.submit(rid, (1, 2, 3)) for rid in ids]]
    for rid, result in zip(ids, results):
        assert probes_of(decode).checksums(result) == tuple(
            expected_checksum(decode.group.geometry, rid, r) for r in range(decode.group.tp_size))
        decode.release(result)
    wait_until(lambda: server_stats_fn()["pages_used"] == 0, 20, "prefill pages freed")


@pytest.mark.ucx
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_keyed_groups_transfer_and_refuse_intruders(tmp_path, keys_dir, hosts):
    from statebridge.connector.decode import DecodeCoordinator
    from statebridge.connector.prefill import PrefillServer

    spec = SPECS["mamba2-g1"]
    config = KEYED.replace(keys_dir=keys_dir)
    # The intruder stole the server key pair but its own key is not in keys_dir.
    stolen = tmp_path / "stolen"
    generate_keys(stolen, ["node"])
    for name in ("server.key", "server.key_secret"):
        shutil.copy(os.path.join(keys_dir, name), stolen / name)
    with PrefillServer(spec, 1, "DLS", num_pages=8, config=config,
                       launcher=hosts.launcher(), model=SYNTHETIC) as server, \
            instrumented(DecodeCoordinator(spec, 2, "LDS", num_pages=8, config=config,
                                           launcher=hosts.launcher(),
                                           probes="checksums")) as decode:
        server.wait_ready()
        decode.connect(server.address)
        _transfer(decode, server.stats, 3)

        for intruder_config, match in ((KEYED, "requires CURVE keys and we have none"),
                                       (KEYED.replace(keys_dir=str(stolen)),
                                        "does not accept our public key")):
            with DecodeCoordinator(spec, 1, "DLS", num_pages=4, config=intruder_config,
                                   launcher=hosts.launcher()) as intruder:
                with pytest.raises(AuthenticationError, match=match) as info:
                    intruder.connect(server.address)
                assert info.value.peer == server.address
                assert intruder.prefill_nodes() == []
        wait_until(lambda: server.stats().get("auth_refused", 0) >= 2, 20, "refusals counted")
        assert server.stats()["requests"] == 3            # nothing of the intruders got through
        _transfer(decode, server.stats, 2)                 # the good peer is still served
        assert decode.stats().get("auth_refused", 0) == 0


@pytest.mark.ucx
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_keyed_decode_node_refuses_a_keyless_client(tmp_path, keys_dir, hosts):
    from statebridge.node.client import Client
    from statebridge.node.decode_node import DecodeNode

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"model_type": "lfm2", "hidden_size": 8, "conv_L_cache": 3, "torch_dtype": "float32",
         "layer_types": ["conv"]}))
    node = DecodeNode(str(model), 1, [], config=KEYED.replace(keys_dir=keys_dir),
                      launcher=hosts.launcher(),
                      rank_model="statebridge.testing.models:SyntheticModel")
    try:
        with Client(node.address, timeout=60) as client:
            with pytest.raises(AuthenticationError, match="requires CURVE keys and we have none") as info:
                client.wait_ready(timeout=60)
            assert info.value.peer == node.address
        with Client(node.address, timeout=60, keys=CurveKeys.load(keys_dir, "client")) as client:
            status = client.status()                  # heard: the node has no prefill peer
            assert not status.ready and "no prefill server connected" in status.reason
        wait_until(lambda: node.stats().get("auth_refused", 0) >= 1, 20, "refusal counted")
    finally:
        node.close()
