"""`pagoda bench throughput|latency|serve` (vLLM's benchmarks layout): the
workloads (datasets), the offline and online benchmarks, the Hugging Face
transformers baseline, and public model shapes for dummy-weight runs."""
