"""Tokenizer of a checkpoint (`tokenizers` library), its chat template, and incremental detokenization."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders

from xavier_core.text.errors import ModelFilesError

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: each byte's stand-in character → the byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_OF = _byte_level_alphabet()


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Templates' `tojson` as transformers defines it (plain `json.dumps`, no HTML escaping): chat
    templates write tools and tool calls with it."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class TextTokenizer:
    """Encodes and decodes text, and renders the checkpoint's chat template."""

    def __init__(self, tokenizer: Tokenizer, config: Mapping[str, Any], chat_template: str | None) -> None:
        self._tok = tokenizer
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.chat_template = chat_template
        # What a user may type but must not become a control token: the text of every special token.
        added = tokenizer.get_added_tokens_decoder().values()
        self.special_texts = frozenset(str(t.content) for t in added if t.special and t.content)
        self._plain: Tokenizer | None = None  # made on first use: few prompts ever need it
        self._template: jinja2.Template | None = None
        if chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            env.filters["tojson"] = _tojson
            try:
                self._template = env.from_string(chat_template)
            except jinja2.TemplateError as exc:
                raise ModelFilesError(f"chat template does not compile: {exc}") from exc

    @classmethod
    def load(cls, model_dir: Path) -> TextTokenizer:
        """Loads tokenizer.json, tokenizer_config.json and an optional chat_template.jinja."""
        tok_path = model_dir / "tokenizer.json"
        if not tok_path.is_file():
            raise ModelFilesError(f"missing file {tok_path}")
        try:
            tokenizer = Tokenizer.from_file(str(tok_path))
        except Exception as exc:  # the Rust side raises a bare Exception on malformed files
            raise ModelFilesError(f"cannot parse {tok_path}: {exc}") from exc
        config: dict[str, Any] = {}
        cfg_path = model_dir / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                config = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ModelFilesError(f"cannot parse {cfg_path}: {exc}") from exc
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: pick "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_path = model_dir / "chat_template.jinja"
        if not template and jinja_path.is_file():
            template = jinja_path.read_text(encoding="utf-8")
        return cls(tokenizer, config, template if isinstance(template, str) else None)

    @property
    def vocab_size(self) -> int:
        """Number of tokens the tokenizer knows (may be below the model's padded vocab)."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; a BOS is prepended when the tokenizer config asks for one."""
        ids = list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids.insert(0, self.bos_token_id)
        return ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` read as text only: a special token's text (`<|im_start|>`) is encoded as
        the characters it is made of, never as the control token."""
        if not self.special_texts:
            return list(self._tok.encode(text, add_special_tokens=False).ids)
        if self._plain is None:  # two threads racing here build two equal copies: harmless
            plain = Tokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return list(self._plain.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`."""
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI logprobs `bytes`): for byte-level BPE and byte-fallback
        tokens these may be part of a character, which `decode` would show as U+FFFD."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if isinstance(self._tok.decoder, decoders.ByteLevel) and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        match = _BYTE_TOKEN.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode()  # SentencePiece's word marker is a space

    def vocabulary(self) -> list[str]:
        """Every vocabulary entry (added tokens included), as the tokenizer spells it."""
        return list(self._tok.get_vocab(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        """Id of one vocabulary entry, or None."""
        value = self._tok.token_to_id(token)
        return int(value) if value is not None else None

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Renders `messages` with the checkpoint's chat template."""
        if self._template is None:
            raise ModelFilesError("the checkpoint has no chat template")
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            eos_token=self.eos_token or "",
            bos_token=self.bos_token or "",
            **kwargs,
        )


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas without splitting UTF-8 characters.

    Decodes a short window `[prefix_offset, len)` and compares it with `[prefix_offset, read_offset)`:
    byte-level BPE tokens may carry half a character, which decodes to U+FFFD until the rest arrives, so
    such text is held back. `flush()` at the end releases what is still held, as U+FFFD where the bytes
    never completed, so the deltas add up to what `decode` of the whole output gives (HF's behaviour).
    """

    def __init__(self, tokenizer: TextTokenizer, context: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._ids: list[int] = list(context[-6:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_id: int) -> str:
        """Adds one token and returns the newly completed text (possibly "")."""
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self._prefix_offset > 64:  # keep the decode window short
            drop = self._prefix_offset
            self._ids = self._ids[drop:]
            self._prefix_offset -= drop
            self._read_offset -= drop
        return delta

    def copy(self) -> IncrementalDetokenizer:
        """An independent detokenizer in the same state (to try a token without committing it)."""
        twin = IncrementalDetokenizer(self._tok)
        twin._ids, twin._prefix_offset, twin._read_offset = (
            list(self._ids),
            self._prefix_offset,
            self._read_offset,
        )
        return twin

    def flush(self) -> str:
        """The held-back text of the last tokens (U+FFFD for bytes that never formed a character)."""
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


class StopMatcher:
    """Holds back text that could still turn into a stop string, so no stop string is ever emitted
    (with `include`, the text ends with the stop string matched, as vLLM's include_stop_str_in_output)."""

    def __init__(self, stops: Sequence[str], *, include: bool = False) -> None:
        self._stops = [s for s in stops if s]
        self._pending = ""
        self._include = include

    def feed(self, delta: str, *, armed: bool = True) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was reached). While not `armed` (before
        `min_tokens`) nothing stops and nothing is held back."""
        if not self._stops:
            return delta, False
        text = self._pending + delta
        if not armed:
            self._pending = ""
            return text, False
        hits = [(i, -len(s)) for s, i in ((s, text.find(s)) for s in self._stops) if i >= 0]
        if hits:
            self._pending = ""
            at, minus_len = min(hits)  # the earliest match; of those starting there, the longest
            return text[: at - minus_len if self._include else at], True
        keep = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        self._pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def copy(self) -> StopMatcher:
        """An independent matcher in the same state."""
        twin = StopMatcher(self._stops, include=self._include)
        twin._pending = self._pending
        return twin

    def flush(self) -> str:
        """Returns held-back text when the request ends for another reason."""
        text, self._pending = self._pending, ""
        return text
