"""The CUDA-graph runner's output contract, on a CPU model of a GPU: graphs sharing one memory
pool may reuse each other's output memory, so each replay here poisons every other graph's pool
outputs with NaN (what a later graph's scratch writes would leave there). What a call returns
must stay valid until the next call of the same shape."""

import torch

from specforge.engine.graphs import CAPTURE_BACKENDS, CudaGraphs, _Graph, own_copies


class PoisoningGraphs(CudaGraphs):
    """:class:`CudaGraphs` with capture and replay run eagerly on the CPU, outputs kept in
    "pool" tensors that every other graph's replay overwrites with NaN."""

    def _capture(self, inputs, cache) -> _Graph:
        outputs = tuple(t.clone() for t in self.run(*inputs, cache=cache))
        self.captures += 1
        return _Graph(None, inputs, outputs, own_copies(outputs))

    def _replay(self, graph: _Graph) -> None:
        for pooled, value in zip(
            graph.pool_outputs, self.run(*graph.inputs, cache=None), strict=True
        ):
            pooled.copy_(value)
        for other in self.graphs.values():
            if other is not graph:
                for pooled in other.pool_outputs:
                    pooled.fill_(float("nan"))


def forward(x, *, cache):
    return x * 2, x.sum(-1, keepdim=True)


def test_outputs_stay_valid_until_the_same_shape_runs_again():
    graphs = PoisoningGraphs(forward)
    one = graphs(torch.ones(1, 3), cache=None)
    two = graphs(torch.full((1, 5), 3.0), cache=None)  # another graph replays: pool poisoned
    assert torch.equal(one[0], torch.full((1, 3), 2.0)) and one[1].item() == 3.0
    assert torch.equal(two[0], torch.full((1, 5), 6.0)) and two[1].item() == 15.0
    again = graphs(torch.zeros(1, 3), cache=None)  # the same shape: its own buffers rewritten
    assert again[0] is one[0] and torch.equal(one[0], torch.zeros(1, 3))
    assert graphs.captures == 2


def test_the_model_bites_where_pool_outputs_are_returned():
    """Returning the pool's tensors (the runner before its own copies) reads NaN here."""

    class PoolReturning(PoisoningGraphs):
        def __call__(self, *inputs, cache):
            super().__call__(*inputs, cache=cache)
            shape = tuple(tuple(t.shape) for t in inputs)
            return self.graphs[shape].pool_outputs

    graphs = PoolReturning(forward)
    one = graphs(torch.ones(1, 3), cache=None)
    graphs(torch.ones(1, 5), cache=None)
    assert torch.isnan(one[0]).all()


def test_captures_run_with_sdpa_pinned_away_from_cudnn():
    """The kernels a graph replays are those chosen at its capture: cuDNN's attention is
    excluded there, the others left as SDPA would pick them."""
    seen = []

    def observed(x, *, cache):
        seen.append(
            (
                torch.backends.cuda.cudnn_sdp_enabled(),
                torch.backends.cuda.flash_sdp_enabled(),
                torch.backends.cuda.mem_efficient_sdp_enabled(),
                torch.backends.cuda.math_sdp_enabled(),
            )
        )
        return (x + 1,)

    graphs = PoisoningGraphs(observed)
    graphs(torch.ones(2), cache=None)
    assert seen[0] == (False, True, True, True)  # the capture
    assert [b.name for b in CAPTURE_BACKENDS] == ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
