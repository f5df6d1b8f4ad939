"""Row buckets: a compiled graph's float32 linear calls through the op
``specforge::bucket_linear``, each row count by the kernel its plan names (the default, MKL's
weight packed for a row bucket, oneDNN's reordered weight), inside the same dynamic graph,
equal to the default's product to rounding, a row's bits independent of the rows beside it."""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specforge.engine.cpu.packed_linear import (
    DEFAULT,
    KERNEL_NAMES,
    MKL_BUCKET,
    ONEDNN,
    PLAN_ROWS,
    ROW_BUCKETS,
    PackedLinear,
    describe_plan,
)
from specforge.engine.cpu.row_buckets import (
    MAX_BUCKET_BYTES,
    bucket_linears,
    measure_plan,
    row_buckets_missing,
)
from specforge.engine.target import TargetEngine
from specforge.errors import UserError
from tests.helpers import EVERY_KERNEL_PLAN, make_tiny_llama

pytestmark = pytest.mark.skipif(
    row_buckets_missing() is not None, reason=f"row buckets: {row_buckets_missing()}"
)
SMALL, LARGE = ROW_BUCKETS


def frozen_linears(bias: bool) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(96, 160, bias=bias), nn.Linear(160, 96, bias=bias)]
    return nn.Sequential(*layers).requires_grad_(False)


def only(kernel: int) -> tuple[int, ...]:
    """A plan of one kernel (more rows than MKL's last bucket: the default)."""
    return (DEFAULT, *[kernel] * (PLAN_ROWS - 1), DEFAULT if kernel == MKL_BUCKET else kernel)


def test_a_plan_reads_as_row_ranges():
    assert describe_plan(EVERY_KERNEL_PLAN) == {
        "1": "onednn",
        "2-3": "default",
        "4-8": "mkl_bucket",
        "9-16": "onednn",
        "17+": "default",
    }
    assert describe_plan(only(ONEDNN)) == {"1+": "onednn"}


@pytest.mark.parametrize(
    "plan",
    [EVERY_KERNEL_PLAN, (DEFAULT, DEFAULT, *EVERY_KERNEL_PLAN[2:])],
    ids=["mixed", "1-default"],
)
@pytest.mark.parametrize("bias", [True, False])
def test_every_row_count_runs_inside_two_dynamic_graphs_and_agrees_with_the_default(bias, plan):
    model = frozen_linears(bias)
    x = torch.randn(1, LARGE + 4, 96)
    with torch.no_grad():
        want = [model(x[:, :count]) for count in range(1, x.shape[1] + 1)]
    assert bucket_linears(model, plan) == plan
    assert all(isinstance(m, PackedLinear) and m.max_rows == 0 for m in model)  # eager: default
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(str(graph.code))
        return graph.forward

    run = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
    with torch.no_grad():
        for count, expected in enumerate(want, start=1):
            torch.testing.assert_close(run(x[:, :count].clone()), expected, rtol=1e-5, atol=1e-5)
    # one graph for one row (the op only where the plan's one-row kernel is not the default),
    # one for every other count
    assert len(graphs) == 2
    assert graphs[0].count("bucket_linear") == (0 if plan[1] == DEFAULT else 2)
    assert graphs[1].count("bucket_linear") == 2


@pytest.mark.parametrize("kernel", [MKL_BUCKET, ONEDNN], ids=["mkl", "onednn"])
def test_a_row_does_not_depend_on_the_rows_beside_it(kernel):
    model = frozen_linears(bias=True)
    bucket_linears(model, only(kernel))
    layer, plan = model[0], only(kernel)
    x = torch.randn(LARGE, 96)
    with torch.no_grad():
        small, large = layer.run_plan(x[:SMALL], plan), layer.run_plan(x, plan)
        for rows in range(1, SMALL + 1):
            assert torch.equal(layer.run_plan(x[:rows], plan), small[:rows])
        for rows in (SMALL + 1, LARGE - 1):
            assert torch.equal(layer.run_plan(x[:rows], plan), large[:rows])
        torch.testing.assert_close(large, F.linear(x, layer.weight, layer.bias))
        # leading dimensions as the models pass them, (B, T, H)
        assert torch.equal(layer.run_plan(x[None, :5], plan), small[None, :5])


def test_the_default_kernel_is_the_default_product_and_bad_calls_are_clear_errors():
    model = frozen_linears(bias=True)
    bucket_linears(model, EVERY_KERNEL_PLAN)
    layer, x = model[0], torch.randn(LARGE + 1, 96)
    with torch.no_grad():
        for rows in (x[:2], x[:3], x):  # the plan's default rows, and more than the last bucket
            assert torch.equal(
                layer.run_plan(rows, EVERY_KERNEL_PLAN), F.linear(rows, layer.weight, layer.bias)
            )
        with pytest.raises(RuntimeError, match="x has 95 features, the weight takes 96"):
            layer.run_plan(x[:, :95], EVERY_KERNEL_PLAN)
        with pytest.raises(RuntimeError, match="17 rows exceed the largest bucket"):
            layer.run_plan(x, (DEFAULT, *[MKL_BUCKET] * PLAN_ROWS))
        with pytest.raises(RuntimeError, match="unknown kernel 5"):
            layer.run_plan(x[:2], (0, 5, 5))
    with pytest.raises(ValueError, match="a row plan has 18 kernels"):
        layer.use_plan((0, 2))
    with pytest.raises(ValueError, match="MKL's buckets hold at most 16 rows"):
        layer.use_plan((DEFAULT, *[MKL_BUCKET] * PLAN_ROWS))
    onednn_only = frozen_linears(bias=True)
    bucket_linears(onednn_only, only(ONEDNN))  # packed for oneDNN only
    with pytest.raises(ValueError, match="names MKL buckets this layer was not given"):
        onednn_only[0].use_plan(EVERY_KERNEL_PLAN)


def test_a_measured_plan_names_a_kernel_for_every_row_count_and_keeps_only_its_packings():
    model = frozen_linears(bias=True)
    layers = [PackedLinear.wrap(m, max_rows=0) for m in model]
    for layer in layers:
        layer.pack_row_buckets()
    plan = measure_plan(layers, repeats=1)
    assert len(plan) == PLAN_ROWS + 1 and set(plan) <= set(KERNEL_NAMES)
    used = bucket_linears(model, plan)
    assert used == (() if set(plan[1:]) == {DEFAULT} else plan)
    for layer in model:
        assert (layer._buckets is not None) == (MKL_BUCKET in used[1:])
        assert (layer._packed is not None) == (ONEDNN in used[1:])


def test_weights_that_may_change_or_do_not_fit_get_no_buckets(monkeypatch):
    model = frozen_linears(bias=True)
    model[0].weight.requires_grad_(True)
    assert bucket_linears(model) == ()  # a trainable weight: nothing is packed
    assert not any(isinstance(m, PackedLinear) for m in model)
    with pytest.raises(ValueError, match="requires_grad=True"):
        PackedLinear.wrap(model[0]).pack_row_buckets()
    assert bucket_linears(frozen_linears(bias=True).to(torch.bfloat16)) == ()

    class Scaled(nn.Linear):  # computes more than its weight says: left alone
        def forward(self, x):
            return 2 * super().forward(x)

    mixed = frozen_linears(bias=True)
    mixed[1].__class__ = Scaled
    assert bucket_linears(mixed, EVERY_KERNEL_PLAN) and type(mixed[1]) is Scaled
    assert isinstance(mixed[0], PackedLinear) and mixed[0]._plan == EVERY_KERNEL_PLAN
    weights = sum(p.numel() * 4 for p in frozen_linears(bias=True).parameters() if p.dim() == 2)
    monkeypatch.setattr("specforge.engine.cpu.row_buckets.MAX_BUCKET_BYTES", 2 * weights)
    assert bucket_linears(frozen_linears(bias=True)) == ()  # three copies would not fit
    assert MAX_BUCKET_BYTES >= 3 * 135_000_000 * 4  # SmolLM2 in float32 fits


def test_a_model_with_buckets_copies_and_pickles_without_them():
    model = frozen_linears(bias=True)
    bucket_linears(model, EVERY_KERNEL_PLAN)
    x = torch.randn(5, 96)
    model[0].max_rows = 8  # its eager calls packed by oneDNN too
    with torch.no_grad():
        model(x)
    assert model[0]._packed is not None
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert all(m._buckets is None and m._packed is None and m._plan is None for m in copied)
        assert model[0]._buckets is not None
        with torch.no_grad():
            torch.testing.assert_close(copied(x), model(x))


def test_the_engine_refuses_to_run_weights_changed_after_it_packed_them():
    target = make_tiny_llama(96, num_layers=2, seed=3).float().requires_grad_(False)
    engine = TargetEngine(
        target, aux_layer_ids=[0, 1, 1], compile=True, row_buckets=EVERY_KERNEL_PLAN
    )
    assert engine.stats.row_buckets == sum(isinstance(m, nn.Linear) for m in target.modules()) - 1
    assert engine.stats.row_plan == describe_plan(EVERY_KERNEL_PLAN)
    engine.new_cache(8)
    with torch.no_grad():
        target.model.layers[1].mlp.down_proj.weight.mul_(2)  # in place: the packing is stale
    with pytest.raises(UserError, match="weights changed after the engine packed them"):
        engine.new_cache(8)
