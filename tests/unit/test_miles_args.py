"""The weight-sync flags: both spellings select disk-delta; impossible combinations are refused."""

from __future__ import annotations

import argparse

import pytest

from miles_updater.args import (
    UpdateWeightArgsError,
    add_update_weight_arguments,
    is_disk_delta,
    validate_update_weight_args,
)


@pytest.fixture()
def hf_dir(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    return str(d)


def parse(argv):
    return add_update_weight_arguments(argparse.ArgumentParser()).parse_args(argv)


def good(hf_dir, tmp_path, *extra):
    return ["--update-weight-disk-dir", str(tmp_path / "shared"),
            "--update-weight-local-checkpoint-dir", str(tmp_path / "local"),
            "--hf-checkpoint", hf_dir, *extra]


def test_miles_spelling_selects_disk_delta(hf_dir, tmp_path):
    cfg = validate_update_weight_args(parse(["--update-weight-transfer-mode", "disk-delta", *good(hf_dir, tmp_path)]))
    assert cfg.source_dir == str(tmp_path / "shared") and cfg.encoding == "sparse-v1" and cfg.checksum == "xxh3-128"


def test_slime_spelling_selects_disk_delta(hf_dir, tmp_path):
    args = parse(["--update-weight-mode", "delta", "--update-weight-transport", "disk",
                  "--update-weight-delta-encoding", "xor", "--update-weight-delta-checksum", "blake3",
                  "--update-weight-full-every", "5", *good(hf_dir, tmp_path)])
    cfg = validate_update_weight_args(args)
    assert (cfg.encoding, cfg.checksum, cfg.full_every) == ("xor", "blake3", 5)


def test_no_disk_delta_flags_means_not_selected(hf_dir, tmp_path):
    args = parse([])
    assert not is_disk_delta(args) and validate_update_weight_args(args) is None


def test_existing_host_flags_are_left_to_the_host_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-checkpoint", default="owned-by-host")
    parser.add_argument("--colocate", action="store_true")
    add_update_weight_arguments(parser)  # would raise on a clash
    assert parser.parse_args([]).hf_checkpoint == "owned-by-host"


def test_delta_without_disk_transport_is_refused(hf_dir, tmp_path):
    args = parse(["--update-weight-mode", "delta", "--update-weight-transport", "nccl", *good(hf_dir, tmp_path)])
    with pytest.raises(UpdateWeightArgsError, match="needs --update-weight-transport disk.*got.*'nccl'"):
        validate_update_weight_args(args)
    args = parse(["--update-weight-mode", "delta", *good(hf_dir, tmp_path)])
    with pytest.raises(UpdateWeightArgsError, match="Add '--update-weight-transport disk'"):
        validate_update_weight_args(args)


def test_delta_with_colocated_engines_is_refused(hf_dir, tmp_path):
    args = parse(["--update-weight-transfer-mode", "disk-delta", "--colocate", *good(hf_dir, tmp_path)])
    with pytest.raises(UpdateWeightArgsError, match="does not support --colocate.*Drop --colocate"):
        validate_update_weight_args(args)


def test_missing_local_checkpoint_dir_is_refused(hf_dir, tmp_path):
    args = parse(["--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", str(tmp_path / "s"),
                  "--hf-checkpoint", hf_dir])
    with pytest.raises(UpdateWeightArgsError, match="needs --update-weight-local-checkpoint-dir: a host-local"):
        validate_update_weight_args(args)


def test_missing_disk_dir_is_refused(hf_dir, tmp_path):
    args = parse(["--update-weight-transfer-mode", "disk-delta", "--update-weight-local-checkpoint-dir",
                  str(tmp_path / "l"), "--hf-checkpoint", hf_dir])
    with pytest.raises(UpdateWeightArgsError, match="needs --update-weight-disk-dir"):
        validate_update_weight_args(args)


def test_hub_id_as_hf_checkpoint_is_refused(tmp_path):
    args = parse(["--update-weight-transfer-mode", "disk-delta", *good("Qwen/Qwen3-4B", tmp_path)])
    with pytest.raises(UpdateWeightArgsError, match="'Qwen/Qwen3-4B' is not a local directory.*Download it first"):
        validate_update_weight_args(args)


def test_local_checkpoint_dir_equal_to_seed_is_refused(hf_dir, tmp_path):
    args = parse(["--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", str(tmp_path / "s"),
                  "--update-weight-local-checkpoint-dir", hf_dir, "--hf-checkpoint", hf_dir])
    with pytest.raises(UpdateWeightArgsError, match="is the --hf-checkpoint dir"):
        validate_update_weight_args(args)


def test_conflicting_spellings_are_refused(hf_dir, tmp_path):
    args = parse(["--update-weight-transfer-mode", "disk-delta", "--update-weight-transport", "nccl",
                  *good(hf_dir, tmp_path)])
    with pytest.raises(UpdateWeightArgsError, match="conflicts with --update-weight-transport 'nccl'"):
        validate_update_weight_args(args)


def test_out_of_range_knobs_are_refused(hf_dir, tmp_path):
    base = ["--update-weight-transfer-mode", "disk-delta", *good(hf_dir, tmp_path)]
    with pytest.raises(UpdateWeightArgsError, match="fallback-fraction must be in"):
        validate_update_weight_args(parse(base + ["--update-weight-fallback-fraction", "1.5"]))
    with pytest.raises(UpdateWeightArgsError, match="keep-versions must be >= 0"):
        validate_update_weight_args(parse(base + ["--update-weight-keep-versions", "-1"]))
    with pytest.raises(UpdateWeightArgsError, match="not an import path"):
        validate_update_weight_args(parse(base + ["--custom-update-weight-post-write-path", "nodots"]))
    with pytest.raises(UpdateWeightArgsError, match="keep-runs must be >= 0"):
        validate_update_weight_args(parse(base + ["--update-weight-keep-runs", "-1"]))
    with pytest.raises(UpdateWeightArgsError, match="publish-attempts must be >= 1"):
        validate_update_weight_args(parse(base + ["--update-weight-publish-attempts", "0"]))


def test_apply_mode_defaults_to_auto_and_takes_live_or_reload(hf_dir, tmp_path):
    base = ["--update-weight-transfer-mode", "disk-delta", *good(hf_dir, tmp_path)]
    assert validate_update_weight_args(parse(base)).apply_mode == "auto"
    assert validate_update_weight_args(parse(base + ["--update-weight-apply", "reload"])).apply_mode == "reload"
    with pytest.raises(SystemExit):
        parse(base + ["--update-weight-apply", "fast"])


def test_unknown_encoding_is_refused_by_the_parser():
    with pytest.raises(SystemExit):
        parse(["--update-weight-delta-encoding", "gzip"])


def test_encoding_auto_takes_the_declared_link(hf_dir, tmp_path):
    args = parse(["--update-weight-transfer-mode", "disk-delta", "--update-weight-delta-encoding", "auto",
                  "--update-weight-link-bytes-per-s", "31e6", *good(hf_dir, tmp_path)])
    cfg = validate_update_weight_args(args)
    assert (cfg.encoding, cfg.link_bytes_per_s) == ("auto", 31e6)


@pytest.mark.parametrize("link", [None, "0", "-1", "inf", "nan"])
def test_encoding_auto_without_a_positive_link_is_refused(hf_dir, tmp_path, link):
    extra = [] if link is None else ["--update-weight-link-bytes-per-s", link]
    args = parse(["--update-weight-transfer-mode", "disk-delta", "--update-weight-delta-encoding", "auto", *extra,
                  *good(hf_dir, tmp_path)])
    with pytest.raises(UpdateWeightArgsError, match="--update-weight-link-bytes-per-s > 0"):
        validate_update_weight_args(args)


def test_the_engine_wait_has_no_cap_by_default_and_the_bound_counts_every_call_of_the_phase(hf_dir, tmp_path):
    from miles_updater.args import engine_phase_bound_s

    cfg = validate_update_weight_args(parse(["--update-weight-transfer-mode", "disk-delta", *good(hf_dir, tmp_path),
                                             "--update-weight-pull-timeout-s", "3000"]))
    # 3 pulls (baseline, catch-up, the pull), each a same-target wait + one more attempt; 10 engine calls.
    assert engine_phase_bound_s(cfg) == 3 * (3000 + 3000) + 10 * 120
    assert cfg.wait_timeout_s is None  # the others wait while rank 0's heartbeat is fresh


def test_an_engine_wait_shorter_than_the_engine_phase_is_refused_naming_both(hf_dir, tmp_path):
    argv = ["--update-weight-transfer-mode", "disk-delta", *good(hf_dir, tmp_path),
            "--update-weight-pull-timeout-s", "3600", "--update-weight-engine-wait-timeout-s", "1800"]
    with pytest.raises(UpdateWeightArgsError) as e:
        validate_update_weight_args(parse(argv))
    msg = str(e.value)
    assert "--update-weight-engine-wait-timeout-s 1800" in msg and "--update-weight-pull-timeout-s 3600" in msg
    assert "at least 22800" in msg  # 3 x (3600 + 3600) + 10 x 120
    ok = validate_update_weight_args(parse(argv[:-1] + ["22800"]))
    assert ok.wait_timeout_s == 22800


@pytest.mark.parametrize("flag,value", [("--update-weight-pull-timeout-s", "0"),
                                        ("--update-weight-engine-timeout-s", "inf"),
                                        ("--update-weight-not-ready-retry-s", "-1")])
def test_a_timeout_that_bounds_nothing_is_refused(hf_dir, tmp_path, flag, value):
    with pytest.raises(UpdateWeightArgsError, match=flag):
        validate_update_weight_args(parse(["--update-weight-transfer-mode", "disk-delta", *good(hf_dir, tmp_path),
                                           flag, value]))


def test_an_updater_built_from_a_config_with_a_short_engine_wait_is_refused_before_any_collective(hf_dir, tmp_path):
    from miles_updater.args import DiskDeltaConfig
    from miles_updater.updater import DiskDeltaWeightUpdater

    config = DiskDeltaConfig(source_dir=str(tmp_path / "shared"), local_checkpoint_dir=str(tmp_path / "local"),
                             hf_checkpoint=hf_dir, pull_timeout_s=600.0, engine_wait_timeout_s=300.0)
    with pytest.raises(UpdateWeightArgsError, match="--update-weight-engine-wait-timeout-s 300 .*"
                                                    "--update-weight-pull-timeout-s 600"):
        DiskDeltaWeightUpdater(config, [])  # no process group exists: the check comes first
