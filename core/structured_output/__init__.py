"""Structured outputs (issue #21): grammars from xgrammar, compiled off the busy loop and cached
(``manager``), checked without a tokenizer in the front end (``spec``), and applied as a
next-token bitmask in the sampler's logits (``bitmask``)."""
