"""The CPU kernels, one optional part: nothing here runs on a GPU, and every path that uses them
keeps an exact fallback where they cannot be built or do not pay (no C++ compiler, no AVX-512,
another dtype).

- :mod:`specforge.engine.cpu.decode_kernel`: decode attention through a small C++ kernel
  (``csrc/decode_attention.cpp``), built on first use, which generation hands the model's
  forward as ``decode_kernel``;
- :mod:`specforge.engine.cpu.packed_linear`: float32 linears prepacked for few-row calls, and
  the row plans of the compiled engine's linears (``csrc/bucket_linear.cpp``);
- :mod:`specforge.engine.cpu.row_buckets`: the row plan measured fastest here, applied to the
  engine's own copy of the target's layers;
- :mod:`specforge.engine.cpu.int8_linear`: the draft's linears in int8 with a bfloat16 scale.

They import only PyTorch and the package's lowest layer, so the models' loader may prepack with
them (``tests/test_layout.py`` places them below :mod:`specforge.models`).
"""
