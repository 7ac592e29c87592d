"""HTTP(S) sources in an engine request (issue 29): allowed only below an HTTP root of
``--pull-weights-allowed-roots``, matched on scheme, host and port exactly and then path segment
by segment, like paths and bucket prefixes; user info, a query or a fragment in the request is a
400 (the origin behind a cache comes from the server's environment only). No sglang."""

from __future__ import annotations

import pytest

from sglang_patch.paths import check_request_paths, parse_allowed_roots
from weightsync import errors

ROOT = "http://cache.fleet:8080/runs"


@pytest.fixture
def roots(tmp_path):
    return parse_allowed_roots(f"{tmp_path},{ROOT}/")


def check(tmp_path, source, roots):
    return check_request_paths(str(tmp_path / "local"), source, roots)


def test_an_http_root_is_kept_in_its_canonical_form_beside_paths_and_buckets(tmp_path):
    roots = parse_allowed_roots(f"{tmp_path}, https://cache:8443/a/b/ ,s3://wsync/runs,{ROOT},{ROOT}")
    assert roots == (str(tmp_path), "https://cache:8443/a/b", "s3://wsync/runs", ROOT)


def test_an_http_root_allows_its_own_prefix_and_what_lies_below_it(tmp_path, roots):
    assert check(tmp_path, ROOT, roots).source_dir == ROOT
    checked = check(tmp_path, f"{ROOT}/r1/", roots)
    assert checked.source_dir == f"{ROOT}/r1"
    assert checked.local_checkpoint_dir == str((tmp_path / "local").resolve())


def test_a_host_root_without_a_path_allows_every_path_on_that_host_and_port(tmp_path):
    roots = parse_allowed_roots(f"{tmp_path},http://127.0.0.1:9000")
    assert check(tmp_path, "http://127.0.0.1:9000/any/run", roots).source_dir == "http://127.0.0.1:9000/any/run"


@pytest.mark.parametrize("sibling", [
    "http://cache.fleet:8080/runs2/r1",  # a sibling path sharing the prefix's characters
    "http://cache.fleet:8080/run",
    "http://cache.fleet:8080",  # above the root
    "http://cache.fleet:8081/runs/r1",  # another port
    "http://cache.fleet/runs/r1",  # the default port is another host[:port]
    "https://cache.fleet:8080/runs/r1",  # another scheme
    "http://cache2.fleet:8080/runs/r1",  # another host
    "http://cache.fleet.evil:8080/runs/r1",
    "http://10.0.0.1:8080/runs/r1",
])
def test_an_http_root_refuses_a_sibling_host_port_scheme_or_path(tmp_path, roots, sibling):
    with pytest.raises(errors.PathNotAllowedError) as e:
        check(tmp_path, sibling, roots)
    assert e.value.http_status == 403


@pytest.mark.parametrize("bad", [
    "http://user:pw@cache.fleet:8080/runs/r1",  # user info
    "http://cache.fleet:8080@evil:80/runs/r1",
    "http://cache.fleet:8080/runs/r1?origin=http://10.0.0.1",  # a query
    "http://cache.fleet:8080/runs/r1#frag",
    "http://cache.fleet:8080/runs/../secret",  # a '..' segment
    "http://cache.fleet:8080/runs//r1",
    "http://cache.fleet:8080/runs/r 1",
    "http://cache.fleet:8080/runs/r1\\x",
    "http:///runs/r1",  # no host
])
def test_an_http_source_with_user_info_a_query_or_a_dot_segment_is_a_bad_request(tmp_path, roots, bad):
    with pytest.raises(errors.InvalidRequestError) as e:
        check(tmp_path, bad, roots)
    assert e.value.http_status == 400


def test_an_http_source_is_forbidden_when_only_paths_or_buckets_are_allowed(tmp_path):
    for roots in (parse_allowed_roots(str(tmp_path)), parse_allowed_roots(f"{tmp_path},s3://wsync/runs")):
        with pytest.raises(errors.PathNotAllowedError) as e:
            check(tmp_path, f"{ROOT}/r1", roots)
        assert "no HTTP root is allowed" in str(e.value)


def test_an_http_root_allows_no_local_path_and_no_bucket(tmp_path):
    roots = parse_allowed_roots(f"{tmp_path / 'local'},{ROOT}")
    with pytest.raises(errors.PathNotAllowedError):
        check(tmp_path, str(tmp_path / "src"), roots)
    with pytest.raises(errors.PathNotAllowedError):
        check(tmp_path, "s3://cache.fleet/runs/r1", roots)
    with pytest.raises(errors.PathNotAllowedError):  # the local dir must still lie below a path root
        check_request_paths(str(tmp_path / "elsewhere"), f"{ROOT}/r1", roots)


def test_a_url_source_still_refuses_a_local_dir_over_the_engines_own_model(tmp_path):
    roots = parse_allowed_roots(f"{tmp_path},{ROOT},s3://wsync/runs")
    seed = tmp_path / "model"
    seed.mkdir()
    for source in (f"{ROOT}/r1", "s3://wsync/runs/r1"):
        with pytest.raises(errors.InvalidRequestError) as e:
            check_request_paths(str(seed / "local"), source, roots, seed_dir=str(seed))
        assert e.value.http_status == 400 and "seed" in str(e.value)


@pytest.mark.parametrize("bad", ["http://user:pw@cache:8080/runs", "http://cache:8080/runs?x=1", "http://cache:8080/a/../b",
                                 "http://cache:notaport/runs"])
def test_a_bad_http_root_fails_at_start(bad):
    with pytest.raises(ValueError):
        parse_allowed_roots(bad)


def test_a_request_body_cannot_carry_an_origin_or_cache_setting():
    from sglang_patch.pull.request import PullRequestBody, parse_pull_body

    body = parse_pull_body(b'{"local_checkpoint_dir": "/data/local", "source_dir": "http://cache:8080/runs/r1", '
                           b'"target_version": 1, "origin": "http://10.0.0.1", "WEIGHTSYNC_HTTP_ORIGIN": "http://10.0.0.1"}')
    assert body.source_dir == "http://cache:8080/runs/r1"
    assert set(PullRequestBody.__struct_fields__) == {"local_checkpoint_dir", "source_dir", "target_version"}
