"""What the e2e tests ask of a server's live apply: the per-rank digests, and the map's proof.

Role: read ``POST /weights_digest`` (the plugin's debug call: every parameter's digest, its
storage pointer, the live version and the coordinate map's summary, on every scheduler rank of
every DP group and node), and wait until the map is proven on every rank.

Invariant: a test never races the map. The map is built and proven on a thread after start-up
(and proven again after a reload that voided the first proof); until every rank reports
``coordinate_map.proven``, a pull stages nothing and the next update reloads. Tests that need a
live apply call ``wait_until_map_proven`` first, which polls the plugin's own state instead of
sleeping for a guessed time.
"""

from __future__ import annotations

import time
from typing import Any

PROOF_TIMEOUT_S = 180.0
POLL_S = 0.5


def weights_digest(server: Any) -> dict[str, dict]:
    """Every rank's ``/weights_digest`` record, by rank label (``dp0/tp1``)."""
    resp = server.post("/weights_digest", {})
    assert resp.status_code == 200, resp.text
    return {r["rank"]: r for r in resp.json()["ranks"]}


def wait_until_map_proven(server: Any, timeout_s: float = PROOF_TIMEOUT_S) -> dict[str, dict]:
    """Poll ``/weights_digest`` until every rank's coordinate map is proven; the last records.

    Fails with every rank's map state when the deadline passes or a map failed to build.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        ranks = weights_digest(server)
        maps = {rank: r["coordinate_map"] for rank, r in ranks.items()}
        failed = {rank: m["error"] for rank, m in maps.items() if m.get("error") not in (None, "building")}
        assert not failed, f"the coordinate map failed to build: {failed}"
        if ranks and all(m.get("proven") for m in maps.values()):
            return ranks
        if time.monotonic() > deadline:
            raise AssertionError(f"the coordinate map is not proven on every rank after {timeout_s:.0f}s: {maps}")
        time.sleep(POLL_S)


def assert_same_weights(a: dict[str, dict], b: dict[str, dict]) -> None:
    """Two ``weights_digest`` results hold the same bytes in every parameter of every rank."""
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    for rank in a:
        assert sorted(a[rank]["digests"]) == sorted(b[rank]["digests"]), rank
        differ = [n for n in a[rank]["digests"] if a[rank]["digests"][n] != b[rank]["digests"][n]]
        assert not differ, f"{rank}: {len(differ)} parameter(s) differ: {differ}"
