"""Speculative decoding: proposers that need no weights (n-gram prompt lookup, suffix decoding), and
the rejection sampler that verifies their drafts against the target model's distribution."""
