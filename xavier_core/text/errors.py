"""Errors of the text layer (tokenizer files, chat templates, model facts)."""

from __future__ import annotations


class ModelFilesError(Exception):
    """A model directory's tokenizer or config files are missing or malformed, or lack what a call needs
    (a chat template)."""
