"""Bad input: one line naming the key and what is allowed, exit code 2, no traceback, nothing written."""
from __future__ import annotations

import pytest
from hydra import initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser

from harness.run.plan import CONFIG_DIR, plan, sweep_points
from harness.config.validate import ConfigError
from tests.conftest import refused_by_runner, run_cli

NO_CUDA = lambda: False  # noqa: E731

BAD = {  # override -> key the message must name
    "strategy=nosuch": "strategy",
    "model=llama9": "model",
    "device=tpu": "device",
    "dtype=int4": "dtype",
    "batch=0": "batch",
    "batch=-3": "batch",
    "ctx=0": "ctx",
    "decode_tokens=-1": "decode_tokens",
    "batch=1.5": "batch",
    "ctx=many": "ctx",
    "model.n_heads=6": "model.n_heads",  # cpu_small has 2 KV heads: 6 % 2 == 0 but 512 % 6 != 0
    "model.n_kv_heads=3": "model.n_heads",
    "model.n_layers=0": "model.n_layers",
    "prefill=sometimes": "prefill",
    "no_such_key=1": "no_such_key",
    "strategy=flash strategy.backend=triton": "strategy.backend",
    "strategy=no_cache prefill=random": "prefill",
    "device=cuda": "device",  # this machine has no CUDA device
    "device=cpu timing.cuda_graphs=true": "timing.cuda_graphs",  # graphs need CUDA; the point runs on the CPU
    "strategy=paged strategy.block_size=0": "strategy.block_size",
    "strategy=paged strategy.block_size=16 strategy.backend=flash_attn": "strategy.block_size",
    "strategy=contiguous strategy.block_size=16": "strategy.block_size",  # an option contiguous does not take
    "strategy._target_=nosuch.Klass": "strategy._target_",
}


@pytest.mark.parametrize("override", list(BAD))
def test_bad_value_is_refused_with_the_key_named(override):
    with pytest.raises(ConfigError) as refused:
        plan(override.split(), cuda_available=NO_CUDA)
    message = str(refused.value)
    assert "\n" not in message
    expected_key = "model.d_model" if override == "model.n_heads=6" else BAD[override]
    assert message.startswith(f"{expected_key}:"), message


def test_a_bad_point_anywhere_in_a_sweep_is_refused_before_the_first_runs():
    with pytest.raises(ConfigError, match="^batch:"):
        plan(["-m", "model=tiny", "batch=1,2,0"], cuda_available=NO_CUDA)


def test_a_list_without_multirun_says_to_add_m():
    with pytest.raises(ConfigError, match="-m"):
        plan(["batch=1,2"], cuda_available=NO_CUDA)


def test_unknown_option_lists_what_is_allowed():
    with pytest.raises(ConfigError, match="allowed: .*contiguous.*flash.*no_cache"):
        plan(["strategy=nosuch"], cuda_available=NO_CUDA)


# The CLI's side of a refusal (exit 2, one line, nothing written) on one command line in the fast
# tier, the rest in the slow tier: the refusals themselves are checked in process above.
@pytest.mark.parametrize("args", [pytest.param(["strategy=nosuch"], marks=pytest.mark.slow),
                                  pytest.param(["batch=0"], marks=pytest.mark.slow),
                                  ["-m", "model=tiny", "ctx=8,abc"],
                                  pytest.param(["model=llama3_70b", "device=cpu"], marks=pytest.mark.slow)])
def test_cli_exits_2_with_one_line_and_writes_nothing(results_dir, args):
    result = run_cli(*args, f"results_dir={results_dir}")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not results_dir.exists()


def test_a_point_that_cannot_fit_names_bytes_needed_and_available(results_dir):
    line = refused_by_runner("model=llama3_70b", "device=cpu", f"results_dir={results_dir}")
    assert "does not fit in memory: needs ~" in line and "GiB available" in line
    assert not results_dir.exists()


def test_an_interval_sweep_is_refused_with_its_key():
    assert "batch: interval()" in refused_by_runner("-m", "model=tiny", "device=cpu", "batch=interval(1,4)")


def test_two_of_hydras_modes_at_once_are_one_line():
    """`-m` with `--cfg job` is Hydra's own refusal (a ValueError inside Hydra): one line, exit 2."""
    line = refused_by_runner("-m", "model=tiny", "ctx=8,16", "--cfg", "job")
    assert line.startswith("error: command line: Only one of --run, --multirun, --cfg")


@pytest.mark.parametrize("overrides", [
    ["batch=1,4", "ctx=64,256,1024", "strategy=contiguous,paged"],
    ["ctx=8", "batch=range(1,4)", "ctx=16,32", "seed=3"],  # a key set twice: its first place, its last values
    ["strategy=glob(*)", "batch=2"],
])
def test_sweep_points_expands_a_sweep_as_hydras_basic_sweeper_does(overrides):
    """The plan's own expansion against Hydra's (its internal BasicSweeper, which the product does not import)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        parsed = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader()).parse_overrides(overrides)
        jobs = sweep_points(parsed)
        assert len(jobs) > 1 and jobs == BasicSweeper.split_arguments(parsed, max_batch_size=None)[0]
