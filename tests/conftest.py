import tritonllm  # noqa: F401  (sets TRITON_INTERPRET before any kernel module is imported)
