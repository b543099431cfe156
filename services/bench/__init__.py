"""The benchmark harness: a load generator for OpenAI-compatible servers, and the runs that compare
tokenbus with `vllm serve` and measure the edge and bus alone."""
