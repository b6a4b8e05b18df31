"""Text around the model, shared by the engine and the router: the checkpoint's tokenizer and chat
template, incremental detokenization and stop strings.

Nothing here knows an engine or gRPC: the router tokenizes without loading an engine.
"""

from xavier_core.text.errors import ModelFilesError
from xavier_core.text.tokenizer import IncrementalDetokenizer, StopMatcher, TextTokenizer

__all__ = ["IncrementalDetokenizer", "ModelFilesError", "StopMatcher", "TextTokenizer"]
