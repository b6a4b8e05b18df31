"""Structured output: grammars that constrain what an engine samples, on xgrammar.

- `spec.py`: `GrammarSpec` (a JSON schema, any JSON object, or a regex), the one validator the router's
  fronts and the peers share (`GrammarSpec.check`, tokenizer-free), and `GrammarError` (INVALID_GRAMMAR).
- `masks.py`: the engine side. `GrammarCompiler` compiles a spec against the engine's vocabulary once per
  engine (xgrammar caches compiled grammars); `TokenGrammar` is one request's matcher; `constrain` masks a
  step's logits, touching only the rows of requests that carry a grammar.

xgrammar is imported on first use, so requests without a grammar (and processes that never see one) do
not pay for it.
"""

from xavier_core.grammar.spec import GrammarError, GrammarKind, GrammarSpec

__all__ = ["GrammarError", "GrammarKind", "GrammarSpec"]
