"""Speculative decoding: a proposer guesses each decoding request's next tokens (ngram.py), the
engine computes them in one step with the request's last token (scheduler.py gives them
lookahead slots; step_input.py asks for logits at every one of those positions), and verify.py
keeps the longest accepted prefix plus one token, by the rule that preserves the target's
distribution (rejection.py); the rejected tokens' slots go back (block_manager.trim)."""
