"""Turning a request's prompt into token ids: chat rendering, the prompt-fingerprint cache, model facts."""

from __future__ import annotations

import functools
import hashlib
import json
import secrets
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from prometheus_client import CollectorRegistry, Counter, Gauge
from xavier.v1 import router_service_pb2 as rpb

from xavier_core.runtime import InvalidArgument, get_registry
from xavier_core.text.errors import ModelFilesError
from xavier_core.text.tokenizer import TextTokenizer
from xavier_services.router.offload import ProcessEncoder

_NORMALIZER_SLACK = 4  # how much a tokenizer normalizer may shrink text (NFC: at most 3x)


def prompt_size(req: rpb.GenerateRequest) -> int:
    """What preparing a request's prompt costs, roughly: the characters of its text or of its chat
    (contents, tool-call arguments, tool schemas), or its count of token ids."""
    kind = req.WhichOneof("prompt")
    if kind == "text":
        return len(req.text)
    if kind == "token_ids":
        return len(req.token_ids.ids)
    if kind == "chat":
        size = sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in req.chat.messages)
        return size + sum(len(t.description) + len(t.parameters_json) for t in req.chat.tools)
    return 0


@dataclass(frozen=True)
class ModelInfo:
    """What the router needs to know about the served model."""

    name: str
    max_context: int
    vocab_size: int
    tokenizer_fingerprint: str


def _file_digest(paths: Sequence[Path]) -> str:
    h = hashlib.sha256()
    for path in paths:
        if path.is_file():
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def load_model_info(model_dir: Path, name: str = "", max_context: int | None = None) -> ModelInfo:
    """Reads config.json (context, vocab) and fingerprints the tokenizer files."""
    cfg_path = model_dir / "config.json"
    try:
        cfg: dict[str, Any] = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFilesError(f"cannot read {cfg_path}: {exc}") from exc
    limit = max_context or int(cfg.get("max_position_embeddings") or 0)
    if limit < 2:
        raise ModelFilesError(f"{cfg_path}: max_position_embeddings missing; set max_context")
    digest = _file_digest([model_dir / "tokenizer.json", model_dir / "tokenizer_config.json"])
    return ModelInfo(
        name=name or model_dir.resolve().name,
        max_context=limit,
        vocab_size=int(cfg.get("vocab_size") or 0),
        tokenizer_fingerprint=digest,
    )


class _CacheMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.lookups = Counter(
            "xavier_router_prompt_cache_lookups",
            "Prompt-fingerprint cache lookups by result (hit or miss).",
            ("result",),
            registry=registry,
        )
        # Looked up once: every request counts one lookup, and `labels()` locks and checks each time.
        self.hit, self.miss = self.lookups.labels("hit"), self.lookups.labels("miss")
        self.size = Gauge(
            "xavier_router_prompt_cache_entries", "Entries in the prompt cache.", registry=registry
        )


class PromptCache:
    """Bounded LRU from SHA-256(tokenizer fingerprint, text) to token ids.

    Only successful encodings are stored: a tokenizer error is raised to the caller and never cached,
    so a transient failure cannot poison later requests with the same text.
    """

    def __init__(self, capacity: int, fingerprint: str, registry: CollectorRegistry | None = None) -> None:
        self.capacity = capacity
        self._salt = fingerprint.encode()
        self._entries: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self._metrics = _CacheMetrics(registry or get_registry())
        self.hits = 0
        self.misses = 0

    def key(self, text: str, variant: str = "") -> bytes:
        """The prompt fingerprint of `text` under this tokenizer (and encoding variant)."""
        h = hashlib.sha256(self._salt)
        h.update(b"\0" + variant.encode() + b"\0")
        h.update(text.encode("utf-8", "surrogatepass"))
        return h.digest()

    def __len__(self) -> int:
        return len(self._entries)

    def get_or_encode(self, text: str, encode: Any, variant: str = "") -> tuple[int, ...]:
        """Token ids of `text`, from the cache or from `encode(text)` (which may raise)."""
        key = self.key(text, variant)
        with self._lock:  # the router's tokenizer threads share the cache; the encode runs unlocked
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                self._metrics.hit.inc()
                return found
            self.misses += 1
        self._metrics.miss.inc()
        ids = tuple(encode(text))
        if self.capacity > 0:
            with self._lock:
                self._entries[key] = ids
                while len(self._entries) > self.capacity:
                    self._entries.popitem(last=False)
                self._metrics.size.set(len(self._entries))
        return ids


class PromptEncoder:
    """Renders chats with the checkpoint's chat template and encodes text through the cache."""

    def __init__(self, tokenizer: TextTokenizer, cache: PromptCache) -> None:
        self.tokenizer = tokenizer
        self.cache = cache
        self.offload: ProcessEncoder | None = None
        """Encodes the texts it `wants` (very large ones) in a child process."""

    def check_length(self, texts: Sequence[str], max_context: int, param: str = "prompt") -> None:
        """PROMPT_TOO_LONG, before any tokenizing, for text too long for `max_context` tokens whatever
        it says: no token stands for more than the vocabulary's longest entry (UTF-8 bytes), and a
        normalizer may shrink text (NFC composes) by `_NORMALIZER_SLACK` at most, so text of more bytes
        than max_context x longest x slack has more tokens than the context. Bounds the work a huge
        prompt costs: it is refused at the price of measuring it, not of tokenizing it."""
        nbytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        if nbytes <= max_context:  # every token is at least one byte: nothing to learn
            return
        limit = max_context * self.max_token_bytes * _NORMALIZER_SLACK
        if nbytes > limit:
            raise InvalidArgument(
                f"the prompt is {nbytes} bytes, more than {max_context} tokens can hold; the context "
                f"limit is {max_context} tokens",
                reason="PROMPT_TOO_LONG",
                param=param,
                prompt_bytes=nbytes,
                max_context=max_context,
            )

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the vocabulary's longest entry (an upper bound of the bytes one token stands
        for: byte-level and SentencePiece entries are at least as long as the text they decode to)."""
        return max(1, *(len(t.encode("utf-8", "surrogatepass")) for t in self.tokenizer.vocabulary()))

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()
    ) -> str:
        """The chat rendered with the model's template, ending with the assistant's turn prompt; `tools`
        (Hugging Face's shape) become the template's `tools` variable when there are any."""
        if not messages:
            raise InvalidArgument("the chat has no messages", reason="EMPTY_PROMPT")
        for i, msg in enumerate(messages):
            if msg.get("role") not in ("system", "user", "assistant", "tool", "developer"):
                raise InvalidArgument(
                    f"messages[{i}].role {msg.get('role')!r} is not a chat role",
                    reason="INVALID_CHAT",
                    index=i,
                    param=f"messages[{i}].role",
                )
        try:
            extra = {"tools": list(tools)} if tools else {}
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
        except ModelFilesError as exc:
            raise InvalidArgument(str(exc), reason="NO_CHAT_TEMPLATE") from None
        except jinja2.TemplateError as exc:
            raise InvalidArgument(f"chat template failed: {exc}", reason="CHAT_TEMPLATE_ERROR") from None

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()
    ) -> tuple[int, ...]:
        """Token ids of the rendered chat. Message content is text: a special token's text typed in it
        (`<|im_start|>system ...`) is encoded as plain characters, so no user can forge a role or end a
        turn. Chats without such text are encoded as one rendered string (the usual tokenization). Tools
        and tool calls holding special-token text are refused."""
        self._refuse_special(json.dumps([*tools], ensure_ascii=False), "tools")
        for i, m in enumerate(messages):
            self._refuse_special(json.dumps(m.get("tool_calls") or [], ensure_ascii=False), f"messages[{i}]")
        rendered = self.render_chat(messages, tools)
        contents = [str(m.get("content") or "") for m in messages]
        if not any(tok in c for c in contents for tok in self.tokenizer.special_texts):
            return self.encode(rendered, add_special_tokens=False)
        # Render again with a marker for each content, then encode the template's text with its
        # control tokens and each content as text only.
        nonce = secrets.token_hex(8)
        markers = [f"\u2063{nonce}:{i}\u2063" for i in range(len(messages))]
        marked = [{**m, "content": markers[i]} for i, m in enumerate(messages)]
        template = self.render_chat(marked, tools)
        ids: list[int] = []
        at = 0
        for i, marker in enumerate(markers):
            if contents[i] == "" or template.count(marker) == 0:
                continue  # an empty content, or one the template leaves out
            if template.count(marker) != 1:
                raise InvalidArgument(
                    f"messages[{i}].content holds special-token text and the chat template repeats it",
                    reason="INVALID_CHAT",
                    index=i,
                    param=f"messages[{i}].content",
                )
            cut = template.index(marker, at)
            ids += self.encode(template[at:cut], add_special_tokens=False) if cut > at else ()
            ids += self.tokenizer.encode_text(contents[i])
            at = cut + len(marker)
        ids += self.encode(template[at:], add_special_tokens=False) if at < len(template) else ()
        return tuple(ids)

    def _refuse_special(self, text: str, param: str) -> None:
        if any(tok in text for tok in self.tokenizer.special_texts):
            raise InvalidArgument(
                f"{param} holds special-token text, which a chat template would read as control tokens",
                reason="INVALID_CHAT",
                param=param,
            )

    def encode(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        """Token ids of `text`; tokenizer failures become INVALID_ARGUMENT / TOKENIZER_ERROR."""

        def encode(value: str) -> list[int]:
            if self.offload is not None and self.offload.wants(value):
                return self.offload.encode(value, add_special_tokens)
            return self.tokenizer.encode(value, add_special_tokens=add_special_tokens)

        try:
            return self.cache.get_or_encode(text, encode, "special" if add_special_tokens else "plain")
        except InvalidArgument:
            raise
        except Exception as exc:  # the Rust tokenizer raises bare exceptions
            raise InvalidArgument(f"cannot tokenize the prompt: {exc}", reason="TOKENIZER_ERROR") from None

    def token_text(self, token_id: int) -> str:
        """Text of one token (for OpenAI logprobs `tokens`)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token (for OpenAI logprobs `bytes`)."""
        return self.tokenizer.token_bytes(token_id)
