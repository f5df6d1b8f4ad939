import json

import pytest

from specforge.config import ConfigError, QuickstartConfig, load_config
from specforge.errors import UserError
from specforge.recipes.quickstart import _train_budget, quickstart_config, train_minutes


def test_training_gets_the_budget_less_prepare_and_the_bench_share():
    qc = QuickstartConfig(minutes=60, bench_share=0.5)
    assert train_minutes(qc, prepare_seconds=20 * 60) == pytest.approx(30)
    with pytest.raises(UserError, match=r"prepare took 39\.0 of the quickstart's 60 minutes"):
        train_minutes(qc, prepare_seconds=39 * 60)


def test_a_rerun_keeps_the_first_runs_prepare_time(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path}", "quickstart.minutes=60"])
    first = _train_budget(cfg, prepare_seconds=600)
    assert first.train.max_minutes == pytest.approx(60 - 1.6 * 10)
    assert json.loads((tmp_path / "quickstart.json").read_text()) == {"prepare_seconds": 600.0}
    # the rerun's prepare found its work done (seconds): the budget stays the first run's
    again = _train_budget(cfg, prepare_seconds=3)
    assert again.train.max_minutes == first.train.max_minutes
    # a new budget on the rerun is applied to the first run's prepare time
    longer = load_config(None, [f"output_dir={tmp_path}", "quickstart.minutes=90"])
    assert _train_budget(longer, prepare_seconds=3).train.max_minutes == pytest.approx(74)


def test_the_quickstart_recipe_has_an_hour_and_bad_budgets_are_refused():
    assert quickstart_config().quickstart.minutes == 60
    for bad in ("quickstart.minutes=0", "quickstart.bench_share=-1"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(None, [bad])
