"""The `[sglang]` section, by the name SGLang's side knows it: defined with the rest of a peer service's
config in `xavier_services.peer.sglang_section`, so `peer` never imports this package."""

from xavier_services.peer.sglang_section import OWNED_FLAGS, SglangSection, check_extra_args

__all__ = ["OWNED_FLAGS", "SglangSection", "check_extra_args"]
