"""The live version's identity: which bytes the engine's weights hold. No sglang here.

A version number alone does not name bytes: the core reseeds a local checkpoint for a new run
under the same source dir path, and for a seed dir replaced in place, and both restart or repeat
version numbers. So the live version carries what the core's applied-version marker carries
(``weightsync.puller.identity``): the source dir and the run that published the chain, and the
fingerprint of the seed it grew from. Version 0 is the seed itself, fingerprinted at start-up;
any source's chain starts there, so only the seed must match at version 0 (as in
``identity.mismatch``).

Every comparison uses all of it:

- ``why_not_base(live, held)``: may a chain whose end the local checkpoint holds be patched onto
  the live weights (staging)? Only if it grew from the same seed and, above version 0, the same
  source dir and run.
- ``is_serving(live, held)``: is the local checkpoint's version the one already served?
- ``ReloadWitness``: a reload names a version only if the dir's identity read before the reload
  equals the one read after and no pull ran meanwhile (otherwise the engine may hold bytes the
  marker no longer names).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from weightsync.puller.identity import NO_SEED


class LiveVersion(NamedTuple):
    version: int
    source_dir: Optional[str]  # None: version 0, the seed dir (any source's chain starts there)
    how: str
    run: Optional[str] = None  # the run that published the chain (None: an upstream writer's source)
    seed: Optional[str] = None  # the fingerprint of the seed the version grew from (None: unknown)

    def key(self) -> tuple:
        """What names the bytes: at version 0 the seed only, above it source, run and seed."""
        if self.version == 0:
            return (0, None, None, self.seed)
        return (self.version, self.source_dir, self.run, self.seed)

    def describe(self) -> str:
        origin = f"seed {short(self.seed)}" if self.version == 0 else (
            f"source {self.source_dir}, run {self.run or 'without an id'}, seed {short(self.seed)}")
        return f"v{self.version} ({origin}; {self.how})"


def short(fingerprint: Optional[str]) -> str:
    return fingerprint[:12] if fingerprint else "unknown"


def seed_version(seed_fingerprint: Optional[str], how: str = "start-up from the seed dir") -> LiveVersion:
    return LiveVersion(0, None, how, None, seed_fingerprint)


def from_held(held: Any, how: str) -> LiveVersion:
    """The live version after loading a local checkpoint whose ``held_version`` is ``held``."""
    return LiveVersion(held.version, held.source_dir if held.version > 0 else None, how,
                       held.run if held.version > 0 else None, held.seed)


def key_of_held(held: Any) -> Optional[tuple]:
    return None if held is None else from_held(held, "").key()


def why_not_base(live: LiveVersion, held: Any) -> Optional[str]:
    """Why the chain the local checkpoint holds (``held``) cannot be patched onto ``live``, or None."""
    if live.seed is None or live.seed == NO_SEED:
        return f"the live version v{live.version} has no seed fingerprint (its seed dir was not readable)"
    if held.seed != live.seed:
        if held.seed is None:
            return "the local checkpoint's marker records no seed fingerprint"
        return (f"the local checkpoint grew from another seed ({short(held.seed)}) than the live weights "
                f"({short(live.seed)}): the seed dir was replaced, or the pull reseeded from another model")
    if live.version > 0:
        if held.source_dir != live.source_dir:
            return f"the live version v{live.version} came from another source dir ({live.source_dir})"
        if held.run != live.run:
            return (f"the live version v{live.version} came from run {live.run or '(no id)'}; the local checkpoint "
                    f"holds run {held.run or '(no id)'} (a new run under the same source dir)")
    return None


def is_serving(live: Optional[LiveVersion], held: Any) -> bool:
    """The local checkpoint holds exactly the bytes the live weights hold (same version and identity)."""
    return live is not None and held is not None and live.seed not in (None, NO_SEED) and live.key() == key_of_held(held)


class ReloadWitness(NamedTuple):
    """What was true of a reload's dir just before the reload read it."""

    model_path: Optional[str]
    key: Optional[tuple]  # the dir's identity then (None: it named no verified version)
    pull_running: bool


def reload_outcome(before: Optional[ReloadWitness], model_path: Optional[str], success: bool,
                   after_key: Optional[tuple], pull_running_after: bool) -> Optional[str]:
    """None when a reload from ``model_path`` loaded exactly the version its dir names now, else why
    the live version is unknown.

    The reload reads the files while a pull (ours, on its own process, or another engine's on
    this host) may rewrite them: the marker read after the reload may name bytes the engine never
    loaded. Only an identity unchanged across the reload, with no pull of this engine running at
    either end, is taken (a pull is started and finished on the scheduler thread, which the reload
    holds, so none can run in between unseen).
    """
    if not success:
        return f"a reload from {model_path} failed"
    if after_key is None:
        return f"the weights were reloaded from {model_path}, which names no verified version"
    if before is None or before.model_path != model_path:
        return f"the weights were reloaded from {model_path}, but its version was not read before the reload"
    if before.pull_running or pull_running_after:
        return (f"the weights were reloaded from {model_path} while a /pull_weights was running and may have "
                "rewritten it: which version the engine loaded is not known")
    if before.key != after_key:
        was = f"v{before.key[0]}" if before.key else "no verified version"
        return (f"{model_path} changed during the reload (it held {was} before, v{after_key[0]} after): "
                "which version the engine loaded is not known")
    return None


__all__ = ["LiveVersion", "seed_version", "from_held", "key_of_held", "why_not_base", "is_serving", "ReloadWitness",
           "reload_outcome"]
