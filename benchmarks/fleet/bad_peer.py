"""A fleet member that serves wrong bytes (the fault "a peer corrupts pieces", issue 29.4): a
libtorrent seed over true copies of a version's payload files, checked, then one byte flipped in
every 16 KiB of them on disk (libtorrent does not hash what it uploads, so the rot goes out as is;
in seed mode it would hash each piece on first request and refuse to serve it). A real peer, the
real protocol; only its disk lies. Receivers check each piece against the torrent's SHA-256
Merkle tree, so nothing it sends is kept, and libtorrent bans it after its bad pieces.

    python -m benchmarks.fleet.bad_peer --torrent T --files DIR --listen IP:PORT --work W --ready R
"""

from __future__ import annotations

import argparse
import os
import shutil
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--torrent", required=True, help="the version's payload.torrent")
    ap.add_argument("--files", required=True, help="the version dir (the true files, copied then corrupted)")
    ap.add_argument("--listen", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--ready", required=True)
    ap.add_argument("--linger-s", type=float, default=600)
    a = ap.parse_args()
    import libtorrent as lt

    with open(a.torrent, "rb") as f:
        ti = lt.torrent_info(lt.bdecode(f.read()))
    name = ti.name()
    single = os.path.isfile(os.path.join(a.files, name))  # a one-file torrent is named after its file
    save = a.work
    dst_dir = save if single else os.path.join(save, name)
    os.makedirs(dst_dir, exist_ok=True)
    for fn in os.listdir(a.files):
        if fn.endswith(".safetensors"):
            dst = os.path.join(dst_dir, fn)
            shutil.copyfile(os.path.join(a.files, fn), dst)
    ses = lt.session({"listen_interfaces": a.listen, "enable_dht": False, "enable_lsd": False, "enable_upnp": False,
                      "enable_natpmp": False, "unchoke_slots_limit": -1, "allow_multiple_connections_per_ip": True})
    p = lt.add_torrent_params()
    p.ti = ti
    p.save_path = save
    p.flags &= ~lt.torrent_flags.auto_managed
    p.flags &= ~lt.torrent_flags.paused
    h = ses.add_torrent(p)
    deadline = time.monotonic() + 30
    while not h.status().is_seeding:  # "ready" only once it claims every piece
        if time.monotonic() > deadline:
            raise SystemExit(f"bad_peer: the torrent never reached seeding ({h.status().state})")
        time.sleep(0.05)
    for fn in os.listdir(dst_dir):  # checked and seeding: now the disk rots
        with open(os.path.join(dst_dir, fn), "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            for off in range(100, size, 16 << 10):
                f.seek(off)
                b = f.read(1)
                f.seek(off)
                f.write(bytes([b[0] ^ 0x5A]))
    with open(a.ready, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(a.linger_s)


if __name__ == "__main__":
    main()
