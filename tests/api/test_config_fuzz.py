"""Fuzzing OffloadConfig (issue 19): whatever the keys and values, building a configuration
raises only ``hetstore.ConfigError``, names the key at fault, and creates nothing on disk."""

import json
import os
import stat
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("hypothesis")

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hetstore import ConfigError, OffloadConfig  # noqa: E402
from hetstore.config import MINDSPORE_KEYS, SIZE_KEYS  # noqa: E402

# HETSTORE_FUZZ_EXAMPLES=5000 fuzzes longer; the default keeps the file at a few seconds
FUZZ = settings(max_examples=int(os.environ.get("HETSTORE_FUZZ_EXAMPLES", "200")), deadline=None)

KEYS = OffloadConfig.keys()
UNKNOWN_KEYS = (
    "offload_parm",
    "max_device_memroy",
    "OFFLOAD_PARAM",
    "offload path",
    "mode",
    "memory_offload",
    "offload_config",
    "x",
    "",
)
SIZE_TEXT = (
    "1e400GB",
    "1e400",
    "1e-400GB",
    "1e999999999999GB",
    "1e" + "9" * 60,
    "9" * 400 + "TB",
    "inf",
    "-inf",
    "nan",
    "NaN GB",
    "-0",
    "-1GB",
    "8388608TB",
    "8388607TB",
    "1.5GiB",
    "512GB",
    "8MB",
    "4096",
    "0",
    " 2 tb ",
    "1000",
    ".5k",
)
WORDS = (
    "none",
    "cpu",
    "disk",
    "DISK",
    "gpu",
    "nvme",
    "fp16",
    "bf16",
    "float32",
    "fp8",
    "auto",
    "cuda",
    "cuda:0",
    "cuda:-1",
    "cuda:99999999999999999999",
    "cpu\x00",
    "meta",
    "mps",
    "ON",
    "OFF",
    "MAYBE",
)
NUMBERS = (0, 1, -1, 63, 64, 65, 4095, 4096, 2**20, 2**63 - 1, 2**63, 10**12, 10**400)
# ints past sys.int_info's str-digits limit have no repr: messages must still be built
HUGE_INTS = (10**5000, -(10**5000))

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from(NUMBERS + HUGE_INTS),
    st.floats(),
    st.sampled_from([float("inf"), float("-inf"), float("nan"), 1e308, -0.0, 0.5, 1.0]),
    st.sampled_from(SIZE_TEXT),
    st.builds(
        lambda n, unit: f"{n}{unit}",
        st.one_of(st.integers(min_value=-10, max_value=10**25), st.floats(allow_nan=False)),
        st.sampled_from(["", "B", "KB", "kib", "MB", "g", "GB", "GiB", "TB", "XB", " GB"]),
    ),
    st.sampled_from(WORDS),
    st.text(max_size=16),
    st.text(max_size=8).map(lambda t: t + "\x00"),
    st.binary(max_size=8),
    st.sampled_from([torch.float16, torch.int8, torch.device("cpu"), torch.device("meta")]),
)
values = st.one_of(
    scalars,
    st.lists(scalars, max_size=3),
    st.tuples(scalars),
    st.dictionaries(st.text(max_size=4), scalars, max_size=3),
)
# short enough that their repr is never cut in a message (80 characters)
str_keys = st.one_of(
    st.sampled_from(KEYS), st.sampled_from(UNKNOWN_KEYS), st.text(min_size=1, max_size=6)
)


def _named(key) -> str:
    """What a message about ``key`` must contain: the name of a real key, the repr of
    anything else (an unknown name, a non-string)."""
    return key if key in KEYS else repr(key)


@pytest.fixture(scope="module")
def workspace():
    """A directory the fuzzer's paths point into (relative ones too: it is the working
    directory meanwhile): a file, a directory, a dangling link, a read-only directory."""
    old_cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="hetstore-fuzz-") as tmp:
        root = Path(tmp)
        (root / "a_file").write_text("x")
        (root / "dir").mkdir()
        (root / "readonly").mkdir()
        (root / "dangling").symlink_to(root / "missing")
        os.chmod(root / "readonly", 0o500)
        os.chdir(root)
        try:
            yield root
        finally:
            os.chdir(old_cwd)
            os.chmod(root / "readonly", 0o700)


def _snapshot(root: Path) -> set:
    """Every entry under ``root`` with its type and size, and every directory's mtime (a
    file created and removed again still changes its directory's mtime)."""
    seen = {(".", os.stat(root).st_mtime_ns)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st_ = os.lstat(path)
            mtime = st_.st_mtime_ns if stat.S_ISDIR(st_.st_mode) else None
            seen.add((os.path.relpath(path, root), stat.S_IFMT(st_.st_mode), st_.st_size, mtime))
    return seen


def _paths(root: Path):
    return st.one_of(
        st.sampled_from(
            [
                str(root / "new"),
                str(root / "dir"),
                str(root / "dir" / "deeper" / "still"),
                str(root / "a_file"),
                str(root / "a_file" / "sub"),
                str(root / "dangling"),
                str(root / "dangling" / "sub"),
                str(root / "readonly" / "sub"),
                "rel",
                "./offload/",
                "",
                "a\x00b",
                str(root) + "\x00",
                "x" * 300,
                "/".join(["y" * 200] * 30),
            ]
        ),
        st.builds(Path, st.sampled_from(["dir", "new", "a_file"])),
        st.text(max_size=12).map(lambda t: str(root / t)),
        values,
    )


def _check_config(config: OffloadConfig) -> None:
    """A configuration that was accepted holds normalized values only."""
    for key in sorted(SIZE_KEYS | {"activation_min_bytes"}):
        value = getattr(config, key)
        assert value is None or (type(value) is int and 0 <= value < 2**63), (key, value)
    for key in ("hbm_ratio", "cpu_ratio", "gpu_margin_mem_ratio"):
        assert type(getattr(config, key)) is float and 0.0 <= getattr(config, key) <= 1.0
    assert 0 <= config.prefetch_depth <= 64
    assert isinstance(config.offload_path, str) and "\x00" not in config.offload_path
    config.describe()
    assert config.replace() == config


@FUZZ
@given(data=st.data(), key=str_keys)
def test_one_key_only_config_error_naming_it(workspace, data, key):
    value = data.draw(_paths(workspace) if key == "offload_path" else values, label="value")
    kwargs = {key: value}
    if key != "offload_path":
        kwargs["offload_path"] = str(workspace / "new")
    before = _snapshot(workspace)
    try:
        config = OffloadConfig(**kwargs)
    except ConfigError as exc:
        assert _named(key) in str(exc), (key, str(exc))
    else:
        _check_config(config)
    assert _snapshot(workspace) == before


@FUZZ
@given(data=st.data(), kwargs=st.dictionaries(str_keys, values, max_size=6))
def test_many_keys_only_config_error_naming_one(workspace, data, kwargs):
    kwargs["offload_path"] = data.draw(_paths(workspace), label="offload_path")
    before = _snapshot(workspace)
    try:
        config = OffloadConfig(**kwargs)
    except ConfigError as exc:
        assert any(_named(k) in str(exc) for k in kwargs), (kwargs, str(exc))
    else:
        _check_config(config)
    assert _snapshot(workspace) == before


mindspore_keys = st.one_of(
    st.sampled_from(sorted(MINDSPORE_KEYS)),
    st.sampled_from(UNKNOWN_KEYS + ("offload_optimizer", "max_device_memory")),
    st.text(min_size=1, max_size=6),
    st.integers(min_value=-1000, max_value=1000),
    st.none(),
    st.booleans(),
    st.tuples(st.integers(min_value=0, max_value=9)),
    st.binary(min_size=1, max_size=3),
    # bounded: hypothesis's own downcast of an out-of-range draw to 16 bits raised
    # OverflowError inside it (and its report then failed on HUGE_INTS' repr)
    st.floats(min_value=-65504.0, max_value=65504.0, allow_nan=False, width=16),
)
mindspore_dicts = st.dictionaries(mindspore_keys, values, max_size=6)
not_dicts = st.one_of(
    st.lists(st.tuples(st.sampled_from(sorted(MINDSPORE_KEYS)), values), max_size=3),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.integers(),
    st.floats(),
    st.booleans(),
    st.tuples(values),
    st.sets(st.integers(), max_size=3),
)
context_keys = st.sampled_from(
    ["max_device_memory", "memory_offload", "mode", "offload_optimizer", "device"]
    + ["prefetch_depth", "offload_path", "offload_grad", "bogus_key", "offload_parm"]
)


@FUZZ
@given(
    data=st.data(),
    offload_config=st.one_of(st.none(), mindspore_dicts, not_dicts),
    context=st.dictionaries(context_keys, values, max_size=3),
)
def test_from_mindspore_only_config_error(workspace, data, offload_config, context):
    if isinstance(offload_config, dict) and data.draw(st.booleans(), label="valid path"):
        offload_config["offload_path"] = str(workspace / "new")
    before = _snapshot(workspace)
    try:
        config = OffloadConfig.from_mindspore(offload_config, **context)
    except ConfigError as exc:
        message = str(exc)
        if offload_config is not None and not isinstance(offload_config, dict):
            assert "offload_config" in message, message
        else:
            # context keys are keywords (memory_offload is named as such, not repr'd)
            named = [_named(k) for k in offload_config or {}] + list(context)
            assert any(n in message for n in named), (offload_config, context, message)
    else:
        _check_config(config)
    assert _snapshot(workspace) == before


json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(),
        st.text(max_size=8),
        st.sampled_from(SIZE_TEXT + WORDS),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
file_texts = st.one_of(
    st.dictionaries(st.one_of(str_keys, st.just("offload_config")), json_values, max_size=5).map(
        json.dumps
    ),
    json_values.map(json.dumps),
    st.text(max_size=64),
    st.sampled_from(
        [
            "{not json",
            "offload_param = [",
            "1: cpu\n",
            "? [1, 2]\n: x\n",
            "offload_config: 5\n",
            "offload_config:\n  1: 2\n",
            "- 1\n- 2\n",
            '{"offload_cpu_size": ' + "1" * 5000 + "}",
            "offload_cpu_size: 1e400GB\n",
            "!!python/object:os.system\n",
            "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
        ]
    ),
)


@FUZZ
@given(
    text=file_texts,
    raw=st.one_of(st.none(), st.binary(max_size=32)),
    suffix=st.sampled_from([".json", ".yaml", ".yml", ".toml", ".ini", "", ".JSON"]),
)
def test_from_file_only_config_error(workspace, tmp_path_factory, text, raw, suffix):
    folder = tmp_path_factory.getbasetemp() / "fuzz-files"
    folder.mkdir(exist_ok=True)
    path = folder / f"config{suffix}"
    if raw is not None:
        path.write_bytes(raw)
    else:
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
    before = _snapshot(workspace)
    try:
        config = OffloadConfig.from_file(path)
    except ConfigError:
        pass
    else:
        _check_config(config)
    assert _snapshot(workspace) == before
