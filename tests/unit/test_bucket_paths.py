"""Bucket URLs as source dirs: parsed strictly, and allowed in an engine request only below a
URL root of ``--pull-weights-allowed-roots``, matched segment by segment like paths. No sglang."""

from __future__ import annotations

import pytest

from sglang_patch.paths import check_request_paths, parse_allowed_roots
from weightsync import errors
from weightsync.storage.url import is_bucket_url, parse_bucket_url, url_within


def test_a_bucket_url_is_parsed_to_its_canonical_form():
    assert str(parse_bucket_url("s3://wsync/runs/r1/")) == "s3://wsync/runs/r1"
    assert str(parse_bucket_url("gs://my-bucket")) == "gs://my-bucket"
    assert is_bucket_url("az://c/p") and not is_bucket_url("/data/s3://x")


@pytest.mark.parametrize("bad", [
    "s3://", "s3:///p", "s3://b/p", "s3://bkt/../p", "s3://bkt//p", "s3://bkt/p?endpoint=http://evil", "s3://user:pw@b/p",
    "s3://bkt/p#x", "s3://B_/p", "http://b/p", "s3://bkt/p q",
])
def test_a_url_that_names_more_than_a_bucket_and_prefix_is_refused(bad):
    with pytest.raises(errors.InvalidRequestError):
        parse_bucket_url(bad)


def test_url_roots_match_segment_by_segment_like_paths():
    assert url_within("s3://bkt/run", "s3://bkt/run") and url_within("s3://bkt/run/x", "s3://bkt/run")
    assert not url_within("s3://bkt/run2", "s3://bkt/run")
    assert not url_within("s3://other/run", "s3://bkt/run") and not url_within("gs://bkt/run", "s3://bkt/run")
    assert url_within("s3://bkt/anything", "s3://bkt")


def test_an_engine_request_may_name_a_bucket_only_below_an_allowed_url_root(tmp_path):
    roots = parse_allowed_roots(f"{tmp_path},s3://wsync/runs")
    checked = check_request_paths(str(tmp_path / "local"), "s3://wsync/runs/r1/", roots)
    assert checked.source_dir == "s3://wsync/runs/r1"
    with pytest.raises(errors.PathNotAllowedError):
        check_request_paths(str(tmp_path / "local"), "s3://wsync/runs2/r1", roots)
    with pytest.raises(errors.PathNotAllowedError):
        check_request_paths(str(tmp_path / "local"), "s3://wsync/runs/r1", parse_allowed_roots(str(tmp_path)))


def test_an_engine_request_cannot_name_an_endpoint_or_credentials(tmp_path):
    roots = parse_allowed_roots(f"{tmp_path},s3://wsync/runs")
    for bad in ("s3://wsync/runs/r1?endpoint=http://10.0.0.1", "s3://key:secret@wsync/runs/r1"):
        with pytest.raises(errors.InvalidRequestError) as e:
            check_request_paths(str(tmp_path / "local"), bad, roots)
        assert e.value.http_status == 400


def test_a_url_root_does_not_allow_local_paths_and_a_bad_url_root_fails_at_start(tmp_path):
    with pytest.raises(errors.PathNotAllowedError):
        check_request_paths(str(tmp_path / "local"), str(tmp_path / "src"), parse_allowed_roots("s3://wsync/runs"))
    with pytest.raises(ValueError):
        parse_allowed_roots("s3://wsync/../x")


def test_a_credentials_refusal_with_no_credentials_in_the_environment_says_none_were_set(monkeypatch):
    from weightsync.storage import client

    for names in client._CREDENTIAL_VARIABLES.values():
        for n in names:
            monkeypatch.delenv(n, raising=False)
    assert "AWS_ACCESS_KEY_ID" in client._no_credentials_named("s3")
    assert "GOOGLE_APPLICATION_CREDENTIALS" in client._no_credentials_named("gs")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "set")
    assert client._no_credentials_named("s3") == ""  # then the store's own answer is what counts


@pytest.mark.parametrize("url, variable", [
    ("s3://b/run", "AWS_ENDPOINT_URL"), ("az://c/run", "AZURE_STORAGE_ENDPOINT"), ("gs://b/run", "gcs_base_url"),
])
def test_a_store_that_did_not_answer_names_the_endpoint_variable_of_its_own_store(url, variable):
    from weightsync.errors import BucketUnavailableError

    message = str(BucketUnavailableError(url, "GET x", "connection refused"))
    assert variable in message
    assert ("AWS_ENDPOINT_URL" in message) == url.startswith("s3://")


def test_a_changed_request_or_retry_timeout_gets_a_new_client_and_the_same_environment_the_same(monkeypatch):
    pytest.importorskip("obstore")
    from weightsync.storage.client import open_store
    from weightsync.storage.url import parse_bucket_url

    for k, v in {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ALLOW_HTTP": "true", "AWS_REGION": "us-east-1",
                 "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}.items():
        monkeypatch.setenv(k, v)
    url = parse_bucket_url("s3://bucket/run")
    first = open_store(url)
    assert open_store(url) is first
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_RETRY_TIMEOUT_S", "1")
    second = open_store(url)
    assert second is not first
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_REQUEST_TIMEOUT_S", "7")
    assert open_store(url) is not second


def test_an_azure_url_with_no_account_in_the_environment_is_a_config_error_naming_the_variables(monkeypatch, tmp_path):
    pytest.importorskip("obstore")
    from weightsync import pull

    for k in list(__import__("os").environ):
        if k.startswith(("AWS_", "AZURE_", "AZURITE_", "GOOGLE_")):
            monkeypatch.delenv(k)
    local = tmp_path / "local"
    with pytest.raises(errors.BucketConfigError) as e:
        pull(str(local), str(tmp_path / "seed"), "az://container/run1", 1)
    assert not e.value.retryable and e.value.http_status == 400
    assert "AZURE_STORAGE_ACCOUNT_NAME" in str(e.value) and not local.exists()
