"""OffloadConfig: the seed's dicts accepted verbatim, every bad value refused by name."""

import json
import os

import pytest
import torch

import hetstore
from hetstore import ConfigError, OffloadConfig
from hetstore._sizes import format_duration, format_size, parse_size, short_repr
from tests.api.helpers import SEED_AUTO, SEED_MANUAL


@pytest.mark.parametrize(
    "text, expected",
    [
        ("512GB", 512 * 2**30),
        ("1.5GiB", 3 * 2**29),
        ("100MB", 100 * 2**20),
        ("30GB", 30 * 2**30),  # MindSpore's max_device_memory: binary
        ("4096", 4096),
        ("64KiB", 65536),
        ("2 tb", 2 * 2**40),
        ("1g", 2**30),
        ("0", 0),
        (12345, 12345),
        ("8B", 8),
    ],
)
def test_parse_size_table(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["-1GB", -5, "lots", "1.5XB", "", "GB", True, None, [1], "nan"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_format_size_is_binary():
    assert format_size(3 * 2**29) == "1.50 GiB"
    assert format_size(512) == "512 B"
    assert format_size(None) == "unlimited"


def test_format_duration_reads_at_a_glance():
    """Milliseconds under 10 s, then s, min, h: a plan's '465782.8 ms' reads '7.8 min'."""
    assert format_duration(0.1372) == "137.2 ms"
    assert format_duration(9.9) == "9900.0 ms"
    assert format_duration(12.34) == "12.3 s"
    assert format_duration(465.7828) == "7.8 min"
    assert format_duration(6044.0) == "100.7 min"
    assert format_duration(3 * 3600) == "3.0 h"
    assert format_duration(-0.5) == "-500.0 ms"
    assert format_duration(None) == "unknown"


@pytest.mark.parametrize("seed", [SEED_MANUAL, SEED_AUTO], ids=["manual", "auto"])
def test_seed_dicts_accepted_verbatim(seed):
    config = OffloadConfig.from_mindspore(seed, max_device_memory="30GB")
    assert config.offload_param == "cpu"
    # MindSpore's "parameters" include optimizer states: both follow offload_param.
    assert config.offload_optimizer == "cpu"
    assert config.grad_tier == "cpu"
    assert config.auto_offload is seed["auto_offload"]
    assert config.offload_cpu_size == 512 * 2**30
    assert config.offload_disk_size == 1024 * 2**30
    assert config.host_mem_block_size == 2**30
    assert config.max_device_memory == 30 * 2**30
    assert config.offload_path == "./offload/"
    assert config.enable_aio is True and config.enable_pinned_mem is True


def test_seed_context_memory_offload_off_places_everything_on_device():
    config = OffloadConfig.from_mindspore(SEED_MANUAL, memory_offload="OFF", mode=0)
    assert config.offload_param == "none" and config.offload_optimizer == "none"


def test_every_mindspore_key_and_ours_accepted_by_constructor():
    config = OffloadConfig(
        offload_param="disk",
        offload_optimizer="cpu",
        offload_grad="cpu",
        offload_activations="disk",
        auto_offload=True,
        max_device_memory="8GB",
        offload_cpu_size="64GB",
        offload_disk_size=2**40,
        offload_path="/tmp/x",
        hbm_ratio=0.9,
        cpu_ratio=0.5,
        gpu_margin_mem_ratio=0.8,
        host_mem_block_size="256MB",
        enable_pinned_mem=False,
        enable_aio=False,
        aio_block_size="1MB",
        aio_queue_depth=8,
        aio_threads=4,
        compute_dtype="bf16",
        device="cpu",
        prefetch_depth=2,
    )
    assert config.max_device_memory == 8 * 2**30
    assert config.torch_compute_dtype == torch.bfloat16
    assert config.resolved_device() == torch.device("cpu")
    assert isinstance(config.offload_cpu_size, int)


def test_frozen_and_keyword_only():
    config = OffloadConfig()
    with pytest.raises(AttributeError):
        config.offload_param = "cpu"
    with pytest.raises(ConfigError, match="keyword"):
        OffloadConfig("cpu")


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    "kwargs, names",
    [
        ({"offload_parm": "cpu"}, ["offload_parm", "did you mean 'offload_param'"]),
        ({"max_device_memroy": "8GB"}, ["max_device_memroy", "did you mean 'max_device_memory'"]),
        ({"offload_param": "gpu"}, ["offload_param", "'gpu'", "'none', 'cpu', 'disk'"]),
        ({"offload_optimizer": "nvme"}, ["offload_optimizer", "'nvme'"]),
        ({"offload_grad": 1}, ["offload_grad"]),
        ({"offload_activations": "host"}, ["offload_activations", "'host'"]),
        ({"auto_offload": "yes"}, ["auto_offload", "True or False"]),
        ({"enable_aio": 1}, ["enable_aio"]),
        ({"hbm_ratio": 0}, ["hbm_ratio", "(0, 1]"]),
        ({"hbm_ratio": 1.5}, ["hbm_ratio", "1.5"]),
        ({"cpu_ratio": -0.1}, ["cpu_ratio"]),
        ({"cpu_ratio": "half"}, ["cpu_ratio", "'half'"]),
        ({"gpu_margin_mem_ratio": 2}, ["gpu_margin_mem_ratio", "[0, 1]"]),
        ({"max_device_memory": "-1GB"}, ["max_device_memory", "negative"]),
        ({"offload_cpu_size": "lots"}, ["offload_cpu_size", "'lots'", "GB"]),
        ({"offload_disk_size": -3}, ["offload_disk_size", "-3"]),
        ({"host_mem_block_size": "1000"}, ["host_mem_block_size", "4096"]),
        ({"aio_block_size": 0}, ["aio_block_size"]),
        ({"aio_queue_depth": 0}, ["aio_queue_depth", ">= 1"]),
        ({"aio_threads": -1}, ["aio_threads"]),
        ({"prefetch_depth": 1.5}, ["prefetch_depth"]),
        ({"compute_dtype": "fp8"}, ["compute_dtype", "'fp8'", "'bf16'"]),
        ({"device": "tpu"}, ["device", "'tpu'", "'cuda:N'"]),
        ({"offload_path": ""}, ["offload_path"]),
    ],
)
def test_bad_values_name_the_key(kwargs, names):
    with pytest.raises(ConfigError) as info:
        OffloadConfig(**kwargs)
    for name in names:
        assert name in str(info.value)


def test_from_mindspore_rejects_unknown_and_bad_values():
    with pytest.raises(ConfigError, match="offload_prama"):
        OffloadConfig.from_mindspore({"offload_prama": "cpu"})
    with pytest.raises(ConfigError, match="memory_offload"):
        OffloadConfig.from_mindspore(SEED_MANUAL, memory_offload="MAYBE")
    with pytest.raises(ConfigError, match="offload_cpu_size"):
        OffloadConfig.from_mindspore({**SEED_MANUAL, "offload_cpu_size": "512XB"})


def test_compute_dtype_aliases():
    assert OffloadConfig(compute_dtype=torch.float16).compute_dtype == "fp16"
    assert OffloadConfig(compute_dtype="bfloat16").compute_dtype == "bf16"


def test_cuda_device_refused_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        OffloadConfig(device="cuda").resolved_device()


def test_from_file_json_yaml_toml(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"offload_param": "cpu", "hbm_ratio": 0.5}))
    (tmp_path / "c.yaml").write_text("offload_param: disk\nmax_device_memory: 2GB\n")
    (tmp_path / "c.toml").write_text('offload_optimizer = "cpu"\noffload_cpu_size = "4GiB"\n')
    assert OffloadConfig.from_file(tmp_path / "c.json").hbm_ratio == 0.5
    assert OffloadConfig.from_file(tmp_path / "c.yaml").max_device_memory == 2 * 2**30
    assert OffloadConfig.from_file(tmp_path / "c.toml").offload_cpu_size == 4 * 2**30


def test_from_file_mindspore_form(tmp_path):
    path = tmp_path / "ms.json"
    path.write_text(json.dumps({"offload_config": SEED_AUTO, "max_device_memory": "30GB"}))
    config = OffloadConfig.from_file(path)
    assert config.auto_offload and config.max_device_memory == 30 * 2**30


@pytest.mark.parametrize(
    "name, text, match",
    [
        ("bad.json", "{not json", "not valid json"),
        ("bad.yaml", "offload_parm: cpu\n", "did you mean 'offload_param'"),
        ("bad.toml", "offload_param = [", "not valid toml"),
        ("bad.ini", "x=1", "unknown extension"),
        ("list.json", "[1, 2]", "mapping"),
    ],
)
def test_from_file_errors(tmp_path, name, text, match):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        OffloadConfig.from_file(path)


def test_from_file_missing(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        OffloadConfig.from_file(tmp_path / "nope.json")


def test_replace_revalidates():
    config = OffloadConfig(offload_param="cpu")
    assert config.replace(offload_param="disk").offload_param == "disk"
    with pytest.raises(ConfigError):
        config.replace(offload_param="x")


def test_public_names():
    for name in ("offload", "OffloadConfig", "memory_stats", "ConfigError", "OutOfDeviceMemory"):
        if name == "offload" and not hasattr(hetstore, "offload"):
            continue  # arrives with the runtime
        assert hasattr(hetstore, name)


def test_docs_config_reference_is_in_sync():
    from pathlib import Path

    from hetstore.config import config_reference_markdown

    path = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert path.read_text() == config_reference_markdown(), (
        'docs/config.md is stale: regenerate with python -c "from hetstore.config import '
        "config_reference_markdown as m; open('docs/config.md','w').write(m())\""
    )
    for key in OffloadConfig.keys():
        assert f"`{key}`" in path.read_text()


# --------------------------------------------------------------------------- issue 19 item 5
# Every rejection is a ConfigError naming the key, raised by OffloadConfig(...) itself,
# before anything is created (tests/api/test_config_fuzz.py fuzzes the same promises).


def _refused(match_key, **kwargs):
    with pytest.raises(ConfigError) as info:
        OffloadConfig(**kwargs)
    assert match_key in str(info.value)
    return str(info.value)


@pytest.mark.parametrize(
    "bad",
    [
        "1e400GB",
        "1e400",
        "1e999999999999GB",
        "9" * 400 + "TB",
        "8388608TB",
        2**63,
        10**30,
        10**5000,
        -(10**5000),
        1e300,
        float("inf"),
        float("nan"),
        -0.5,
        "nan",
        "inf",
        True,
        None,
        [1],
        {"GB": 1},
        b"8GB",
    ],
    ids=lambda v: short_repr(v, limit=30),
)
def test_size_overflow_and_wrong_types_are_config_errors(bad):
    for key in ("offload_cpu_size", "host_mem_block_size", "activation_min_bytes"):
        if bad is None and key == "offload_cpu_size":
            continue  # None means "the machine's RAM"
        message = _refused(key, **{key: bad})
        assert "OverflowError" not in message


def test_size_limits_and_exact_parsing():
    assert parse_size(2**63 - 1) == 2**63 - 1
    assert parse_size("8388607TB") == 8388607 * 2**40
    assert parse_size("9007199254740993") == 9007199254740993  # exact, not via float
    assert parse_size("1e-400GB") == 0
    for bad in ("1e400GB", 2**63, 1e19, "1e" + "9" * 5000):
        with pytest.raises(ValueError, match=r"at most 2\*\*63 - 1 bytes"):
            parse_size(bad)
    with pytest.raises(ValueError, match="int of"):
        parse_size(-(10**5000))  # a message even for an int with no repr


@pytest.mark.parametrize(
    "key, bad, allowed",
    [
        ("prefetch_depth", 10**12, "<= 64"),
        ("prefetch_depth", 65, "<= 64"),
        ("prefetch_depth", -1, ">= 0"),
        ("aio_queue_depth", 10**12, "<= 1024"),
        ("aio_threads", 10**9, "<= 256"),
        ("aio_threads", 2.0, ">= 0"),
    ],
)
def test_counts_are_bounded(key, bad, allowed):
    message = _refused(key, **{key: bad})
    assert allowed in message
    OffloadConfig(prefetch_depth=64, aio_queue_depth=1024, aio_threads=256)


def test_prefetch_after_is_bounded_by_the_units():
    """However deep the prefetch, one unit's hook visits at most the other units (a plan
    read from JSON is not checked by OffloadConfig)."""
    from types import SimpleNamespace

    from hetstore.runtime.prefetch import Prefetch

    order = ["a", "b", "c"]
    fetched = []
    prefetch = SimpleNamespace(depth=10**12, order=order, start=fetched.append)
    Prefetch.after(prefetch, "a", 1)
    Prefetch.after(prefetch, "c", -1)
    assert fetched == ["b", "c", "b", "a"]


@pytest.mark.parametrize(
    "bad", ["offload_param", 5, 1.5, [("offload_param", "cpu")], ("x",), b"{}", {1, 2}, True]
)
def test_from_mindspore_refuses_non_dicts(bad):
    with pytest.raises(ConfigError, match="offload_config: expected a dict"):
        OffloadConfig.from_mindspore(bad)


@pytest.mark.parametrize("key", [1, None, ("offload_param",), b"offload_param", 1.5])
def test_from_mindspore_refuses_non_string_keys(key):
    with pytest.raises(ConfigError) as info:
        OffloadConfig.from_mindspore({**SEED_MANUAL, key: "cpu"})
    assert "offload_config" in str(info.value) and repr(key) in str(info.value)
    with pytest.raises(ConfigError, match="not a string"):
        OffloadConfig.from_dict({key: "cpu"})


@pytest.mark.parametrize(
    "values, context, key",
    [
        ({"enable_aio": "yes"}, {}, "enable_aio"),
        ({"offload_cpu_size": "1e400GB"}, {}, "offload_cpu_size"),
        ({"hbm_ratio": float("nan")}, {}, "hbm_ratio"),
        ({"offload_param": None}, {}, "offload_param"),
        ({"offload_path": "a\x00b"}, {}, "offload_path"),
        ({}, {"memory_offload": ["ON"]}, "memory_offload"),
        ({}, {"memory_offload": "on"}, "memory_offload"),
        ({}, {"max_device_memory": "1e400GB"}, "max_device_memory"),
        ({}, {"bogus_key": 1}, "bogus_key"),
    ],
)
def test_from_mindspore_wrong_values_name_the_key(values, context, key):
    with pytest.raises(ConfigError, match=key):
        OffloadConfig.from_mindspore({**SEED_MANUAL, **values}, **context)


def test_from_mindspore_none_and_empty_are_the_defaults():
    assert OffloadConfig.from_mindspore(None) == OffloadConfig.from_mindspore({})


def test_offload_path_with_nul_is_refused_even_without_disk():
    _refused("offload_path", offload_path="off\x00load")
    _refused("offload_path", offload_path=b"./offload")


@pytest.mark.parametrize(
    "disk",
    [
        {"offload_param": "disk"},
        {"offload_optimizer": "disk"},
        {"offload_optimizer": "disk", "offload_grad": "disk"},
        {"offload_activations": "disk"},
        {"auto_offload": True},
    ],
    ids=lambda d: ",".join(d),
)
def test_offload_path_a_file_is_refused_at_config_time(tmp_path, disk):
    regular = tmp_path / "a_file"
    regular.write_text("x")
    message = _refused("offload_path", offload_path=str(regular), **disk)
    assert "not a directory" in message
    message = _refused("offload_path", offload_path=str(regular / "sub"), **disk)
    assert "not a directory" in message and str(regular) in message
    # no disk use: the path is never touched, so it is not checked either
    assert OffloadConfig(offload_param="cpu", offload_path=str(regular)).offload_path


def test_offload_path_dangling_link_is_refused(tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "missing")
    message = _refused("offload_path", offload_param="disk", offload_path=str(tmp_path / "link"))
    assert "symbolic link" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]


@pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0,
    reason="root ignores directory modes; test_offload_path_unwritable_ancestor covers it",
)
def test_offload_path_in_read_only_directory_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        for path in (locked, locked / "offload", locked / "a" / "b"):
            message = _refused("offload_path", offload_param="disk", offload_path=str(path))
            assert str(locked) in message and "not writable" in message
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


def test_offload_path_unwritable_ancestor(tmp_path, monkeypatch):
    """The same refusal for any user (root included): ``os.access`` says no for one
    directory, as it does for a read-only one or a read-only file system."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access

    def access(path, mode, **kwargs):
        if os.fspath(path) == str(locked) and mode & os.W_OK:
            return False
        return real_access(path, mode, **kwargs)

    monkeypatch.setattr(os, "access", access)
    message = _refused("offload_path", offload_param="disk", offload_path=str(locked / "x" / "y"))
    assert f"nearest existing ancestor {str(locked)!r}" in message
    message = _refused("offload_path", offload_optimizer="disk", offload_path=str(locked))
    assert f"the directory {str(locked)!r} is not writable" in message
    assert list(locked.iterdir()) == []


def test_config_time_checks_create_nothing(tmp_path):
    target = tmp_path / "a" / "b"
    config = OffloadConfig(offload_param="disk", offload_path=str(target))
    assert config.offload_path == str(target) and not (tmp_path / "a").exists()
    with pytest.raises(ConfigError, match="prefetch_depth"):
        OffloadConfig(offload_param="disk", offload_path=str(target), prefetch_depth=10**12)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("latin1.json", b'{"offload_param": "\xe9"}', "not UTF-8"),
        ("ints.yaml", b"1: cpu\n", "key 1 \\(int\\) is not a string"),
        ("ms.yaml", b"offload_config: 5\n", "offload_config: expected a dict"),
        ("ms_keys.yaml", b"offload_config:\n  1: 2\n", "offload_config: key 1"),
        ("huge.json", b'{"offload_cpu_size": ' + b"1" * 5000 + b"}", "not valid json"),
        ("size.yaml", b"offload_cpu_size: 1e400GB\n", "offload_cpu_size"),
        ("null.json", b"null", "mapping"),
        ("unhashable.yaml", b"? [1, 2]\n: x\n", "not valid yaml"),
    ],
)
def test_from_file_more_errors(tmp_path, name, content, match):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=match):
        OffloadConfig.from_file(path)


def test_from_file_bad_paths(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        OffloadConfig.from_file(str(tmp_path / "c\x00.json"))
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(ConfigError, match="cannot read"):
        OffloadConfig.from_file(tmp_path / "dir.json")
    with pytest.raises(ConfigError, match="expected a path"):
        OffloadConfig.from_file(5)


@pytest.mark.parametrize(
    "key, too_big",
    [("aio_block_size", 2**31), ("host_mem_block_size", 2**62), ("optimizer_chunk_size", 2**62)],
)
def test_block_sizes_no_machine_can_allocate_are_refused(key, too_big):
    with pytest.raises(hetstore.ConfigError, match=key) as info:
        hetstore.OffloadConfig(**{key: too_big})
    assert "at most" in str(info.value)
    hetstore.OffloadConfig(**{key: 2**20})  # an ordinary size passes
