"""Speculative decoding beside the model runner: proposers draft tokens, the verifier accepts
them from one target forward over every drafted position (greedy match or rejection sampling).
"""
