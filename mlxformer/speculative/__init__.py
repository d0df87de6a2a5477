"""Speculative decoding: propose several tokens cheaply, verify them in one target pass.

- ``speculator.py``: ``SpeculativeSettings``, the prompt-lookup and draft-model proposers,
  ``verify`` and ``Speculator`` (one sequence's rounds, verification and cache rewind).
- ``mtp.py``: native MTP, the checkpoint's own ``mtp.*`` head (``models/mtp.py``) as the draft."""
