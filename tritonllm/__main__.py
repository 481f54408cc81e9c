from tritonllm.cli import main

main()
