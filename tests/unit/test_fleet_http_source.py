"""The HTTP(S) source (issue 29.2): a run dir served over HTTP pulls as a source dir does, with
ranged GETs; the index is read from the origin, never a cache; each payload file is checked
against its index's ``file_digests`` before its bytes are used, so a stale or torn cached copy is
fetched again from the origin, never applied.

Real servers on loopback: a static origin with Range support (``benchmarks.fleet.origin``), a
second static server over other bytes standing for a cache that holds stale or torn copies,
and nginx as the caching tier where ``scripts/setup_env.sh`` installed it.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from benchmarks.fleet.nginx import NginxCache, nginx_binary
from benchmarks.fleet.origin import OriginServer
from core_support import assert_checkpoint_is, marker_version, mutate, random_tensors, serving, tensor_bytes, write_hf_checkpoint
from weightsync import Publisher, errors, pull
from weightsync.errors import HttpSourceURLError, PayloadFileMismatchError, VersionMissingError
from weightsync.format.file_digests import FILE_DIGESTS_KEY, digest_file
from weightsync.storage.http import ORIGIN_ENV, parse_http_url

SIZES = {
    "embed": ("float32", (256, 64)),
    "layers.0.w": ("float32", (128, 128)),
    "layers.1.w": ("float32", (128, 128)),
    "norm": ("float32", (64,)),
}
INDEX = "model.safetensors.index.json"


class Served:
    """A run published into ``<root>/www/run`` and a list of each version's exact bytes."""

    def __init__(self, root: str, rng: np.random.Generator, **publisher_kw):
        self.root, self.rng = root, rng
        self.www = os.path.join(root, "www")
        self.run = os.path.join(self.www, "run")
        self.seed = os.path.join(root, "seed")
        self.tensors = [random_tensors(rng, SIZES)]
        write_hf_checkpoint(self.seed, self.tensors[0])
        self.expected = [tensor_bytes(self.tensors[0])]
        self.pub = Publisher(self.run, template_dir=self.seed, encoding="sparse-v1", workers=1, **publisher_kw)
        self.pub.seed_snapshot(self.tensors[0])
        self.locals = 0

    def publish(self, n: int = 1, full_at: "set[int]" = frozenset()) -> None:
        for _ in range(n):
            v = len(self.tensors)
            new = mutate(self.tensors[-1], self.rng, 0.05)
            self.tensors.append(new)
            self.expected.append(tensor_bytes(new))
            self.pub.publish(v, new, full=True if v in full_at else None)

    def local(self) -> str:
        self.locals += 1
        return os.path.join(self.root, f"local{self.locals}")

    def shards(self, v: int) -> list[str]:
        vdir = os.path.join(self.run, f"weight_v{v:06d}")
        with open(os.path.join(vdir, INDEX)) as f:
            return [os.path.join(vdir, n) for n in sorted(set(json.load(f)["weight_map"].values()))]


@pytest.fixture
def served(fast_tmp_path, rng):
    return Served(str(fast_tmp_path), rng)


@pytest.fixture
def origin(served):
    with serving(served.www) as server:
        yield server


@pytest.fixture
def stale_cache(served, fast_tmp_path):
    """A second static server over its own copy of the run: what a cache holds. Tests damage
    that copy; the origin keeps the published bytes."""
    copy = os.path.join(str(fast_tmp_path), "cache-www")
    server = OriginServer(copy, ("127.0.0.1", 0))
    server.start_in_thread()

    def fill() -> str:
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(served.www, copy)
        return os.path.join(copy, "run")

    server.fill = fill  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def gets(server: OriginServer, suffix: str) -> list[tuple[str, str, int]]:
    return [r for r in server.served if r[0] == "GET" and r[1].endswith(suffix)]


def test_every_index_names_the_size_and_xxh3_of_each_payload_file(served):
    served.publish(2, full_at={2})
    for v in (1, 2):
        with open(os.path.join(served.run, f"weight_v{v:06d}", INDEX)) as f:
            obj = json.load(f)
        entries = obj[FILE_DIGESTS_KEY]
        assert set(entries) == set(obj["weight_map"].values())
        for path in served.shards(v):
            d = digest_file(path)
            assert entries[os.path.basename(path)] == {"nbytes": d.nbytes, "xxh3-128": d.digest}


def test_a_chain_served_over_http_pulls_bit_exact_with_ranged_gets(served, origin, monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_HTTP_RANGE_NBYTES", "4096")  # several ranges per shard
    served.publish(3, full_at={3})
    served.publish(1)
    url = f"{origin.base_url}/run"
    local = served.local()
    for v in (1, 2, 4):
        result = pull(local, served.seed, url, v)
        assert result.applied_version == v
        assert_checkpoint_is(local, served.expected[v])
    shard = os.path.basename(served.shards(1)[0])
    assert len(gets(origin, shard)) == -(-os.path.getsize(served.shards(1)[0]) // 4096)
    fresh = served.local()
    assert pull(fresh, served.seed, url, 4).applied_version == 4  # a fresh host seeds from the full v3
    assert_checkpoint_is(fresh, served.expected[4])


def test_a_version_not_on_the_origin_is_not_ready_and_leaves_no_trace(served, origin):
    served.publish(1)
    local = served.local()
    with pytest.raises(VersionMissingError):
        pull(local, served.seed, f"{origin.base_url}/run", 2)
    assert not os.path.exists(local)


def test_the_index_is_read_from_the_origin_never_through_the_cache(served, origin, stale_cache, monkeypatch):
    served.publish(1)
    copy = stale_cache.fill()
    served.publish(1)  # v2 is on the origin only: the cache's copy predates it
    os.remove(os.path.join(copy, "weight_v000001", INDEX))  # and the cache has no index at all
    shutil.copytree(os.path.join(served.run, "weight_v000002"), os.path.join(copy, "weight_v000002"))
    os.remove(os.path.join(copy, "weight_v000002", INDEX))
    monkeypatch.setenv(ORIGIN_ENV, origin.base_url)
    local = served.local()
    assert pull(local, served.seed, f"{stale_cache.base_url}/run", 2).applied_version == 2
    assert_checkpoint_is(local, served.expected[2])
    assert not gets(stale_cache, INDEX) and not gets(stale_cache, "weightsync-run.json")
    assert gets(origin, f"weight_v000002/{INDEX}")
    shard = os.path.basename(served.shards(2)[0])
    assert gets(stale_cache, shard) and not gets(origin, shard)  # the payload came from the cache


@pytest.mark.parametrize("damage", ["stale", "torn", "cut_short"])
def test_a_stale_or_torn_cached_shard_is_refetched_from_the_origin_never_applied(served, origin, stale_cache,
                                                                                monkeypatch, damage):
    served.publish(2)
    copy = stale_cache.fill()
    path = os.path.join(copy, "weight_v000002", os.path.basename(served.shards(2)[0]))
    data = bytearray(open(path, "rb").read())
    if damage == "stale":  # the bytes of another version under this name
        other = open(served.shards(1)[0], "rb").read()
        data = bytearray((other * (len(data) // len(other) + 1))[:len(data)])
    elif damage == "torn":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) - 100]
    with open(path, "wb") as f:
        f.write(data)
    monkeypatch.setenv(ORIGIN_ENV, origin.base_url)
    local = served.local()
    assert pull(local, served.seed, f"{stale_cache.base_url}/run", 2).applied_version == 2
    assert_checkpoint_is(local, served.expected[2])
    shard = os.path.basename(path)
    assert gets(origin, shard), "the damaged copy was not fetched again from the origin"
    assert not gets(origin, os.path.basename(served.shards(1)[0]))  # v1's intact copy came from the cache


def test_a_file_without_a_digest_in_its_index_is_read_from_the_origin_only(served, origin, stale_cache, monkeypatch):
    served.publish(1)
    ipath = os.path.join(served.run, "weight_v000001", INDEX)
    obj = json.load(open(ipath))
    del obj[FILE_DIGESTS_KEY]  # as an upstream writer's index
    with open(ipath, "w") as f:
        json.dump(obj, f)
    stale_cache.fill()
    monkeypatch.setenv(ORIGIN_ENV, origin.base_url)
    local = served.local()
    assert pull(local, served.seed, f"{stale_cache.base_url}/run", 1).applied_version == 1
    assert_checkpoint_is(local, served.expected[1])
    shard = os.path.basename(served.shards(1)[0])
    assert gets(origin, shard) and not gets(stale_cache, shard)


def test_a_payload_file_damaged_at_the_origin_is_a_typed_corrupt_error_and_nothing_is_applied(served, origin):
    served.publish(2)
    local = served.local()
    url = f"{origin.base_url}/run"
    assert pull(local, served.seed, url, 1).applied_version == 1
    path = served.shards(2)[0]
    data = bytearray(open(path, "rb").read())
    data[-10] ^= 0x01
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(PayloadFileMismatchError) as e:
        pull(local, served.seed, url, 2)
    assert os.path.basename(path) in str(e.value)
    assert_checkpoint_is(local, served.expected[1])


@pytest.mark.parametrize("bad", [
    "http://user:pw@host/run", "http://host/run?x=1", "http://host/a/../b", "ftp://host/run", "http:///run",
    "http://host/run#f",
])
def test_an_http_url_with_credentials_a_query_or_dot_segments_is_refused(bad):
    with pytest.raises(HttpSourceURLError):
        parse_http_url(bad)


needs_nginx = pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed (scripts/setup_env.sh installs it)")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_nginx
def test_an_nginx_cache_fetches_each_shard_once_from_the_origin_and_never_caches_the_index(served, origin, monkeypatch, fast_tmp_path):
    host, port = origin.server_address[:2]
    cache = NginxCache(os.path.join(str(fast_tmp_path), "nginx"), "127.0.0.1", _free_port(), f"{host}:{port}").start()
    try:
        served.publish(2)
        monkeypatch.setenv(ORIGIN_ENV, origin.base_url)
        url = f"{cache.base_url}/run"
        for _ in range(3):
            local = served.local()
            assert pull(local, served.seed, url, 2).applied_version == 2
            assert_checkpoint_is(local, served.expected[2])
        for v in (1, 2):
            shard = os.path.basename(served.shards(v)[0])
            assert len(gets(origin, shard)) == 1, f"v{v}'s shard reached the origin more than once"
        assert len(gets(origin, f"weight_v000002/{INDEX}")) >= 3  # every pull read the commit point from the origin
        with open(os.path.join(cache.root, "access.log")) as f:
            log = f.read()
        assert INDEX not in log  # nobody asked the cache for an index
    finally:
        cache.stop()


@needs_nginx
def test_a_corrupted_entry_in_the_nginx_cache_is_refetched_from_the_origin_and_the_pull_is_bit_exact(
        served, origin, monkeypatch, fast_tmp_path):
    host, port = origin.server_address[:2]
    cache = NginxCache(os.path.join(str(fast_tmp_path), "nginx"), "127.0.0.1", _free_port(), f"{host}:{port}").start()
    try:
        served.publish(1)
        monkeypatch.setenv(ORIGIN_ENV, origin.base_url)
        url = f"{cache.base_url}/run"
        assert pull(served.local(), served.seed, url, 1).applied_version == 1  # fills the cache
        shard = os.path.basename(served.shards(1)[0])
        (entry,) = [p for p in cache.cache_files() if shard.encode() in open(p, "rb").read(4096)]
        data = bytearray(open(entry, "rb").read())
        data[-50] ^= 0xFF  # a byte of the cached body: nginx serves it as it is
        with open(entry, "wb") as f:
            f.write(data)
        local = served.local()
        assert pull(local, served.seed, url, 1).applied_version == 1
        assert_checkpoint_is(local, served.expected[1])
        assert len(gets(origin, shard)) == 2  # the cache's fill, then the checked refetch
    finally:
        cache.stop()


def test_publishing_to_an_http_source_is_refused_before_anything_is_written(fast_tmp_path, monkeypatch):
    from weightsync.errors import InvalidRequestError

    monkeypatch.chdir(fast_tmp_path)
    with pytest.raises(InvalidRequestError, match="read-only"):
        Publisher("http://127.0.0.1:9/run")
    assert os.listdir(fast_tmp_path) == []


def test_the_command_line_pulls_from_an_http_source_and_refuses_one_where_only_a_dir_works(served, origin, capsys):
    from weightsync.cli import main

    served.publish(1)
    url = f"{origin.base_url}/run"
    local = served.local()
    assert main(["pull", local, "--seed-dir", served.seed, "--source-dir", url, "--version", "1"]) == 0
    assert_checkpoint_is(local, served.expected[1])
    assert main(["--json", "verify", local, "--source-dir", url, "--version", "1", "--seed-dir", served.seed]) == 2
    assert "only pull reads one" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["message"]


def test_a_pull_on_a_local_state_reads_only_the_indexes_above_it_from_the_origin(served, origin):
    served.publish(4)
    url = f"{origin.base_url}/run"
    local = served.local()
    assert pull(local, served.seed, url, 3).applied_version == 3
    origin.served.clear()
    r = pull(local, served.seed, url, 4)
    assert r.applied_version == 4 and r.action == "chain" and r.deltas_applied == 1
    assert_checkpoint_is(local, served.expected[4])
    read = sorted(p.split("/")[2] for m, p, _ in origin.served if m == "GET" and p.endswith(INDEX))
    # v4's index and a probe for its side anchor; nothing below the local version
    assert "weight_v000004" in read and set(read) <= {"weight_v000004", "anchor_v000004"}


def test_a_shard_its_index_names_but_the_origin_lacks_is_not_ready_and_nothing_changes(served, origin):
    from weightsync.errors import SourceNotReadyError

    served.publish(2)
    url = f"{origin.base_url}/run"
    local = served.local()
    assert pull(local, served.seed, url, 1).applied_version == 1
    os.remove(served.shards(2)[0])  # pruned while a host planned from the index, say
    with pytest.raises(SourceNotReadyError) as e:
        pull(local, served.seed, url, 2)
    assert e.value.retryable
    assert_checkpoint_is(local, served.expected[1])


def test_an_origin_that_throttles_is_asked_again_and_the_pull_is_bit_exact(served, origin):
    served.publish(1)
    origin.throttle = 3  # 503 SlowDown for the next three payload requests
    local = served.local()
    assert pull(local, served.seed, f"{origin.base_url}/run", 1).applied_version == 1
    assert_checkpoint_is(local, served.expected[1])
    assert sum(p.endswith(" 503") for _, p, _ in origin.served) == 3


def test_an_origin_throttling_past_the_deadline_is_a_retryable_typed_error_and_nothing_changes(served, origin, monkeypatch):
    from weightsync.errors import HttpSourceUnavailableError

    served.publish(2)
    url = f"{origin.base_url}/run"
    local = served.local()
    assert pull(local, served.seed, url, 1).applied_version == 1
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_DEADLINE_S", "1")
    origin.throttle = 10**6
    with pytest.raises(HttpSourceUnavailableError) as e:
        pull(local, served.seed, url, 2)
    assert e.value.retryable and e.value.http_status == 503
    assert_checkpoint_is(local, served.expected[1])


def test_a_fresh_host_seeds_from_a_side_anchor_served_over_http(fast_tmp_path, rng):
    served = Served(str(fast_tmp_path), rng, anchor_fraction=0, anchor_max_deltas=2)
    with serving(served.www) as server:
        served.publish(5)
        anchors = sorted(n for n in os.listdir(served.run) if n.startswith("anchor_v"))
        assert anchors, "the publisher wrote no side anchor"
        local = served.local()
        r = pull(local, served.seed, f"{server.base_url}/run", 5)
        assert r.applied_version == 5 and "anchor" in r.reason
        assert_checkpoint_is(local, served.expected[5])
        newest = anchors[-1]
        assert [p for m, p, n in server.served if m == "GET" and f"/{newest}/" in p and p.endswith(".safetensors")]


def test_a_local_file_cut_short_under_its_marker_reseeds_through_the_full_walk_bit_exact(served, origin):
    served.publish(3)
    url = f"{origin.base_url}/run"
    local = served.local()
    assert pull(local, served.seed, url, 2).applied_version == 2
    weights = os.path.join(local, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) - 8)
    r = pull(local, served.seed, url, 3)  # the walk stops at v2 first; the reseed needs v1 too
    assert r.applied_version == 3 and r.action == "seed+chain"
    assert_checkpoint_is(local, served.expected[3])


def test_an_index_over_the_index_limit_on_the_origin_is_refused_by_its_length_and_nothing_changes(served, origin, monkeypatch):
    served.publish(2)
    url = f"{origin.base_url}/run"
    local = served.local()
    assert pull(local, served.seed, url, 1).applied_version == 1
    size = os.path.getsize(os.path.join(served.run, "weight_v000002", INDEX))
    monkeypatch.setenv("WEIGHTSYNC_MAX_INDEX_NBYTES", str(size - 1))
    with pytest.raises(errors.MalformedHeaderError, match=f"{size} bytes, over the {size - 1}-byte limit") as e:
        pull(local, served.seed, url, 2)
    assert url in str(e.value)  # the origin's URL, not a host-local path
    assert marker_version(local) == 1
    assert_checkpoint_is(local, served.expected[1])
    monkeypatch.setenv("WEIGHTSYNC_MAX_INDEX_NBYTES", str(size))
    assert pull(local, served.seed, url, 2).applied_version == 2
    assert_checkpoint_is(local, served.expected[2])
