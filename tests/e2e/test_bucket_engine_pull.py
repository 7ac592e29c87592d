"""A real sglang CPU engine pulls from a bucket through ``POST /pull_weights`` and serves it.

One real S3 server (SeaweedFS ``weed mini`` on loopback) and one sglang server (TP=1) whose
environment holds the bucket's endpoint and credentials (the only place they come from) and
whose ``--pull-weights-allowed-roots`` names a bucket prefix. The trainer side publishes to
``s3://wsync/e2e/run`` with the core's ``Publisher``; the engine pulls into a host-local dir,
which must hold exactly the trainer's tensors, then reloads it and generates what transformers
generates from the same weights.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from testbed.tiny_qwen3 import SERVER_COMPUTE_ARGS
from tests.e2e.engine_pull_support import (
    assert_a_version_not_published_yet_is_not_ready, publish_and_pull_v2, pull, serve_v2_then_chain_v3)

pytestmark = pytest.mark.slow

URL_ROOT = "s3://wsync/e2e"


@pytest.fixture(scope="module")
def s3():
    from testbed.s3_server import S3Server

    root = tempfile.mkdtemp(prefix="ws-s3-e2e-")
    server = S3Server.start(root)
    saved = {k: os.environ.get(k) for k in (*server.env(), "WEIGHTSYNC_BUCKET_STAGING_DIR")}
    os.environ.update(server.env())  # the trainer side (this process) reaches the bucket the same way
    os.environ["WEIGHTSYNC_BUCKET_STAGING_DIR"] = os.path.join(root, "staging")
    try:
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_dir, server_factory, s3):
    from testbed.tiny_qwen3 import read_state_dict, to_raw_tensors
    from weightsync import Publisher

    root = tmp_path_factory.mktemp("bucket_pull")
    server = server_factory(
        tiny_model_dir,
        extra_args=[*SERVER_COMPUTE_ARGS, "--pull-weights-allowed-roots", f"{root},{URL_ROOT}"],
        env=s3.env(),
    )

    class Env:
        pass

    e = Env()
    e.server, e.model, e.root, e.s3 = server, tiny_model_dir, root, s3
    e.local = str(root / "local")
    e.url = f"{URL_ROOT}/run"
    e.expected = {0: read_state_dict(tiny_model_dir)}
    e.publisher = Publisher(e.url, encoding="sparse-v1", template_dir=tiny_model_dir)
    e.publisher.seed_snapshot(to_raw_tensors(e.expected[0]), version=0)
    yield e
    e.publisher.close()


def test_an_engine_pulls_a_chain_from_the_bucket_to_the_trainers_tensors_and_serves_it(env):
    publish_and_pull_v2(env)
    serve_v2_then_chain_v3(env)


def test_a_version_not_in_the_bucket_yet_is_not_ready(env):
    assert_a_version_not_published_yet_is_not_ready(env)


def test_a_bucket_outside_the_allowed_url_roots_is_forbidden(env):
    resp = pull(env, 1, source="s3://wsync/elsewhere/run")
    assert resp.status_code == 403, resp.text


def test_a_request_cannot_name_an_endpoint(env):
    resp = pull(env, 1, source=f"{env.url}?endpoint=http://127.0.0.2:9000")
    assert resp.status_code == 400, resp.text
