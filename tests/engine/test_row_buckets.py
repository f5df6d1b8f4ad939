"""Row buckets: a compiled graph's few-row float32 calls through MKL's weight packed for a row
count (``specforge::bucket_linear``), inside the same dynamic graph, equal to the default's
product to rounding, a row's bits independent of the rows beside it."""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specforge.engine.row_buckets import MAX_BUCKET_BYTES, bucket_linears, row_buckets_missing
from specforge.engine.target import TargetEngine
from specforge.errors import UserError
from specforge.models.packed_linear import BUCKET_DEFAULT_ROWS, ROW_BUCKETS, PackedLinear
from tests.helpers import make_tiny_llama

pytestmark = pytest.mark.skipif(
    row_buckets_missing() is not None, reason=f"row buckets: {row_buckets_missing()}"
)
SMALL, LARGE = ROW_BUCKETS


def frozen_linears(bias: bool) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(96, 160, bias=bias), nn.Linear(160, 96, bias=bias)]
    return nn.Sequential(*layers).requires_grad_(False)


def bucket_op(layer: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    small, large = layer._buckets
    op = torch.ops.specforge.bucket_linear
    return op(x, layer.weight, layer.bias, BUCKET_DEFAULT_ROWS, small, SMALL, large, LARGE)


@pytest.mark.parametrize("bias", [True, False])
def test_few_row_calls_run_inside_one_dynamic_graph_and_agree_with_the_default(bias):
    model = frozen_linears(bias)
    x = torch.randn(1, LARGE + 4, 96)
    with torch.no_grad():
        want = [model(x[:, :count]) for count in range(1, x.shape[1] + 1)]
    assert bucket_linears(model) == 2
    assert all(isinstance(m, PackedLinear) and m.max_rows == 0 for m in model)  # eager: default
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(str(graph.code))
        return graph.forward

    run = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
    with torch.no_grad():
        for count, expected in enumerate(want, start=1):
            torch.testing.assert_close(run(x[:, :count].clone()), expected, rtol=1e-5, atol=1e-5)
    # the one-row graph keeps the default's kernel; one graph takes every other row count
    assert len(graphs) == 2
    assert "bucket_linear" not in graphs[0] and graphs[1].count("bucket_linear") == 2


def test_a_row_does_not_depend_on_the_rows_beside_it_in_its_bucket():
    model = frozen_linears(bias=True)
    bucket_linears(model)
    layer = model[0]
    x = torch.randn(LARGE, 96)
    with torch.no_grad():
        small, large = bucket_op(layer, x[:SMALL]), bucket_op(layer, x)
        for rows in range(BUCKET_DEFAULT_ROWS + 1, SMALL + 1):
            assert torch.equal(bucket_op(layer, x[:rows]), small[:rows])
        for rows in (SMALL + 1, LARGE - 1):
            assert torch.equal(bucket_op(layer, x[:rows]), large[:rows])
        torch.testing.assert_close(large, F.linear(x, layer.weight, layer.bias))
        # leading dimensions as the models pass them, (B, T, H)
        assert torch.equal(bucket_op(layer, x[None, :5]), small[None, :5])
        with pytest.raises(RuntimeError, match="rows must grow"):
            op = torch.ops.specforge.bucket_linear
            op(
                x,
                layer.weight,
                layer.bias,
                SMALL,
                *layer._buckets[:1],
                SMALL,
                layer._buckets[1],
                LARGE,
            )
        # up to 3 rows and more rows than the last bucket: the default's product
        for rows in (x[:1], x[:BUCKET_DEFAULT_ROWS], torch.randn(LARGE + 1, 96)):
            assert torch.equal(bucket_op(layer, rows), F.linear(rows, layer.weight, layer.bias))
        with pytest.raises(RuntimeError, match="x has 95 features, the weight takes 96"):
            bucket_op(layer, x[:, :95])


def test_weights_that_may_change_or_do_not_fit_get_no_buckets(monkeypatch):
    model = frozen_linears(bias=True)
    model[0].weight.requires_grad_(True)
    assert bucket_linears(model) == 0  # a trainable weight: nothing is packed
    assert not any(isinstance(m, PackedLinear) for m in model)
    with pytest.raises(ValueError, match="requires_grad=True"):
        PackedLinear.wrap(model[0]).pack_row_buckets()
    assert bucket_linears(frozen_linears(bias=True).to(torch.bfloat16)) == 0

    class Scaled(nn.Linear):  # computes more than its weight says: left alone
        def forward(self, x):
            return 2 * super().forward(x)

    mixed = frozen_linears(bias=True)
    mixed[1].__class__ = Scaled
    assert bucket_linears(mixed) == 1 and type(mixed[1]) is Scaled
    weights = sum(p.numel() * 4 for p in frozen_linears(bias=True).parameters() if p.dim() == 2)
    monkeypatch.setattr("specforge.engine.row_buckets.MAX_BUCKET_BYTES", weights)
    assert bucket_linears(frozen_linears(bias=True)) == 0  # two copies would not fit
    assert MAX_BUCKET_BYTES >= 2 * 135_000_000 * 4  # SmolLM2 in float32 fits


def test_a_model_with_buckets_copies_and_pickles_without_them():
    model = frozen_linears(bias=True)
    bucket_linears(model)
    x = torch.randn(5, 96)
    model[0].max_rows = 8  # its eager calls packed by oneDNN too
    with torch.no_grad():
        model(x)
    assert model[0]._packed is not None
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert all(m._buckets is None and m._packed is None for m in copied)
        assert model[0]._buckets is not None
        with torch.no_grad():
            torch.testing.assert_close(copied(x), model(x))


def test_the_engine_refuses_to_run_weights_changed_after_it_packed_them():
    target = make_tiny_llama(96, num_layers=2, seed=3).float().requires_grad_(False)
    engine = TargetEngine(target, aux_layer_ids=[0, 1, 1], compile=True)
    assert engine.stats.row_buckets == sum(isinstance(m, nn.Linear) for m in target.modules()) - 1
    engine.new_cache(8)
    with torch.no_grad():
        target.model.layers[1].mlp.down_proj.weight.mul_(2)  # in place: the packing is stale
    with pytest.raises(UserError, match="weights changed after the engine packed them"):
        engine.new_cache(8)
