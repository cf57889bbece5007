"""Every benchmark entry point (benchmarks/README.md lists them); figures in RESULTS.md."""
