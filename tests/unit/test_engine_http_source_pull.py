"""An engine rank pulls from an HTTP(S) source (issue 29), through the swarm when the server's
environment names one: the rank's real pull helper process (``sglang_patch.pull.process``)
against a real static origin on loopback (``benchmarks.fleet.origin``), a real libtorrent session
where installed. No sglang (the e2e with a real server is ``tests/e2e/test_engine_http_source.py``).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks.fleet.origin import OriginServer
from core_support import assert_checkpoint_is, mutate, random_tensors, tensor_bytes, write_hf_checkpoint
from sglang_patch.pull.options import PullWeightsOptions
from sglang_patch.pull.process import HelperRankPuller
from sglang_patch.pull.rank import RankPuller
from sglang_patch.server_flags import check_swarm_environment
from weightsync import Publisher

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = {"embed": ("float32", (256, 64)), "layers.0.w": ("float32", (128, 128)), "norm": ("float32", (64,))}
SWARM_ENV = ("WEIGHTSYNC_SWARM_PEERS", "WEIGHTSYNC_SWARM_LISTEN", "WEIGHTSYNC_SWARM_TRACKER", "WEIGHTSYNC_SWARM_NO_PEER_S")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def world(fast_tmp_path, monkeypatch):
    """v1 (a delta) and v2 published with their torrents under ``www/run``, served by a static origin."""
    for name in SWARM_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    rng = np.random.default_rng(11)
    root = str(fast_tmp_path)
    seed = os.path.join(root, "seed")
    tensors = [random_tensors(rng, SIZES)]
    write_hf_checkpoint(seed, tensors[0])
    torrent = "libtorrent" in sys.modules or _importable("libtorrent")
    if torrent:
        monkeypatch.setenv("WEIGHTSYNC_PUBLISH_TORRENT", "1")
    pub = Publisher(os.path.join(root, "www", "run"), template_dir=seed, encoding="sparse-v1", workers=1)
    pub.seed_snapshot(tensors[0])
    for v in (1, 2):
        tensors.append(mutate(tensors[-1], rng, 0.05))
        pub.publish(v, tensors[-1], full=False)
    pub.close()
    monkeypatch.delenv("WEIGHTSYNC_PUBLISH_TORRENT", raising=False)
    origin = OriginServer(os.path.join(root, "www"), ("127.0.0.1", 0))
    origin.start_in_thread()
    url = origin.base_url + "/run"

    def puller() -> HelperRankPuller:
        # Started after the test set its environment: the helper inherits the server's.
        options = PullWeightsOptions(allowed_roots=(root, origin.base_url))
        return HelperRankPuller(RankPuller(options=options, seed_dir=seed, host="h/node0", rank="dp0/tp0"))

    def request(version: int, local: str = "local"):
        return SimpleNamespace(local_checkpoint_dir=os.path.join(root, local), source_dir=url, target_version=version)

    try:
        yield SimpleNamespace(root=root, url=url, origin=origin, expected=[tensor_bytes(t) for t in tensors],
                              puller=puller, request=request)
    finally:
        origin.shutdown()
        origin.server_close()


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def pull(world, version: int, local: str = "local"):
    puller = world.puller()
    try:
        return puller(world.request(version, local))
    finally:
        puller.close()


def test_an_engine_rank_pulls_a_chain_from_an_http_source_in_its_helper_bit_exact(world):
    report = pull(world, 2)
    assert report.success, report
    assert report.applied_version == 2
    assert_checkpoint_is(os.path.join(world.root, "local"), world.expected[2])
    assert not os.path.exists(os.path.join(world.root, "local", ".weight_sync", "swarm"))  # no swarm named: none joined


def test_an_http_source_outside_the_allowed_http_roots_is_refused_before_the_local_dir_is_made(world):
    puller = world.puller()
    try:
        req = world.request(1)
        req.source_dir = world.url.replace("127.0.0.1", "localhost")  # the same server under another host name
        report = puller(req)
    finally:
        puller.close()
    assert not report.success and report.http_status == 403 and report.error_type == "forbidden"
    assert not os.path.exists(req.local_checkpoint_dir)


def test_the_swarm_named_in_the_servers_environment_reaches_the_rank_pull_helper(world, monkeypatch):
    pytest.importorskip("libtorrent", reason="the swarm's optional package (weightsync[swarm])")
    monkeypatch.setenv("WEIGHTSYNC_SWARM_LISTEN", f"127.0.0.1:{_free_port()}")
    monkeypatch.setenv("WEIGHTSYNC_SWARM_PEERS", f"127.0.0.1:{_free_port()}")  # a fleet member not up yet
    monkeypatch.setenv("WEIGHTSYNC_SWARM_NO_PEER_S", "2")
    report = pull(world, 2)
    assert report.success, report
    assert_checkpoint_is(os.path.join(world.root, "local"), world.expected[2])
    # the helper's pull joined the swarm (the source its web seed): its seeding copy is there
    swarm_dir = os.path.join(world.root, "local", ".weight_sync", "swarm")
    assert os.path.isdir(swarm_dir) and any(files for _, _, files in os.walk(swarm_dir))


def test_a_swarm_named_on_a_host_without_libtorrent_replies_swarm_unavailable_naming_the_extra(world, monkeypatch, tmp_path):
    # sglang 0.5.16's venv has no libtorrent; here its import is made to fail in the helper
    # process (a module that raises on import, first on the helper's path).
    blocker = tmp_path / "no_libtorrent"
    blocker.mkdir()
    (blocker / "libtorrent.py").write_text("raise ImportError('No module named libtorrent (blocked by the test)')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(blocker), os.environ["PYTHONPATH"]]))
    monkeypatch.setenv("WEIGHTSYNC_SWARM_PEERS", "127.0.0.1:6881")
    report = pull(world, 1)
    assert not report.success
    assert (report.error_type, report.http_status) == ("swarm_unavailable", 400)
    assert "libtorrent" in report.message and "weightsync[swarm]" in report.message
    assert not os.path.exists(os.path.join(world.root, "local"))  # refused before anything is written


def test_the_server_checks_the_swarm_environment_at_start(monkeypatch, caplog):
    for name in SWARM_ENV:
        monkeypatch.delenv(name, raising=False)
    assert check_swarm_environment() is False  # nothing named: the swarm is off
    monkeypatch.setenv("WEIGHTSYNC_SWARM_PEERS", "10.0.0.2:6881,not-an-address")
    with pytest.raises(ValueError, match="WEIGHTSYNC_SWARM_PEERS"):
        check_swarm_environment()
    monkeypatch.setenv("WEIGHTSYNC_SWARM_PEERS", "10.0.0.2:6881,10.0.0.3:6881")
    monkeypatch.setitem(sys.modules, "libtorrent", None)  # import libtorrent now fails
    with caplog.at_level(logging.WARNING, logger="sglang_patch.server_flags"):
        assert check_swarm_environment() is True
    assert "weightsync[swarm]" in caplog.text
