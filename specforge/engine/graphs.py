"""Forwards as CUDA graphs: an eager function captured once per shape and replayed, as SGLang's
and vLLM's runners do (no compiler: a graph costs a few forwards to capture, where inductor
took minutes to compile the target's layer loop on an H200).

A shape is the shapes of the function's tensor inputs (for the target: the token count and the
key span of :func:`~specforge.engine.cache.key_span`). Its graph is captured the first time
the shape runs: the inputs are copied into tensors the graph owns, the function runs once
eagerly on a side stream (whatever it initialises lazily is then in place before the capture)
and is captured over those tensors and the cache's buffers; every later call of that shape
copies its inputs in and replays. The warm-up writes the cache exactly what the replay writes
(the same keys and values at the same slots), so it changes nothing. The graphs read and write
the buffers of a :class:`~specforge.engine.cache.SlotKVPool` (or of one cache that keeps its
own); when the pool allocates new ones (a longer sequence), every graph is dropped and captured
again over them.

The graphs share one private memory pool, so a graph captured later may keep its working memory
where an earlier one left its outputs: replaying it would overwrite them. So each graph copies
its outputs, after every replay, into buffers of its own outside the pool, and what a call
returns stays valid until the next call of the **same shape** (then it is overwritten: copy
what must outlive it). ``tests/engine/test_graphs.py`` holds the CPU model of that rule, which
poisons every other graph's pool outputs on each replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from specforge.engine.cache import SlotKVPool

CAPTURE_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
"""The attention kernels SDPA may pick for a captured forward: its usual choices but cuDNN's,
which SDPA tries first on SM90 with recent PyTorch and which has failed under capture with
non-causal masks over long key spans (asserts, "no execution plans", NaN). A graph replays the
kernels chosen at its capture, so the pin holds for every replay."""


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    """The tensors the graph reads its inputs from."""
    pool_outputs: tuple[torch.Tensor, ...]
    """Where each replay leaves the function's outputs, in the shared pool."""
    outputs: tuple[torch.Tensor, ...]
    """The graph's own copies of them, outside the pool: what a call returns."""


class CudaGraphs:
    """``run(*inputs, cache)`` replayed from one CUDA graph per shape of ``inputs`` (see the
    module docstring). Returns what ``run`` returns, in the graph's own tensors: valid until the
    next call of the same shape, which overwrites them.

    Args:
        run: an eager forward over tensors and a cache whose buffers are taken.
        pool: the buffers the caches' layers take in turn (None: one cache's, which never
            move).
    """

    def __init__(self, run, pool: SlotKVPool | None = None):
        self.run = run
        self.pool = pool
        self.graphs: dict[tuple, _Graph] = {}
        self.captures = 0
        """Graphs captured so far (again after a change of buffers too)."""
        self._generation = self._buffers()
        self._memory = None
        """The memory pool the graphs share (their outputs are copied out of it after each
        replay: see the module docstring)."""

    def __call__(self, *inputs: torch.Tensor, cache):
        if self._buffers() != self._generation:  # the graphs point at freed buffers
            self.graphs.clear()
            self._generation = self._buffers()
        shape = tuple(tuple(tensor.shape) for tensor in inputs)
        graph = self.graphs.get(shape)
        if graph is None:
            with sdpa_kernel(list(CAPTURE_BACKENDS)):
                graph = self._capture([t.clone() for t in inputs], cache)
            self.graphs[shape] = graph
        else:
            for static, value in zip(graph.inputs, inputs, strict=True):
                static.copy_(value)
        self._replay(graph)
        for own, pooled in zip(graph.outputs, graph.pool_outputs, strict=True):
            if own is not None:
                own.copy_(pooled)
        return graph.outputs

    def _replay(self, graph: _Graph) -> None:
        graph.graph.replay()

    def _buffers(self) -> int:
        """Which buffers the graphs were recorded over (the pool's generation)."""
        return 0 if self.pool is None else self.pool.generation

    def _capture(self, inputs: list[torch.Tensor], cache) -> _Graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.run(*inputs, cache=cache)  # the warm-up: lazy set-ups happen outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        if self._memory is None:
            self._memory = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._memory):
            outputs = self.run(*inputs, cache=cache)
        self.captures += 1
        return _Graph(graph, inputs, outputs, own_copies(outputs))


RUNNERS: dict[str, type[CudaGraphs]] = {"cuda": CudaGraphs}
"""What replays a compiled forward's graphs on each device type: CUDA graphs on a CUDA device.
The test suite registers its CPU model of them here (``tests/engine/fake_graphs.py``), so that
the engine's graph paths run, and are checked, without a GPU."""


def graph_runner(device: torch.device) -> type[CudaGraphs] | None:
    """The graph runner for ``device`` (:data:`RUNNERS`), or ``None``: no graphs there."""
    return RUNNERS.get(torch.device(device).type)


def own_copies(outputs) -> tuple:
    """Buffers outside the graphs' pool shaped as ``outputs`` (``None`` stays ``None``)."""
    return tuple(None if t is None else torch.empty_like(t) for t in outputs)
