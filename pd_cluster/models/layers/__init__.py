"""Building blocks of the decoder: tensor-parallel linears and embeddings, norms, rotary."""
