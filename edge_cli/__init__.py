"""The `edge-runtime` command: its subcommands, the benchmarks, the demo and MTP training.

The only package that wires the device (`edge_runtime`) and the cloud (`cloud_fallback`) together."""
