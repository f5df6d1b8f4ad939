import dataclasses
import re
import typing
from pathlib import Path
from typing import Literal

import pytest

from specforge.config import ConfigError, SpecForgeConfig, load_config
from specforge.config.resolve import bfloat16_is_fast, int8_linear_available, resolve_auto

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))


def test_configs_exist():
    assert any(p.name == "smollm2-135m-eagle3.yaml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads_and_opens_with_its_command(path):
    cfg = load_config(path)
    assert isinstance(cfg, SpecForgeConfig)
    first_line = path.read_text().splitlines()[0]
    assert first_line.startswith("# ") and "--config configs/" + path.name in first_line


def test_defaults_without_file():
    cfg = load_config()
    assert cfg.target.name_or_path == "smollm2-135m"
    assert cfg.conversations_path == Path("outputs/specforge/conversations.jsonl")


def test_bfloat16_is_fast_on_a_cpu_exactly_when_it_has_bf16_dot_products():
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    flags = set(cpuinfo.read_text().split())
    assert bfloat16_is_fast("cpu") == bool(flags & {"amx_tile", "avx512_bf16"})


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_auto_dtypes_resolve_to_the_faster_one_on_the_target_device(device):
    loaded = load_config(None, [f"target.device={device}", "target.dtype=auto", "train.dtype=auto"])
    # a loaded config means the same on every machine; a stage resolves it when it starts
    assert (loaded.target.dtype, loaded.train.dtype, loaded.bench.draft_dtype) == ("auto",) * 3
    assert loaded.bench.draft_quantize == "auto"
    cfg = resolve_auto(loaded)
    expected = "bfloat16" if bfloat16_is_fast(device) else "float32"
    assert (cfg.target.dtype, cfg.train.dtype) == (expected, expected)
    assert cfg.bench.draft_dtype == expected  # auto by default; bench.dtype stays float32
    assert cfg.bench.dtype == "float32"
    explicit = resolve_auto(
        load_config(
            None, ["target.dtype=float16", "train.dtype=float32", "bench.draft_dtype=float32"]
        )
    )
    assert (explicit.target.dtype, explicit.train.dtype) == ("float16", "float32")
    assert explicit.bench.draft_dtype == "float32"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_draft_quantize_auto_is_int8_for_a_fast_bfloat16_cpu_draft_only(device):
    cfg = resolve_auto(load_config(None, [f"target.device={device}"]))
    fits = device == "cpu" and cfg.bench.draft_dtype == "bfloat16" and bfloat16_is_fast("cpu")
    assert cfg.bench.draft_quantize == ("int8" if fits and int8_linear_available() else "none")
    kept = resolve_auto(load_config(None, [f"target.device={device}", "bench.draft_quantize=none"]))
    assert kept.bench.draft_quantize == "none"
    for bad in (["bench.draft_dtype=float32"], ["target.device=cuda"]):
        with pytest.raises(ConfigError, match="bench.draft_quantize int8 needs"):
            load_config(None, ["bench.draft_dtype=bfloat16", "bench.draft_quantize=int8", *bad])


def test_dotted_overrides_win_and_are_typed(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  max_length: 512\nregenerate:\n  temperature: 0.5\n")
    cfg = load_config(
        path,
        [
            "data.max_length=1024",
            "regenerate.top_p=9e-1",
            "data.inputs=[a.jsonl, b.json]",
            "target.aux_layer_ids=[1, 5, 9]",
            "prepare.output=out.jsonl",
        ],
    )
    assert cfg.data.max_length == 1024
    assert cfg.regenerate.temperature == 0.5
    assert cfg.regenerate.top_p == pytest.approx(0.9)  # "9e-1" is a YAML string: still a float
    assert cfg.data.inputs == ["a.jsonl", "b.json"]
    assert cfg.target.aux_layer_ids == [1, 5, 9]
    assert cfg.conversations_path == Path("out.jsonl")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.max_lenght=5", "unknown config key data.max_lenght"),
        ("nosuch.key=1", "unknown config key nosuch"),
        ("data.max_length=abc", "data.max_length must be an integer"),
        ("data.max_length=1.5", "data.max_length must be an integer"),
        ("regenerate.enabled=maybe", "regenerate.enabled must be true or false"),
        ("data.format=csv", "data.format must be one of"),
        ("data.inputs=x.jsonl", "data.inputs must be a list"),
        ("target.aux_layer_ids=[1, x, 3]", "target.aux_layer_ids[1] must be an integer"),
        ("regenerate.top_p=2", "regenerate.top_p must be in (0, 1]"),
        ("regenerate.rows_per_span=0", "regenerate.rows_per_span must be >= 1, got 0"),
        ("regenerate.rows_per_span=many", "regenerate.rows_per_span must be an integer"),
        ("regenerate.batch_size=0", "regenerate.batch_size must be >= 1, got 0"),
        ("regenerate.batch_size=most", "regenerate.batch_size must be an integer"),
        ("data.max_length", "override must look like section.key=value"),
        ("data=3", "data must be a mapping"),
        ("export.verify_questions=0", "export.verify_questions must be >= 1, got 0"),
        ("bench.agreement_margin=-1", "bench.agreement_margin must be in [0, 1), got -1"),
        ("bench.vllm_start_timeout_s=-5", "bench.vllm_start_timeout_s must be > 0, got -5"),
        ("train.on_policy.depth=3", "train.on_policy.depth=3 does nothing while"),
        ("train.on_policy.max_minutes=5", "train.on_policy.max_minutes=5.0 does nothing while"),
        ("train.on_policy.replay=false", "train.on_policy.replay=False does nothing while"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert message in str(info.value)


def test_unknown_key_in_file_is_rejected(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("target:\n  name_or_path: x\n  dtyp: float32\n")
    with pytest.raises(ConfigError, match="unknown config key target.dtyp"):
        load_config(path)


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(path)


@pytest.mark.parametrize(
    "override",
    [
        "train.max_grad_norm=-1",
        "train.lr=inf",
        "train.lr=.nan",
        "train.step_weight=0",
        "train.target_temperature=-0.5",
        "train.target_temperature=.nan",
        "train.warmup_steps=-3",
        "train.min_lr_ratio=1.5",
        "train.weight_decay=-0.1",
        "train.max_tokens_per_batch=0",
        "train.batch_tokens=0",
        "train.max_minutes=0",
        "train.max_minutes=.nan",
        "regenerate.temperature=.nan",
        "regenerate.max_prompt_length=0",
        "capture.shard_size_mb=.nan",
        "synthesize.count=-1",
        "bench.limit=0",
        "bench.num_steps=0",
        "bench.auto_siblings=-1",
        "bench.auto_siblings=8",
        "bench.auto_lookup=-1",
        "bench.auto_lookup=17",
    ],
)
def test_numeric_fields_out_of_range_are_refused_naming_the_key(override):
    """Values that would silently run wrong (gradient ascent, NaN, 'no limit') are errors."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(None, [override])


def test_a_token_budget_refuses_a_count_beside_it():
    """``batch_tokens`` sizes micro-batches itself: a batch size or a split budget beside it
    would be silently ignored."""
    for other in ("train.batch_size=4", "train.max_tokens_per_batch=512"):
        with pytest.raises(ConfigError, match=re.escape(other.split("=")[0])):
            load_config(None, ["train.batch_tokens=2048", other])
    assert load_config(None, ["train.batch_tokens=2048"]).train.batch_tokens == 2048


def test_malformed_yaml_is_a_config_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    path.write_bytes(b"train:\n  lr: \xff\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(path)


def choice_fields():
    """``(section, field, choice)`` for every choice a ``Literal`` config field documents
    (alone, or beside another type: ``int | Literal["auto"]``)."""
    found = []
    hints = typing.get_type_hints(SpecForgeConfig)
    for section in dataclasses.fields(SpecForgeConfig):
        holder = hints[section.name]
        if not dataclasses.is_dataclass(holder):
            continue
        for name, tp in typing.get_type_hints(holder).items():
            for option in (tp, *typing.get_args(tp)):
                if typing.get_origin(option) is Literal:
                    found += [(section.name, name, c) for c in typing.get_args(option)]
    return sorted(set(found))


COMPANIONS = {
    ("regenerate", "backend", "server"): ["regenerate.server_url=http://127.0.0.1:1/v1"],
    ("bench", "draft_quantize", "int8"): ["bench.draft_dtype=bfloat16"],
}
"""Settings a choice needs beside it to be a valid config."""


@pytest.mark.parametrize(("section", "name", "choice"), choice_fields())
def test_every_documented_choice_loads_from_yaml_and_an_override(tmp_path, section, name, choice):
    """Written as the docs write them, unquoted: YAML reads ``on`` / ``off`` as booleans, and
    the field takes them back as its words."""
    extra = COMPANIONS.get((section, name, choice), [])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"{section}:\n  {name}: {choice}\n")
    for cfg in (
        load_config(recipe, extra),
        load_config(None, [f"{section}.{name}={choice}", *extra]),
    ):
        assert getattr(getattr(cfg, section), name) == choice


def test_a_yaml_boolean_that_is_no_choice_is_still_refused(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("data:\n  mode: on\n")
    with pytest.raises(ConfigError, match="data.mode must be one of"):
        load_config(recipe)


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("target.attn_implementation=sdpa", "target.attn_implementation 'sdpa'"),
        ("target.attn_implementation=eager", "target.attn_implementation 'eager'"),
        ("regenerate.backend=static", "regenerate.backend 'static'"),
    ],
)
def test_decode_kernel_on_where_it_cannot_run_is_refused(setting, named):
    """``on`` promises the kernel: beside a setting that never reaches it, an error names both."""
    with pytest.raises(ConfigError, match="regenerate.decode_kernel on") as refused:
        load_config(None, ["regenerate.decode_kernel=on", setting])
    assert named in str(refused.value)
    load_config(None, ["regenerate.decode_kernel=auto", setting])
    load_config(None, ["regenerate.decode_kernel=on"])


@pytest.mark.parametrize("device", ["tpu", "mps", "cuda:x", "xla"])
def test_an_unsupported_device_is_a_config_error_naming_it(device):
    with pytest.raises(ConfigError, match=f"target.device .* got '{re.escape(device)}'"):
        load_config(None, [f"target.device={device}"])


def test_a_key_written_twice_is_refused(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("train:\n  lr: 1.0e-4\n  max_steps: 3\n  lr: 2.0e-4\n")
    with pytest.raises(ConfigError, match="'lr' appears twice .*lines 2 and 4"):
        load_config(recipe)


def test_an_override_that_is_not_yaml_is_a_config_error():
    with pytest.raises(ConfigError, match=r"override 'train.lr=\[1': the value is not valid YAML"):
        load_config(None, ["train.lr=[1"])
