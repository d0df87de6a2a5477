"""Text in and out of token ids.

- ``tokenizer.py``: ``Tokenizer`` (BOS/EOS, the chat template rendered in a jinja2 sandbox,
  streaming detokenization) over one of two backends:
- ``tokenizer_hf.py``: the ``tokenizers`` backend (tokenizer.json, GGUF vocabularies,
  SentencePiece BPE converted as transformers does);
- ``tokenizer_spm.py``: the ``sentencepiece`` backend for ``tokenizer.model``, with the dir's
  added tokens.
- ``detokenizer.py``: incremental detokenization of a token stream.
- ``stop.py``: stop strings over streamed text."""
