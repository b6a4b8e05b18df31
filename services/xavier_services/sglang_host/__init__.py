"""Services that host an SGLang server: `engine.kind = "sglang"` for prefill, decode and unified."""
