"""Structured outputs (issue #21): grammars from xgrammar, compiled off the busy loop and cached
(``manager``), checked without a tokenizer in the front end (``spec``), each step's next-token
bitmask filled on the engine's fill thread (``fill``) and applied in the sampler's logits
(``bitmask``)."""
