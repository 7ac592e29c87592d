"""A BitTorrent v2 swarm among the engine hosts (issue 29, docs/FLEET.md), opt-in, through
libtorrent (the optional extra ``weightsync[swarm]``).

Publisher side: with ``WEIGHTSYNC_PUBLISH_TORRENT=1`` the committer writes
``weight_vNNNNNN/payload.torrent`` beside the payload files, before the index (the commit point):
a BitTorrent v2-only, private torrent of the files the index's ``weight_map`` names, named after
the version dir. v2 pieces are SHA-256 Merkle leaves, so every piece a host receives is checked
before it is kept or passed on, and a peer that sends bad bytes is found and banned.

Puller side (an HTTP(S) source, ``storage.http``): with peers configured
(``WEIGHTSYNC_SWARM_PEERS``, or ``pull(..., swarm=SwarmConfig(...))``), the mirror hands the
payload files it is about to fetch to ``fetch_into_mirror`` first. It reads the version's
torrent from the origin (past any cache), joins the swarm with the source URL as a BEP 19 web
seed (the source of truth keeps serving), and waits until every wanted file is complete, no
peer answers (``WEIGHTSYNC_SWARM_NO_PEER_S``), no byte arrives for ``WEIGHTSYNC_SWARM_STALL_S``,
or half the fetch deadline is spent. Each complete file is copied into the mirror only when it
matches the index's ``file_digests``; every other file is then fetched from the source as
without a swarm. The pull's per-tensor verification decides success either way.

The session lives as long as the process and keeps seeding the last versions it holds
(``WEIGHTSYNC_SWARM_KEEP_VERSIONS``), so late joiners read from peers, not the source. Its
files are a copy under ``<local>/.weight_sync/swarm/``, never the mirror's (which the spool
turns back into placeholders).

Trust: private torrents, DHT, local discovery, UPnP and NAT-PMP off, listening only where
``WEIGHTSYNC_SWARM_LISTEN`` says. Nothing here imports torch or sglang.
"""

from __future__ import annotations

import collections
import logging
import warnings
import os
import re
import shutil
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ..errors import SwarmConfigError, SwarmUnavailableError
from ..knobs import Knob

if TYPE_CHECKING:
    from .mirror import Mirror
    from .source import ObjectInfo

log = logging.getLogger(__name__)

TORRENT_NAME = "payload.torrent"
PUBLISH_TORRENT_ENV = "WEIGHTSYNC_PUBLISH_TORRENT"
PEERS_ENV = "WEIGHTSYNC_SWARM_PEERS"
LISTEN_ENV = "WEIGHTSYNC_SWARM_LISTEN"
TRACKER_ENV = "WEIGHTSYNC_SWARM_TRACKER"
SWARM_PIECE_NBYTES = Knob("WEIGHTSYNC_SWARM_PIECE_NBYTES", 0,
                          "piece size of a published torrent (a power of two >= 16 KiB); 0 = about 1,000 pieces, 64 KiB to 4 MiB")
SWARM_STALL_S = Knob("WEIGHTSYNC_SWARM_STALL_S", 8, "seconds without a new byte from the swarm before the rest is read from the source")
SWARM_NO_PEER_S = Knob("WEIGHTSYNC_SWARM_NO_PEER_S", 5, "seconds to find a peer before the source is read directly")
SWARM_WEB_SEED = Knob("WEIGHTSYNC_SWARM_WEB_SEED", 1, "1: the source is the swarm's web seed; 0: only peers, the source read directly for the rest")
SWARM_KEEP_VERSIONS = Knob("WEIGHTSYNC_SWARM_KEEP_VERSIONS", 2, "versions a host keeps seeding")

_ADDR_RE = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-_]+):([0-9]{1,5})$")


def _libtorrent(what: str):
    try:
        import libtorrent
    except ImportError as e:
        raise SwarmUnavailableError(what, str(e)) from None
    return libtorrent


def check_swarm_available() -> None:
    """Refuse, before anything is written, a swarm pull without libtorrent."""
    _libtorrent(f"a pull through the fleet swarm ({PEERS_ENV} or swarm=)")


def torrent_wanted() -> bool:
    """Whether the publisher writes a torrent beside each version (``WEIGHTSYNC_PUBLISH_TORRENT``)."""
    return os.environ.get(PUBLISH_TORRENT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def check_publish_torrent() -> None:
    """Refuse, before anything is written, a torrent asked for without libtorrent."""
    if torrent_wanted():
        _libtorrent(f"{PUBLISH_TORRENT_ENV}=1 (a torrent beside each published version)")


def _piece_nbytes(total: int) -> int:
    raw = int(SWARM_PIECE_NBYTES.get())
    if raw:
        if raw < 16 << 10 or raw & (raw - 1):
            raise SwarmConfigError(SWARM_PIECE_NBYTES.env, raw, "a power of two of at least 16384")
        return raw
    p = 64 << 10
    while p < (4 << 20) and total // p > 1000:
        p *= 2
    return p


def make_version_torrent(directory: str, files: list[str]) -> bytes:
    """A v2-only, private torrent of ``files`` (names inside ``directory``), named after the
    directory. Deterministic (no creation date, no creator): a retried commit writes the same bytes."""
    lt = _libtorrent("a torrent of a published version")
    fs = lt.file_storage()
    name = os.path.basename(os.path.normpath(directory))
    total = 0
    for f in sorted(files):
        size = os.path.getsize(os.path.join(directory, f))
        fs.add_file(f"{name}/{f}", size)
        total += size
    with warnings.catch_warnings():  # the binding marks this constructor deprecated; 2.1 has no other in Python
        warnings.simplefilter("ignore", DeprecationWarning)
        ct = lt.create_torrent(fs, _piece_nbytes(total), flags=lt.create_torrent.v2_only)
    ct.set_priv(True)
    lt.set_piece_hashes(ct, os.path.dirname(os.path.normpath(directory)))
    meta = ct.generate()
    for k in (b"creation date", b"created by"):
        meta.pop(k, None)
    return lt.bencode(meta)


def write_version_torrent(directory: str, files: list[str]) -> "str | None":
    """The publisher's step (before the index): ``payload.torrent`` when asked for, else nothing."""
    if not torrent_wanted() or not files:
        return None
    from ..fsio import write_bytes

    path = os.path.join(directory, TORRENT_NAME)
    write_bytes(path, make_version_torrent(directory, files))
    return path


# --- the puller's side ------------------------------------------------------------------------


def _parse_addr(setting: str, value: str) -> tuple[str, int]:
    m = _ADDR_RE.match(value.strip())
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise SwarmConfigError(setting, value, "host:port (an address of the cluster network)")
    return m.group(1).strip("[]"), int(m.group(2))


class SwarmConfig:
    """Where this host listens, and whom it asks: the fleet's roster (``peers``) and/or a tracker
    the operator runs. ``from_env()`` is None when no peer and no tracker is named (swarm off)."""

    def __init__(self, listen: str = "0.0.0.0:6881", peers: "list[str] | tuple[str, ...]" = (), tracker: "str | None" = None):
        self.listen = _parse_addr(LISTEN_ENV, listen)
        self.peers = [_parse_addr(PEERS_ENV, p) for p in peers if p.strip()]
        if tracker is not None and not re.match(r"^(https?|udp)://[^\s]+$", tracker):
            raise SwarmConfigError(TRACKER_ENV, tracker, "an http(s):// or udp:// tracker URL")
        self.tracker = tracker

    @classmethod
    def from_env(cls) -> "SwarmConfig | None":
        peers = [p for p in os.environ.get(PEERS_ENV, "").split(",") if p.strip()]
        tracker = os.environ.get(TRACKER_ENV, "").strip() or None
        if not peers and not tracker:
            return None
        return cls(os.environ.get(LISTEN_ENV, "").strip() or "0.0.0.0:6881", peers, tracker)

    def key(self) -> tuple:
        return (self.listen, tuple(self.peers), self.tracker)


class SwarmOutcome:
    """What one swarm fetch did (logged, and read by the benchmark)."""

    def __init__(self) -> None:
        self.delivered: list[str] = []  # mirror keys filled from the swarm, checked
        self.rejected: list[str] = []  # complete in the swarm but not matching file_digests
        self.fell_back: list[str] = []  # left to the source
        self.why = ""
        self.hash_failures = 0
        self.seconds = 0.0


class Swarm:
    """One libtorrent session per process (per listen address): joins a version's torrent,
    downloads wanted files, and keeps seeding the last versions."""

    def __init__(self, config: SwarmConfig, state_dir: str):
        lt = _libtorrent("the fleet swarm (WEIGHTSYNC_SWARM_PEERS)")
        self.lt = lt
        self.config = config
        self.state_dir = state_dir
        host, port = config.listen
        self.session = lt.session({
            "listen_interfaces": f"{host}:{port}",
            "enable_dht": False, "enable_lsd": False, "enable_upnp": False, "enable_natpmp": False,
            # Every peer is a fleet member: no choking games, short timeouts, deep request queues.
            "unchoke_slots_limit": -1, "connections_limit": 500, "allow_multiple_connections_per_ip": True,
            "tick_interval": 100, "request_timeout": 5, "peer_connect_timeout": 3, "urlseed_wait_retry": 2,
            # The web seed (the source) asked for a few pieces at a time, not 16 MiB runs: hosts then
            # take different pieces from it and trade the rest (16 hosts here: 3-4 copies from the
            # source instead of 4 and a slower fleet; every host reading it sends 16).
            "urlseed_max_request_bytes": 256 << 10,
            "max_out_request_queue": 1500, "max_allowed_in_request_queue": 2000,
            "send_buffer_watermark": 4 << 20, "send_buffer_low_watermark": 1 << 20,
            "alert_mask": lt.alert_category.error | lt.alert_category.status | lt.alert_category.peer | lt.alert_category.storage,
        })
        self.torrents: dict[str, Any] = {}  # version dir name -> libtorrent torrent_handle
        self.lock = threading.Lock()
        self.hash_failures = 0
        self.flushes: dict[str, int] = {}  # v2 info hash -> cache_flushed alerts seen

    def _drain_alerts(self) -> None:
        for a in self.session.pop_alerts():
            if isinstance(a, self.lt.hash_failed_alert):
                self.hash_failures += 1
            elif isinstance(a, self.lt.cache_flushed_alert):
                key = str(a.handle.info_hashes().v2)
                self.flushes[key] = self.flushes.get(key, 0) + 1

    def join(self, dir_name: str, torrent: bytes, web_seed: "str | None"):
        """The version's torrent, added once (again for a changed torrent); older versions past
        ``WEIGHTSYNC_SWARM_KEEP_VERSIONS`` are dropped with their files."""
        lt = self.lt
        ti = lt.torrent_info(lt.bdecode(torrent))
        # libtorrent turns a torrent of one file into a single-file torrent named after the file:
        # its file then lies (and is web-seeded) one dir down.
        sub = "" if ti.name() == dir_name else dir_name
        if sub and (len(_real_files(ti)) != 1 or "/" in ti.name()):
            raise SwarmConfigError("torrent name", ti.name(), f"the version dir {dir_name}")
        with self.lock:
            h = self.torrents.get(dir_name)
            if h is not None and h.is_valid() and str(h.info_hashes().v2) == str(ti.info_hashes().v2):
                return h, ti, sub
            if h is not None and h.is_valid():
                self.session.remove_torrent(h, lt.session.delete_files)
            save = os.path.join(self.state_dir, "swarm", sub)
            os.makedirs(save, exist_ok=True)
            p = lt.add_torrent_params()
            p.ti = ti
            p.save_path = save
            p.flags &= ~lt.torrent_flags.auto_managed
            p.flags &= ~lt.torrent_flags.paused
            if web_seed and SWARM_WEB_SEED.get():
                p.url_seeds = [web_seed.rstrip("/") + "/" + (sub + "/" if sub else "")]
            if self.config.tracker:
                p.trackers = [self.config.tracker]
            h = self.session.add_torrent(p)
            for addr in self.config.peers:
                if addr != self.config.listen:
                    h.connect_peer(addr)
            self.torrents[dir_name] = h
            self._drop_old()
            return h, ti, sub

    def _drop_old(self) -> None:
        keep = max(1, int(SWARM_KEEP_VERSIONS.get()))
        for name in sorted(self.torrents)[:-keep]:
            h = self.torrents.pop(name)
            if h.is_valid():
                self.session.remove_torrent(h, self.lt.session.delete_files)

    def close(self) -> None:
        with self.lock:
            for h in self.torrents.values():
                if h.is_valid():
                    self.session.remove_torrent(h)
            self.torrents = {}
        self.session.pause()


_recent: "collections.deque[SwarmOutcome]" = collections.deque(maxlen=16)


def recent_outcomes() -> list[SwarmOutcome]:
    """What the last swarm fetches of this process did (newest last): for logs and the benchmark."""
    return list(_recent)


_swarms: dict[tuple, Swarm] = {}
_swarms_lock = threading.Lock()


def _files(ti):
    with warnings.catch_warnings():  # the binding marks files() deprecated; 2.1 has no successor in Python
        warnings.simplefilter("ignore", DeprecationWarning)
        return ti.files()


def _real_files(ti) -> list[int]:
    """The torrent's file indexes less its pad files (v2 pads each file to a piece boundary)."""
    fs = _files(ti)
    return [i for i in range(fs.num_files()) if not fs.file_flags(i) & 1]


def swarm_for(config: SwarmConfig, state_dir: str) -> Swarm:
    """The process's session for ``config`` (created once: a host joins the swarm for its lifetime)."""
    with _swarms_lock:
        key = config.key() + (os.path.realpath(state_dir),)
        s = _swarms.get(key)
        if s is None:
            s = _swarms[key] = Swarm(config, state_dir)
        return s


def stop_swarms() -> None:
    """Stop seeding (the process is leaving the fleet)."""
    with _swarms_lock:
        for s in _swarms.values():
            s.close()
        _swarms.clear()


def fetch_into_mirror(swarm: Swarm, mirror: "Mirror", objs: "list[ObjectInfo]", web_seed: str,
                      budget_s: float, outcome: "SwarmOutcome | None" = None) -> set[str]:
    """Fill as many of ``objs`` (mirror keys ``weight_vN/<file>``) as the swarm delivers within
    ``budget_s``; returns the keys now in the mirror, each checked against the index's
    ``file_digests``. A version without a torrent, a file without a recorded digest, no peer,
    a stall: those files are left to the source."""
    from ..format.file_digests import digest_file

    out = outcome or SwarmOutcome()
    t0 = time.monotonic()
    digests = getattr(mirror.source, "digests", {}) or {}
    by_dir: dict[str, list] = {}
    for o in objs:
        d, _, name = o.key.partition("/")
        if name and "/" not in name and o.key in digests:
            by_dir.setdefault(d, []).append(o)
        else:
            out.fell_back.append(o.key)
    jobs = []  # (handle, torrent_info, {file index: obj})
    for d, group in sorted(by_dir.items()):
        try:
            torrent = mirror.source.read(f"{d}/{TORRENT_NAME}")
        except FileNotFoundError:
            out.fell_back += [o.key for o in group]
            continue
        try:
            h, ti, sub = swarm.join(d, torrent, web_seed)
        except RuntimeError as e:  # libtorrent's own error for a malformed torrent
            log.warning("swarm: %s/%s is unusable (%s): reading its files from the source", d, TORRENT_NAME, e)
            out.fell_back += [o.key for o in group]
            continue
        fs = _files(ti)
        index = {(sub + "/" if sub else "") + fs.file_path(i).replace(os.sep, "/"): i for i in _real_files(ti)}
        wanted = {}
        for o in group:
            i = index.get(o.key)
            if i is None or fs.file_size(i) != o.size:
                out.fell_back.append(o.key)
            else:
                wanted[i] = o
        prio = [0] * fs.num_files()
        for i in wanted:
            prio[i] = 4
        h.prioritize_files(prio)
        jobs.append((h, ti, wanted, os.path.join(swarm.state_dir, "swarm", sub)))
    pending = {(id(h), i): (h, ti, o) for h, ti, w, _ in jobs for i, o in w.items()}
    last_bytes, last_change = -1, time.monotonic()
    found_peer = False
    # A piece counts as complete once its hash passed, which can be before libtorrent's disk
    # thread wrote it to the file: a complete file is read only after a flush asked for then.
    flushing: dict[tuple, tuple] = {}  # pending key -> (flush count to wait past, asked at)
    last_kick = 0.0
    while pending:
        now = time.monotonic()
        swarm._drain_alerts()
        got = 0
        for h, ti, w, save in jobs:
            fp = h.file_progress(flags=swarm.lt.torrent_handle.piece_granularity)
            st = h.status()
            found_peer = found_peer or st.num_peers > 0
            ih = str(h.info_hashes().v2)
            for i, o in w.items():
                got += fp[i]
                k = (id(h), i)
                if k in pending and fp[i] == o.size and k not in flushing:
                    flushing[k] = (swarm.flushes.get(ih, 0), now)
                    h.flush_cache()
                elif k in flushing and (swarm.flushes.get(ih, 0) > flushing[k][0] or now - flushing[k][1] > 5):
                    del pending[k], flushing[k]
                    _deliver(os.path.join(save, _files(ti).file_path(i)), mirror, o, digests[o.key], digest_file, out)
        if got != last_bytes:
            last_bytes, last_change = got, now
        elif now - last_change > 1.5 and now - last_kick > 1.5:
            # A source that answered 503 (throttled) is put aside by libtorrent for a while; with
            # no byte coming, ask it again now rather than wait for the stall and read it directly.
            last_kick = now
            for h, _ti, _w, _save in jobs:
                for u in h.url_seeds():
                    h.remove_url_seed(u)
                    h.add_url_seed(u)
        if not pending:
            break
        if now - t0 > budget_s:
            out.why = f"the swarm's share of the deadline ({budget_s:.0f}s) ran out"
            break
        if not found_peer and now - t0 > float(SWARM_NO_PEER_S.get()):
            out.why = f"no peer answered in {float(SWARM_NO_PEER_S.get()):.0f}s"
            break
        if now - last_change > float(SWARM_STALL_S.get()):
            out.why = f"no byte from the swarm in {float(SWARM_STALL_S.get()):.0f}s"
            break
        time.sleep(0.02)
    out.fell_back += [o.key for _h, _ti, o in pending.values()]
    out.hash_failures = swarm.hash_failures
    out.seconds = time.monotonic() - t0
    if out.fell_back:
        log.warning("swarm: %d file(s) from the source instead (%s)", len(out.fell_back), out.why or "no torrent or digest")
    return set(out.delivered)


def _deliver(src: str, mirror: "Mirror", o: "ObjectInfo", expected, digest_file, out: SwarmOutcome) -> None:
    """A complete swarm file copied into the mirror, kept only when it matches ``file_digests``."""
    dst = mirror._path(o.key)
    tmp = dst + ".swarm"
    try:
        shutil.copyfile(src, tmp)
        got = digest_file(tmp)
        if got.nbytes != expected.nbytes or got.digest != expected.digest:
            out.rejected.append(o.key)
            out.fell_back.append(o.key)
            log.warning("swarm: %s does not match its index's file digest: read from the source", o.key)
            os.unlink(tmp)
            return
        os.replace(tmp, dst)
        out.delivered.append(o.key)
    except OSError as e:
        log.warning("swarm: %s could not be taken from the swarm (%s): read from the source", o.key, e)
        out.fell_back.append(o.key)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def mirror_prefetcher(config: SwarmConfig, local_checkpoint_dir: str, web_seed: str,
                      outcomes: "list[SwarmOutcome] | None" = None) -> Callable:
    """The hook ``Mirror.prepare`` calls with the objects it is about to fetch (``storage.mirror``)."""
    from ..format.layout import sync_dir

    swarm = swarm_for(config, sync_dir(local_checkpoint_dir))

    def prefetch(mirror: "Mirror", objs: "list[ObjectInfo]", deadline_left_s: float) -> set[str]:
        out = SwarmOutcome()
        _recent.append(out)
        if outcomes is not None:
            outcomes.append(out)
        # Half the deadline at most: the source must still be read in time for what is left.
        return fetch_into_mirror(swarm, mirror, objs, web_seed, max(1.0, deadline_left_s / 2), out)

    return prefetch


__all__ = ["TORRENT_NAME", "SwarmConfig", "SwarmOutcome", "Swarm", "swarm_for", "stop_swarms", "make_version_torrent",
           "write_version_torrent", "check_publish_torrent", "check_swarm_available", "torrent_wanted", "fetch_into_mirror", "mirror_prefetcher", "recent_outcomes"]
