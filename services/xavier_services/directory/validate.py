"""Input checks shared by the directory's state machine: bad input is INVALID_ARGUMENT, never a crash."""

from __future__ import annotations

import re

from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_core.runtime.errors import InvalidArgument
from xavier_services.directory.config import DirectorySettings

__all__ = [
    "MAX_ROOM_ID",
    "check_endpoint",
    "check_layout",
    "check_peer_id",
    "check_request_id",
    "check_room_id",
    "check_source",
    "check_text",
]

MAX_ROOM_ID = (1 << 63) - 1
_PEER_ID = re.compile(r"[A-Za-z0-9._:@\-]{1,128}")
_MAX_TEXT = 256
_MAX_REQUEST_ID = 128


def check_room_id(room_id: int) -> None:
    """Room ids are 63-bit and never 0."""
    if not 0 < room_id <= MAX_ROOM_ID:
        raise InvalidArgument(f"room_id {room_id} out of range 1..2^63-1", field="room_id")


def check_peer_id(peer_id: str, name: str = "peer_id") -> None:
    """1..128 of ``[A-Za-z0-9._:@-]``."""
    if not _PEER_ID.fullmatch(peer_id):
        raise InvalidArgument(f"{name} must be 1..128 of [A-Za-z0-9._:@-], got {peer_id[:64]!r}", field=name)


def check_request_id(request_id: str) -> None:
    """At most 128 characters; empty means no idempotency."""
    if len(request_id) > _MAX_REQUEST_ID:
        raise InvalidArgument(f"request_id longer than {_MAX_REQUEST_ID}", field="request_id")


def check_text(value: str, name: str, *, required: bool = False, limit: int = _MAX_TEXT) -> None:
    """A bounded string field."""
    if required and not value:
        raise InvalidArgument(f"{name} is required", field=name)
    if len(value) > limit:
        raise InvalidArgument(f"{name} longer than {limit} characters", field=name)


def check_layout(layout: types_pb2.KvLayout) -> None:
    """A layout that a peer serving KV must declare."""
    for name in ("engine", "dtype", "memory_layout"):
        check_text(getattr(layout, name), f"layout.{name}", required=True)
    for name in ("engine_version", "model_name"):
        check_text(getattr(layout, name), f"layout.{name}")
    for name in ("weights_fingerprint", "tokenizer_fingerprint", "config_fingerprint"):
        check_text(getattr(layout, name), f"layout.{name}", limit=128)
    for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
        if getattr(layout, name) == 0:
            raise InvalidArgument(f"layout.{name} must be positive", field=f"layout.{name}")


def check_endpoint(endpoint: types_pb2.TransferEndpoint, settings: DirectorySettings, name: str) -> None:
    """A transfer endpoint within the configured bounds."""
    if endpoint.kind == types_pb2.TRANSPORT_KIND_UNSPECIFIED:
        raise InvalidArgument(f"{name}.kind is required", field=f"{name}.kind")
    if endpoint.kind not in types_pb2.TransportKind.values():
        raise InvalidArgument(f"{name}.kind {endpoint.kind} unknown", field=f"{name}.kind")
    check_text(endpoint.agent_name, f"{name}.agent_name")
    check_text(endpoint.host_id, f"{name}.host_id")
    if len(endpoint.agent_metadata) > settings.max_metadata_bytes:
        raise InvalidArgument(
            f"{name}.agent_metadata larger than {settings.max_metadata_bytes} bytes",
            field=f"{name}.agent_metadata",
        )
    if len(endpoint.regions) > settings.max_regions:
        raise InvalidArgument(f"{name}.regions has more than {settings.max_regions}", field=f"{name}.regions")
    for region in endpoint.regions:
        if len(region.device) > 32:
            raise InvalidArgument(f"{name}.regions[].device too long", field=f"{name}.regions")


def check_source(source: dpb.SourceDescriptor, settings: DirectorySettings) -> None:
    """Page runs bounded and adding up to ``num_pages``; text fields bounded."""
    runs = source.page_runs
    if len(runs) > settings.max_page_runs:
        raise InvalidArgument(
            f"source.page_runs has more than {settings.max_page_runs}", field="source.page_runs"
        )
    total = 0
    for run in runs:
        if run.count == 0:
            raise InvalidArgument("source.page_runs has an empty run", field="source.page_runs")
        total += run.count
    if total != source.num_pages:
        raise InvalidArgument(
            f"source.page_runs hold {total} pages but num_pages is {source.num_pages}",
            field="source.num_pages",
        )
    for extra in ("staging_runs", "aux_runs"):  # slot runs the reader checks against the source's slots
        if len(getattr(source, extra)) > settings.max_page_runs:
            raise InvalidArgument(
                f"source.{extra} has more than {settings.max_page_runs}", field=f"source.{extra}"
            )
    check_text(source.read_token, "source.read_token", limit=128)
    check_text(source.contract_fingerprint, "source.contract_fingerprint", limit=128)
