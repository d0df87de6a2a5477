"""Speculative decoding: prompt-lookup and draft-model proposers, rounds and their verification, native MTP."""
