"""pdserve: disaggregated prefill/decode LLM serving over gRPC, on vLLM."""

__version__ = "0.1.0"
