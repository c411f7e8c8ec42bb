"""Benchmark suites: jaxamp side by side with jmp, flax ``DynamicScale``, optax and PyTorch AMP.

    python -m benchmarks overhead [--rounds 30]    # CPU: the AMP machinery's cost per step
    python -m benchmarks memory                    # saved activations and optimizer-state bytes
    python -m benchmarks torch [--rounds 20]       # PyTorch autocast against jaxamp, alternated
    python -m benchmarks cpu_flags                 # the torch suite under each XLA:CPU option
    python -m benchmarks gpu                       # throughput, MFU, memory on a GPU (gpu.sh)
    python -m benchmarks layout [--rounds 100]     # a step's bytes by kind of HLO instruction
    python -m benchmarks cpu_dtypes                # bf16 against fp32 kernels on the CPU
    python -m benchmarks long_fp16                 # 5000 fp16 steps of a cycling loss scale
    python -m benchmarks remat                     # a model's own remat under autocast (+ H200)
    python -m benchmarks compile_time              # trace + compile with autocast, interleaved
    python -m benchmarks numerics [--arms ...]     # eval loss vs the twin: paired seeds, 95% CI
    python -m benchmarks moments                   # Adam's nu in bf16 and 8 bits against fp32
    python -m benchmarks conformance               # autocast on JAX's primitive harnesses
    python -m benchmarks maxtext                   # MaxText's llama2: autocast vs its bf16
    python -m benchmarks all --tiny                # every suite at a tiny size (what the tests run)

The overhead, memory, torch, cpu_flags and gpu suites print a markdown table, write one JSON line
per row to ``OUT/<suite>.jsonl`` and a bar chart to ``OUT/<suite>.png`` (``--out``, default
``runs/bench``); layout, cpu_dtypes and long_fp16 print their tables. Times are medians over
interleaved rounds in one process (A B C, B C A, ...), and ratios are taken within the process;
flops and bytes come from XLA's ``cost_analysis()`` and are deterministic. The published figures
are in BENCHMARKS.md, their JSON lines and charts in ``benchmarks/results/``.

One module per suite, each with a ``run(args)``; :mod:`benchmarks.harness` holds the timing, the
cost analysis and the outputs, :mod:`benchmarks.peers` the peers' recipes. Nothing here is part
of the jaxamp wheel.
"""
