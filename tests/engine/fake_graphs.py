"""A CPU model of CUDA graphs, to run the engine's graph paths without a GPU.

:class:`FakeCudaGraphs` keeps what makes CUDA graphs unlike eager forwards:

- a capture records the forward once (``make_fx``) over the tensors it was given and the cache
  buffers it wrote, which the record holds by address: a replay reads its inputs from those
  tensors, writes those buffers, and runs none of the Python around the forward again;
- a forward that reads a tensor on the host fails to capture ("operation not permitted when
  stream is capturing"), as on a GPU (:func:`~specforge.engine.host_sync.host_sync`);
- a replay leaves its outputs in the memory pool the graphs share, where any other graph's
  replay may overwrite them: here every replay fills the other graphs' pool outputs with NaN.

``use_fake_graphs(monkeypatch)`` registers it for CPU tensors
(:data:`specforge.engine.graphs.RUNNERS`), so the engine compiles to graphs on a CPU.
"""

from __future__ import annotations

from torch.fx.experimental.proxy_tensor import make_fx

from specforge.engine import graphs
from specforge.engine.graphs import CudaGraphs, _Graph, own_copies
from specforge.engine.host_sync import host_sync


class FakeCudaGraphs(CudaGraphs):
    """:class:`~specforge.engine.graphs.CudaGraphs` on a CPU (see the module docstring)."""

    def _capture(self, inputs, cache) -> _Graph:
        self.run(*inputs, cache=cache)  # the warm-up, as on the side stream
        sync = host_sync(None, self.run, *inputs, cache=cache)
        if sync is not None:
            raise RuntimeError(f"operation not permitted when stream is capturing: {sync}")
        record = make_fx(lambda *tensors: self.run(*tensors, cache=cache))(*inputs)
        outputs = tuple(None if t is None else t.clone() for t in record(*inputs))
        self.captures += 1
        return _Graph(record, inputs, outputs, own_copies(outputs))

    def _replay(self, graph: _Graph) -> None:
        for pooled, value in zip(graph.pool_outputs, graph.graph(*graph.inputs), strict=True):
            if pooled is not None:
                pooled.copy_(value)
        for other in self.graphs.values():
            if other is not graph:
                for pooled in other.pool_outputs:
                    if pooled is not None and pooled.is_floating_point():
                        pooled.fill_(float("nan"))


def use_fake_graphs(monkeypatch) -> None:
    """Compile to :class:`FakeCudaGraphs` on a CPU for the rest of the test."""
    monkeypatch.setitem(graphs.RUNNERS, "cpu", FakeCudaGraphs)
