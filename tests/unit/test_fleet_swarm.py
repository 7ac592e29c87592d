"""The fleet swarm (issue 29.3, ``weightsync.storage.swarm``): the publisher's opt-in v2 torrent,
the pull that takes checked files from the swarm and reads the rest from the source, and the typed
refusals. Real parts on loopback: libtorrent sessions, the static origin of the fleet harness,
our real publish and pull. The fleet-shaped runs (namespaces, rate-limited links, faults) are in
``test_fleet_swarm_faults.py``.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import numpy as np
import pytest

from core_support import assert_checkpoint_is, mutate, random_tensors, serving, tensor_bytes, write_hf_checkpoint
from weightsync import Publisher, pull
from weightsync.errors import InvalidRequestError, SwarmConfigError, SwarmUnavailableError
from weightsync.format.file_digests import FileDigest, digest_file
from weightsync.storage.mirror import Mirror
from weightsync.storage.source import ObjectInfo
from weightsync.storage.swarm import TORRENT_NAME, SwarmConfig, SwarmOutcome, _deliver, _files, _real_files, recent_outcomes, stop_swarms

lt = pytest.importorskip("libtorrent", reason="the swarm's optional package (weightsync[swarm]); setup_env.sh installs it")

SIZES = {"embed": ("float32", (256, 64)), "layers.0.w": ("float32", (128, 128)), "norm": ("float32", (64,))}
INDEX = "model.safetensors.index.json"


@pytest.fixture(autouse=True)
def _leave_the_swarm():
    yield
    stop_swarms()  # each test's sessions stop seeding: bounded, and no test sees another's


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def published(fast_tmp_path, monkeypatch):
    """A run with v1 (a delta) published with its torrent; (www, seed dir, v1's bytes)."""
    rng = np.random.default_rng(7)
    root = str(fast_tmp_path)
    t0 = random_tensors(rng, SIZES)
    seed = os.path.join(root, "seed")
    write_hf_checkpoint(seed, t0)
    monkeypatch.setenv("WEIGHTSYNC_PUBLISH_TORRENT", "1")
    pub = Publisher(os.path.join(root, "www", "run"), template_dir=seed, encoding="sparse-v1", workers=1)
    pub.seed_snapshot(t0)
    t1 = mutate(t0, rng, 0.05)
    pub.publish(1, t1, full=False)
    pub.close()
    monkeypatch.delenv("WEIGHTSYNC_PUBLISH_TORRENT")
    return os.path.join(root, "www"), seed, tensor_bytes(t1)


@pytest.fixture
def origin(published):
    with serving(published[0]) as server:
        yield server


def test_a_version_published_with_the_torrent_knob_carries_a_private_v2_only_torrent_of_its_payload_files(published):
    www, _seed, _ = published
    vdir = os.path.join(www, "run", "weight_v000001")
    with open(os.path.join(vdir, INDEX)) as f:
        payload = sorted(set(json.load(f)["weight_map"].values()))
    with open(os.path.join(vdir, TORRENT_NAME), "rb") as f:
        raw = f.read()
    meta = lt.bdecode(raw)
    info = meta[b"info"]
    assert info[b"meta version"] == 2 and b"pieces" not in info  # v2 only: SHA-256 Merkle trees, no SHA-1 pieces
    assert info[b"private"] == 1
    assert b"creation date" not in meta  # deterministic bytes: a retried commit writes the same torrent
    ti = lt.torrent_info(meta)
    names = sorted(os.path.basename(_files(ti).file_path(i)) for i in _real_files(ti))  # pad files left out
    assert names == payload
    # the torrent's pieces verify against the published files: a seed over them is complete at once
    ses = lt.session({"listen_interfaces": f"127.0.0.1:{_free_port()}", "enable_dht": False})
    p = lt.add_torrent_params()
    p.ti = ti
    p.save_path = vdir if ti.name() != "weight_v000001" else os.path.dirname(vdir)
    h = ses.add_torrent(p)
    import time

    deadline = time.monotonic() + 20
    while not h.status().is_seeding:
        assert time.monotonic() < deadline, h.status().state
        time.sleep(0.05)


def test_a_version_published_without_the_knob_has_no_torrent(fast_tmp_path, rng):
    t0 = random_tensors(rng, SIZES)
    seed = str(fast_tmp_path / "seed")
    write_hf_checkpoint(seed, t0)
    pub = Publisher(str(fast_tmp_path / "run"), template_dir=seed, encoding="sparse-v1", workers=1)
    pub.seed_snapshot(t0)
    pub.publish(1, mutate(t0, rng, 0.05), full=False)
    pub.close()
    assert not os.path.exists(fast_tmp_path / "run" / "weight_v000001" / TORRENT_NAME)


def test_a_torrent_asked_for_without_libtorrent_is_refused_before_anything_is_written(fast_tmp_path, monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_PUBLISH_TORRENT", "1")
    monkeypatch.setitem(sys.modules, "libtorrent", None)  # import libtorrent now fails
    run = fast_tmp_path / "run"
    with pytest.raises(SwarmUnavailableError) as e:
        Publisher(str(run), encoding="sparse-v1")
    assert e.value.package == "libtorrent" and "weightsync[swarm]" in str(e.value)
    assert e.value.http_status == 400
    assert not run.exists()


def test_a_swarm_pull_without_libtorrent_is_a_typed_error_and_leaves_no_local_dir(published, origin, fast_tmp_path, monkeypatch):
    _www, seed, _ = published
    monkeypatch.setitem(sys.modules, "libtorrent", None)
    local = fast_tmp_path / "local"
    with pytest.raises(SwarmUnavailableError):
        pull(str(local), seed, origin.base_url + "/run", 1, swarm=SwarmConfig("127.0.0.1:1", ["127.0.0.1:2"]))
    assert not local.exists()


@pytest.mark.parametrize("listen,peers,tracker", [
    ("nohost", [], None),
    ("127.0.0.1:99999", [], None),
    ("127.0.0.1:6881", ["10.0.0.1"], None),
    ("127.0.0.1:6881", [], "ftp://tracker"),
])
def test_swarm_settings_that_cannot_name_an_address_are_typed_errors(listen, peers, tracker):
    with pytest.raises(SwarmConfigError) as e:
        SwarmConfig(listen, peers, tracker)
    assert isinstance(e.value, InvalidRequestError) and e.value.expected


def test_the_swarm_is_off_unless_the_environment_names_peers_or_a_tracker(monkeypatch):
    monkeypatch.delenv("WEIGHTSYNC_SWARM_PEERS", raising=False)
    monkeypatch.delenv("WEIGHTSYNC_SWARM_TRACKER", raising=False)
    assert SwarmConfig.from_env() is None
    monkeypatch.setenv("WEIGHTSYNC_SWARM_PEERS", "10.0.0.1:6881, 10.0.0.2:6881")
    monkeypatch.setenv("WEIGHTSYNC_SWARM_LISTEN", "10.0.0.1:6881")
    cfg = SwarmConfig.from_env()
    assert cfg is not None and cfg.peers == [("10.0.0.1", 6881), ("10.0.0.2", 6881)] and cfg.listen == ("10.0.0.1", 6881)


def test_a_complete_swarm_file_that_does_not_match_its_file_digest_is_not_put_in_the_mirror(fast_tmp_path):
    root = fast_tmp_path / "mirror"
    (root / "weight_v000001").mkdir(parents=True)
    good = fast_tmp_path / "good.bin"
    good.write_bytes(os.urandom(4096))
    expected = digest_file(str(good))
    bad = fast_tmp_path / "bad.bin"
    bad.write_bytes(good.read_bytes()[:-1] + b"\x00")
    mirror = Mirror(None, str(root))  # type: ignore[arg-type]  # _deliver uses only its paths
    obj = ObjectInfo("weight_v000001/x.safetensors", 4096, expected.digest)
    out = SwarmOutcome()
    _deliver(str(bad), mirror, obj, expected, digest_file, out)
    assert out.rejected == [obj.key] and out.fell_back == [obj.key] and not out.delivered
    assert not (root / "weight_v000001" / "x.safetensors").exists()
    _deliver(str(good), mirror, obj, FileDigest(expected.nbytes, expected.digest), digest_file, out)
    assert out.delivered == [obj.key]
    assert (root / "weight_v000001" / "x.safetensors").read_bytes() == good.read_bytes()


def test_two_hosts_pull_through_the_swarm_and_hold_the_published_bytes(published, origin, fast_tmp_path):
    _www, seed, expected = published
    a, b = _free_port(), _free_port()
    for i, (me, other) in enumerate([(a, b), (b, a)]):
        local = str(fast_tmp_path / f"local{i}")
        r = pull(local, seed, origin.base_url + "/run", 1, swarm=SwarmConfig(f"127.0.0.1:{me}", [f"127.0.0.1:{other}"]))
        assert r.applied_version == 1
        assert_checkpoint_is(local, expected)
        assert recent_outcomes()[-1].delivered  # the payload came through the swarm, checked
        assert os.listdir(os.path.join(local, ".weight_sync", "swarm"))  # and stays there to be seeded


def test_a_host_that_finds_no_peer_reads_the_source_directly_and_holds_the_published_bytes(published, origin, fast_tmp_path,
                                                                                          monkeypatch):
    _www, seed, expected = published
    monkeypatch.setenv("WEIGHTSYNC_SWARM_WEB_SEED", "0")  # peers only: nobody listens at the one named
    monkeypatch.setenv("WEIGHTSYNC_SWARM_NO_PEER_S", "1")
    local = str(fast_tmp_path / "lonely")
    before = origin.bytes_served(".safetensors")
    r = pull(local, seed, origin.base_url + "/run", 1, swarm=SwarmConfig(f"127.0.0.1:{_free_port()}", [f"127.0.0.1:{_free_port()}"]))
    assert r.applied_version == 1
    assert_checkpoint_is(local, expected)
    out = recent_outcomes()[-1]
    assert not out.delivered and out.fell_back and "no peer" in out.why
    assert origin.bytes_served(".safetensors") > before  # read from the source instead


def test_a_swarm_that_stalls_falls_back_to_the_source_within_the_deadline(published, origin, fast_tmp_path, monkeypatch):
    # The only peer is a real libtorrent session in the torrent that holds none of it: the host
    # finds a peer, and no byte ever comes.
    www, seed, expected = published
    with open(os.path.join(www, "run", "weight_v000001", TORRENT_NAME), "rb") as f:
        ti = lt.torrent_info(lt.bdecode(f.read()))
    empty_port = _free_port()
    ses = lt.session({"listen_interfaces": f"127.0.0.1:{empty_port}", "enable_dht": False, "enable_lsd": False})
    p = lt.add_torrent_params()
    p.ti = ti
    p.save_path = str(fast_tmp_path / "empty-peer")
    ses.add_torrent(p)
    monkeypatch.setenv("WEIGHTSYNC_SWARM_WEB_SEED", "0")
    monkeypatch.setenv("WEIGHTSYNC_SWARM_STALL_S", "1")
    monkeypatch.setenv("WEIGHTSYNC_SWARM_NO_PEER_S", "30")  # so the stall, not "no peer", ends the wait
    local = str(fast_tmp_path / "stalled")
    r = pull(local, seed, origin.base_url + "/run", 1, swarm=SwarmConfig(f"127.0.0.1:{_free_port()}", [f"127.0.0.1:{empty_port}"]))
    assert r.applied_version == 1
    assert_checkpoint_is(local, expected)
    out = recent_outcomes()[-1]
    assert not out.delivered and out.fell_back and "no byte" in out.why, out.why
