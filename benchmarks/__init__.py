"""Benchmarks that span packages: serving speed against the machine floors and other servers."""
