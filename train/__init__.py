"""Reference models, data, the training CLI and benchmarks built on jaxamp's public API."""
