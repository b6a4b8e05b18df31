"""The KV compatibility contract: layouts, their fingerprints, and the compatibility check."""

from xavier_core.contract.compat import differing_fields, require_compatible
from xavier_core.contract.hashing import FileHashCache, default_cache_dir, fingerprint_files, sha256_file
from xavier_core.contract.layout import (
    DEFAULT_MEMORY_LAYOUT,
    FINGERPRINT_FIELDS,
    TOKENIZER_FILES,
    KvLayout,
    layout_from_model_dir,
)

__all__ = [
    "DEFAULT_MEMORY_LAYOUT",
    "FINGERPRINT_FIELDS",
    "TOKENIZER_FILES",
    "FileHashCache",
    "KvLayout",
    "default_cache_dir",
    "differing_fields",
    "fingerprint_files",
    "layout_from_model_dir",
    "require_compatible",
    "sha256_file",
]
