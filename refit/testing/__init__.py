"""Reference actors and launchers used by the demo, the benchmarks and the tests."""
