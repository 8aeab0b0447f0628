"""The CPU wing: everything that exists only to make a CPU fast, beside the model, never inside it.

`minfer.platform.CpuPlatform` (kernels="auto") picks these once per worker; kernels="reference" uses none of
them (no module here is imported, no C++ is loaded). A decode step of the engine on a CPU meets them in
this order:

    malloc.py        glibc malloc tuning, set once when the worker starts (`keep_freed_memory`)
    decode_step.py   the step runner: `CpuDecodeStep.run(input_ids, ctx)` runs every layer of a decode step in
                     one C++ call (csrc/decode_layers_cpu.cpp), or returns None and the worker runs the model;
                     it calls the same kernels, in the same order, as the per-op path below
    linear.py        the float weight layouts of every `Linear` ("split", "onednn", "panels", "hybrid")
    gemm_f32.py      the few-row float32 "panels" GEMM (csrc/gemm_f32_cpu.cpp)
    qgemm.py         the integer GEMM of int8 / int4 / gguf weights (csrc/qgemm_cpu.cpp)
    gguf_matmul.py   GGUF blocks repacked for it, and the Q4_0/Q4_1/Q8_0 kernel (csrc/gguf_matmul_cpu.cpp)
    int8_group.py    int8 codes with group scales (gguf Q8_0 heads; csrc/int8_group_cpu.cpp)
    fused_ops.py     RMSNorm(+add), SiLU-and-mul, RoPE as one C++ loop each (csrc/fused_cpu.cpp)
    attention.py     `CpuPagedBackend` / `CpuContiguousBackend`: paged decode attention (csrc/paged_decode_cpu.cpp)
                     and causal prefill attention (csrc/prefill_cpu.cpp)
    sampler.py       the fused sampler over the logits (csrc/sampler_cpu.cpp)

    build.py         the one builder and loader of the C++ libraries in csrc/ (`CppLibrary`)

Each result equals the torch reference's (bit for bit where the tests say so, else to float32 rounding);
chapter 9 measures what each one buys.
"""
