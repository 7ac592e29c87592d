"""The HTTP source's walk under random sequences (issue 29): the walk of indexes stops at the host's
local version (the fast path: no listing, no reading below what the host holds), and falls back to a
walk down to a full version or v1 when the pull plans below it (a reseed: the seed dir rewritten,
local damage, a target below the host's version). Random publishes (deltas and full versions),
pulls of random versions on several hosts, local damage and seed rewrites; the oracle is the slow
path's answer: after every successful pull the host holds exactly the published bytes of the target
(but a no-op over a byte rewritten in place, which FORMAT.md says a no-op does not see), and a failed
pull is one the step explains. ``WEIGHTSYNC_HYPOTHESIS_PROFILE=thorough`` runs more.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

from core_support import marker_version, mutate, random_tensors, read_checkpoint_bytes, serving, tensor_bytes
from core_support import write_hf_checkpoint
from weightsync import Publisher, errors, pull

THOROUGH = os.environ.get("WEIGHTSYNC_HYPOTHESIS_PROFILE") == "thorough"
SIZES = {"embed": ("float32", (64, 32)), "w": ("float32", (48, 48)), "norm": ("float32", (32,))}
HOSTS = 3
STEPS: dict[str, int] = {}


def _count(step: str) -> None:
    STEPS[step] = STEPS.get(step, 0) + 1


def test_an_http_source_under_random_publishes_pulls_and_local_damage_serves_exact_bytes():
    rng = np.random.default_rng(29)

    class HttpModel(RuleBasedStateMachine):
        @initialize()
        def start(self):
            self.root = tempfile.mkdtemp(prefix="ws-http-model-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            self.www = os.path.join(self.root, "www")
            self.seed = os.path.join(self.root, "seed")
            self.tensors = [random_tensors(rng, SIZES)]
            write_hf_checkpoint(self.seed, self.tensors[0])
            self.expected = [tensor_bytes(self.tensors[0])]
            self.pub = Publisher(os.path.join(self.www, "run"), template_dir=self.seed, encoding="sparse-v1", workers=1)
            self.pub.seed_snapshot(self.tensors[0])
            self.server_cm = serving(self.www)
            self.url = self.server_cm.__enter__().base_url + "/run"
            self.hosts = [os.path.join(self.root, f"host{i}") for i in range(HOSTS)]
            self.applied: list[int | None] = [None] * HOSTS
            self.damaged = [False] * HOSTS  # a byte rewritten in place under the host's marker

        def teardown(self):
            self.pub.close()
            self.server_cm.__exit__(None, None, None)
            shutil.rmtree(self.root, ignore_errors=True)

        @rule(full=st.sampled_from([False, False, False, True]), density=st.sampled_from([0.01, 0.2]))
        def publish(self, full, density):
            v = len(self.tensors)
            new = mutate(self.tensors[-1], rng, density)
            self.pub.publish(v, new, full=True if full else None)
            self.tensors.append(new)
            self.expected.append(tensor_bytes(new))
            _count("publish full" if full else "publish")

        @rule(host=st.integers(0, HOSTS - 1), back=st.sampled_from([0, 0, 1, 3]))
        def pull_a_version(self, host, back):
            target = max(0, len(self.tensors) - 1 - back)
            try:
                result = pull(self.hosts[host], self.seed, self.url, target)
            except errors.WeightSyncError as e:
                # The one failure the model allows: a target below what the host holds.
                assert self.applied[host] is not None and target < self.applied[host], repr(e)
                _count("explained failure")
                return
            assert result.applied_version == target
            if result.action == "noop" and self.damaged[host]:
                # FORMAT.md: a no-op checks the marker's sizes, not every byte; a byte rewritten in
                # place is caught by the next version's checks (or a verify), not by a no-op.
                _count("noop over local damage (documented)")
                return
            assert read_checkpoint_bytes(self.hosts[host]) == self.expected[target], f"host {host} at v{target}"
            self.damaged[host] = False
            assert marker_version(self.hosts[host]) == target
            self.applied[host] = target
            _count(result.action)

        @rule(host=st.integers(0, HOSTS - 1))
        def pull_the_newest(self, host):
            self.pull_a_version(host, 0)

        @rule(host=st.integers(0, HOSTS - 1), pick=st.integers(0, 10**6))
        def damage_a_local_shard(self, host, pick):
            files = sorted(f for f in os.listdir(self.hosts[host]) if f.endswith(".safetensors")) \
                if os.path.isdir(self.hosts[host]) else []
            if not files:
                return
            path = os.path.join(self.hosts[host], files[pick % len(files)])
            with open(path, "r+b") as f:
                f.seek(-1 - pick % 64, os.SEEK_END)
                b = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([b[0] ^ 0x5A]))
            self.damaged[host] = True
            _count("local damage")

        @rule()
        def the_seed_dir_rewritten_with_its_own_bytes(self):
            for name in os.listdir(self.seed):
                path = os.path.join(self.seed, name)
                shutil.copyfile(path, path + ".tmp")
                os.replace(path + ".tmp", path)
            _count("seed dir rewritten")

    run_state_machine_as_test(HttpModel, settings=settings(
        max_examples=30 if THOROUGH else 5, stateful_step_count=25 if THOROUGH else 15, deadline=None,
    ))


def test_report_how_many_steps_ran():
    print(f"\nhttp model: {dict(sorted(STEPS.items()))}")
