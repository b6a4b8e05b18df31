"""The router: public gRPC `RouterService` and an OpenAI-compatible HTTP front in one process."""
