"""Public API of the engine: a paged, prefix-caching dynamic generator.

Data flow: Tokenizer -> token ids -> Model.forward(ragged batch over paged KV) -> logits.
"""
